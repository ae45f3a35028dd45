"""An HTTP MCP server built with the official Python SDK whose tools/list may be
reused for a while (2026-07-28 `ttlMs`), and which counts how often it was listed, so a
test can see whether the gateway listed it again.

usage: cached_list_server.py http PORT NAME TTL_MS

  tools  NAME_hello (answers "hello from NAME"), NAME_lists (how many tools/list
         requests this server answered so far)
  tools/list results carry ttlMs = TTL_MS and cacheScope "public".
"""

import sys

from mcp.server.caching import CacheHint
from mcp.server.mcpserver import MCPServer

NAME = sys.argv[3]
TTL_MS = int(sys.argv[4])


class CountingServer(MCPServer):
    lists = 0

    async def list_tools(self):
        CountingServer.lists += 1
        return await super().list_tools()


app = CountingServer(f"cached-{NAME}", cache_hints={"tools/list": CacheHint(ttl_ms=TTL_MS, scope="public")})


@app.tool(name=f"{NAME}_hello")
async def hello() -> str:
    return f"hello from {NAME}"


@app.tool(name=f"{NAME}_lists")
async def lists() -> str:
    return str(CountingServer.lists)


if __name__ == "__main__":
    print("cached_list_server listening", flush=True)
    app.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
