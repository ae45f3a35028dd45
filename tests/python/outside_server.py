"""An MCP server built with the official Python SDK's low-level Server that sends the
client messages outside any request, for the tests of a virtual server's members'
GET streams.

usage: outside_server.py stdio NAME
       outside_server.py http NAME PORT

The client's notifications/roots/list_changed (a notification: it answers no
request, and no request of the client runs for it) makes the server
  - send notifications/resources/updated for mem://NAME/doc, and
  - ask the client roots/list,
both without a related request. The SDK sends such messages over HTTP on the
session's standalone GET stream only (with no GET stream open they are dropped: no
event store here), and over stdio as lines outside any request.

tools
  roots_answer  waits until its roots/list was answered, then returns JSON
                {"answer": the root names it got, "stray": how many answers it
                received to requests it never sent or no longer waited for}
  get_streams   how many GET streams (of any session) are open to this server now
                (over stdio: always 0)

Over HTTP it answers DELETE with 405, as the spec lets a server that does not let
clients end sessions do: its GET stream then ends only when the client (the gateway)
ends it, so a test sees whether the gateway does. `GET /stats` answers
{"get_streams": open now, "gets": GETs received} outside MCP.
"""

import json
import logging
import sys
import warnings

import anyio

import mcp_types as types
from mcp import MCPDeprecationWarning
from mcp.server.lowlevel import Server

TRANSPORT, NAME = sys.argv[1], sys.argv[2]
# Sampling and roots are deprecated as of 2026-07-28, yet servers still ask for them.
warnings.simplefilter("ignore", MCPDeprecationWarning)

counts = {"get_streams": 0, "gets": 0, "stray": 0}
roots = {"answer": None, "event": None}


class StrayAnswers(logging.Handler):
    """Counts the answers the SDK drops because no request of ours waits for them: an
    answer meant for another member that reached this one."""

    def emit(self, record):
        if record.getMessage().startswith("dropping response for unknown/late request id"):
            counts["stray"] += 1


dispatcher_log = logging.getLogger("mcp.shared.jsonrpc_dispatcher")
dispatcher_log.setLevel(logging.DEBUG)
dispatcher_log.addHandler(StrayAnswers(logging.DEBUG))
dispatcher_log.propagate = False


def answered() -> anyio.Event:
    # Made on first use: an anyio Event belongs to the running loop.
    if roots["event"] is None:
        roots["event"] = anyio.Event()
    return roots["event"]


async def roots_changed(ctx, params):
    await ctx.session.send_resource_updated(f"mem://{NAME}/doc")
    try:
        result = await ctx.session.list_roots()
        roots["answer"] = [root.name for root in result.roots]
    except Exception as e:  # the client's error is the answer to report
        roots["answer"] = f"error: {e}"
    answered().set()


async def list_tools(ctx, params):
    empty = {"type": "object", "properties": {}}
    return types.ListToolsResult(tools=[
        types.Tool(name="roots_answer", input_schema=empty),
        types.Tool(name="get_streams", input_schema=empty),
    ])


async def call_tool(ctx, params):
    if params.name == "get_streams":
        answer = str(counts["get_streams"])
    elif params.name == "roots_answer":
        await answered().wait()
        answer = json.dumps({"answer": roots["answer"], "stray": counts["stray"]})
    else:
        raise ValueError(f"{NAME} has no tool {params.name}")
    return types.CallToolResult(content=[types.TextContent(type="text", text=answer)])


server = Server(f"outside-{NAME}", on_list_tools=list_tools, on_call_tool=call_tool)
server.add_notification_handler("notifications/roots/list_changed", types.NotificationParams, roots_changed)


async def respond(send, status, body: bytes, headers=()):
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), *headers],
    })
    await send({"type": "http.response.body", "body": body})


class Counting:
    """The MCP app, with its GET streams counted, DELETE refused and /stats."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] == "/stats":
            return await respond(send, 200, json.dumps(counts).encode())
        if scope["method"] == "DELETE":
            body = b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"this server does not let clients end sessions"}}'
            return await respond(send, 405, body, [(b"allow", b"GET, POST")])
        if scope["method"] != "GET":
            return await self.app(scope, receive, send)
        counts["gets"] += 1
        counts["get_streams"] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            counts["get_streams"] -= 1


async def main_stdio():
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


def main_http(port: int):
    import uvicorn

    app = Counting(server.streamable_http_app())
    print("outside_server listening", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    if TRANSPORT == "stdio":
        anyio.run(main_stdio)
    else:
        main_http(int(sys.argv[3]))
