"""A stdio MCP server built with the official Python SDK that reports the environment
its process was started with, for the test that the gateway keeps its own
configuration (`MCPGW_*` variables) out of its stdio children.

usage: env_server.py
"""

import json
import os

from mcp.server.mcpserver import MCPServer

app = MCPServer("env-report")


@app.tool()
async def environment() -> str:
    """The environment of this process, as a JSON object."""
    return json.dumps(dict(os.environ))


if __name__ == "__main__":
    app.run(transport="stdio")
