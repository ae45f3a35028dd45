"""A stdio MCP server built with the official Python SDK whose calls can be caught
running, for the tests of a child that dies under a call (tests/stdio_loss.rs).

usage: hanging_server.py
One process serves one session: `counter_increment` counts in it, `pid` names it, and
`hang` reports progress (when asked for it), creates the file it is given (so a test
knows the call reached the server and runs) and then does not answer for ten minutes.
"""

import asyncio
import os
import sys

from mcp.server.mcpserver import Context, MCPServer

app = MCPServer("hanging")
count = 0


@app.tool()
async def counter_increment() -> str:
    global count
    count += 1
    return str(count)


@app.tool()
async def pid() -> str:
    return str(os.getpid())


@app.tool()
async def hang(marker: str, ctx: Context) -> str:
    # Sent only when the request asked for progress: then the answer is a stream.
    await ctx.report_progress(1, 2, "hanging")
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    await asyncio.sleep(600)
    return "woke up"


if __name__ == "__main__":
    print(f"hanging_server pid {os.getpid()} on stdio", file=sys.stderr, flush=True)
    app.run(transport="stdio")
