"""A stateful MCP server built with the official Python SDK, for the upstream tests.

usage: stateful_server.py stdio
       stateful_server.py http PORT
Over stdio, one process serves one session, so its module-level state is the
session's state: the gateway must start one process per session. Over HTTP it keeps
one counter per upstream session.
"""

import os
import sys

from pydantic import BaseModel

from mcp.server.mcpserver import Context, MCPServer

app = MCPServer("stateful")
counters: dict[str, int] = {}


def session_key(ctx: Context) -> str:
    # Over stdio there are no headers: the process is the session.
    return (ctx.headers or {}).get("mcp-session-id", "process")


@app.tool()
async def counter_increment(ctx: Context) -> str:
    key = session_key(ctx)
    counters[key] = counters.get(key, 0) + 1
    return str(counters[key])


@app.tool()
async def pid() -> str:
    return str(os.getpid())


class Answer(BaseModel):
    answer: str


@app.tool()
async def ask(question: str, ctx: Context) -> str:
    """Asks the client (elicitation) in the middle of the call."""
    await ctx.report_progress(1, 2, "asking")
    result = await ctx.elicit(question, Answer)
    if result.action != "accept":
        return f"no answer ({result.action})"
    return f"answered: {result.data.answer}"


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        print(f"stateful_server pid {os.getpid()} on stdio", file=sys.stderr, flush=True)
        app.run(transport="stdio")
    else:
        print("stateful_server listening", flush=True)
        app.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
