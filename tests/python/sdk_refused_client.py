"""Runs the official MCP Python SDK client against a route that should refuse it, and
prints one JSON line saying what the client saw, so a test can assert the refusal
itself (its HTTP status and error body) rather than "the client failed somehow".

usage: sdk_refused_client.py URL MODE
  MODE: legacy | 2026-07-28
  MCPGW_BEARER_TOKEN (environment, optional): sent as Authorization: Bearer on every
    request

The client lists tools and calls echo. Printed:
  completed   true if that worked (no refusal)
  responses   every HTTP response the client received: method, status, and the
              WWW-Authenticate header if any, in order
  error       the error the SDK raised: its type, and for an MCPError the JSON-RPC
              code, message and data the SDK surfaced from the response body
Exits 0 whenever it could run: the test decides what counts as right.
"""

import asyncio
import json
import os
import sys

import httpx2
import mcp
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT
from mcp.shared.exceptions import MCPError


def leaves(error):
    """The exceptions inside (possibly nested) exception groups, or the error itself."""
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from leaves(inner)
    else:
        yield error


def describe(error):
    found = list(leaves(error))
    # The SDK's own error carries what the server said; anything else is what broke.
    chosen = next((e for e in found if isinstance(e, MCPError)), found[0])
    described = {"type": type(chosen).__name__, "text": str(chosen)}
    if isinstance(chosen, MCPError):
        described.update(code=chosen.code, message=chosen.message, data=chosen.data)
    return described


async def run(url, mode):
    responses = []

    async def record(response):
        responses.append({
            "method": response.request.method,
            "status": response.status_code,
            "www_authenticate": response.headers.get("www-authenticate"),
        })

    headers = {}
    token = os.environ.get("MCPGW_BEARER_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    http = httpx2.AsyncClient(
        headers=headers,
        timeout=httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT),
        event_hooks={"response": [record]},
    )
    try:
        async with mcp.Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            await client.list_tools()
            await client.call_tool("echo", {"text": "should have been refused"})
        return {"completed": True, "responses": responses, "error": None}
    except BaseException as error:  # noqa: BLE001 - reported, the test judges it
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        return {"completed": False, "responses": responses, "error": describe(error)}


if __name__ == "__main__":
    url, mode = sys.argv[1:3]
    print(json.dumps(asyncio.run(run(url, mode))), flush=True)
