"""An MCP server built with the official Python SDK whose tool asks the client for
sampling, elicitation or roots mid-call and reports what came back, so a test can see
what the gateway answered in the client's place.

usage: asking_server.py stdio
       asking_server.py http PORT
"""

import sys
import warnings

from mcp import MCPDeprecationWarning, MCPError, types
from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.message import ServerMessageMetadata

app = MCPServer("asking")
# Sampling and roots are deprecated as of 2026-07-28, yet servers still ask for them.
warnings.simplefilter("ignore", MCPDeprecationWarning)


async def ask(kind: str, ctx: Context):
    session = ctx.request_context.session
    related = ctx.request_id
    if kind == "elicitation":
        return await session.elicit_form(
            "What is the answer?",
            {"type": "object", "properties": {"answer": {"type": "string"}}},
            related_request_id=related,
        )
    if kind == "sampling":
        return await session.create_message(
            [types.SamplingMessage(role="user", content=types.TextContent(type="text", text="hi"))],
            max_tokens=5,
            related_request_id=related,
        )
    if kind == "roots":
        # Sent on the call's own stream, as a server asks in the middle of a call
        # (`list_roots()` would use the session's GET stream over HTTP).
        return await session.send_request(
            types.ListRootsRequest(),
            types.ListRootsResult,
            metadata=ServerMessageMetadata(related_request_id=related),
        )
    raise ValueError(f"unknown kind {kind!r}: elicitation, sampling or roots")


@app.tool()
async def ask_client(kind: str, ctx: Context) -> str:
    """Sends the client one request of `kind` and says how it was answered:
    `error CODE: MESSAGE`, or `answered: RESULT`."""
    try:
        result = await ask(kind, ctx)
    except MCPError as e:
        return f"error {e.code}: {e.message}"
    return f"answered: {result}"


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        app.run(transport="stdio")
    else:
        print("asking_server listening", flush=True)
        app.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
