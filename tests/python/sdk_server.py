"""An upstream MCP server built with the official Python SDK, with a stateful tool.

usage: sdk_server.py PORT
Each session keeps its own notes, so the gateway must give every client session its
own upstream session for `list_notes` to return only that session's notes.
"""

import sys

from mcp.server.mcpserver import Context, MCPServer

app = MCPServer("sdk-notes")
# Keyed by the upstream session id the SDK assigned: one entry per upstream session.
notes_by_session: dict[str, list] = {}


def notes_of(ctx: Context) -> list:
    session_id = (ctx.headers or {}).get("mcp-session-id", "")
    return notes_by_session.setdefault(session_id, [])


@app.tool()
async def add_note(note: str, ctx: Context) -> str:
    notes = notes_of(ctx)
    notes.append(note)
    return str(len(notes))


@app.tool()
async def list_notes(ctx: Context) -> str:
    return ",".join(notes_of(ctx))


@app.tool()
async def echo(text: str) -> str:
    return text


if __name__ == "__main__":
    print("sdk_server listening", flush=True)
    app.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
