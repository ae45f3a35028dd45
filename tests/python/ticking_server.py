"""An MCP server built with the official Python SDK whose `tick` tool works in steps
until it is done, its HTTP request goes away, or it is cancelled; the test of client
disconnects uses it to see whether a client that goes away cancels its call upstream.
Over HTTP it answers with plain JSON (no SSE), and `GET /ticks` says how far the calls
got; over stdio the `ticks` tool says the same.

usage: ticking_server.py http PORT
       ticking_server.py stdio
"""

import json
import sys

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse

from mcp.server.mcpserver import Context, MCPServer

app = MCPServer("ticking")
# Steps done by all `tick` calls; calls running; and how the others ended.
progress = {"ticks": 0, "running": 0, "disconnected": 0, "cancelled": 0, "finished": 0}


@app.tool()
async def tick(count: int, interval_ms: int, ctx: Context) -> str:
    """Counts `count` steps, `interval_ms` apart; stops early when the HTTP request
    that asked for it is disconnected."""
    request = ctx.request_context.request
    gone = getattr(request, "is_disconnected", None)
    progress["running"] += 1
    try:
        for _ in range(count):
            if gone is not None and await gone():
                progress["disconnected"] += 1
                return "the client went away"
            progress["ticks"] += 1
            await anyio.sleep(interval_ms / 1000)
        progress["finished"] += 1
        return f"ticked {count} times"
    except anyio.get_cancelled_exc_class():
        progress["cancelled"] += 1
        raise
    finally:
        progress["running"] -= 1


@app.tool()
async def ticks() -> str:
    """How far the `tick` calls got, as JSON."""
    return json.dumps(progress)


@app.custom_route("/ticks", methods=["GET"])
async def ticks_route(_request: Request) -> JSONResponse:
    return JSONResponse(progress)


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        app.run(transport="stdio")
    else:
        print("ticking_server listening", flush=True)
        app.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]), json_response=True)
