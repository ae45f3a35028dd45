"""Drives mcpgw with the official MCP Python SDK client and prints one JSON line.

usage: sdk_client.py URL MODE SCENARIO
  MODE: legacy | 2026-07-28
  MCPGW_BEARER_TOKEN (environment, optional): sent as Authorization: Bearer on every
    request, as an OAuth client with an access token would
  SCENARIO:
    basic    list tools, call echo
    counter  counter_increment twice in one session, then once in a second session
    stream   slow_stream with a progress callback; times of each progress and the result
    notes    add_note twice then list_notes (the SDK-built upstream's stateful tool)
    fleet    counter_increment 20 times, tools/list, then slow_stream
    echoes   echo 20 times (distinct texts), tools/list, then slow_stream: no state, so
             it runs in either mode, through any number of workers
"""

import asyncio
import json
import os
import sys
import time

import mcp
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


def connect(url, mode):
    """An SDK client for URL, with the bearer token from the environment if one is set."""
    token = os.environ.get("MCPGW_BEARER_TOKEN")
    if not token:
        return mcp.Client(url, mode=mode)
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    return mcp.Client(streamable_http_client(url, http_client=http), mode=mode)


def text_of(result):
    return "".join(c.text for c in result.content if getattr(c, "type", "") == "text")


async def basic(url, mode):
    async with connect(url, mode) as client:
        tools = await client.list_tools()
        echoed = await client.call_tool("echo", {"text": "hello through mcpgw"})
        return {"tools": sorted(t.name for t in tools.tools), "echo": text_of(echoed),
                "is_error": bool(echoed.is_error)}


async def counter(url, mode):
    values = []
    async with connect(url, mode) as first:
        for _ in range(2):
            values.append(text_of(await first.call_tool("counter_increment", {})))
        async with connect(url, mode) as second:
            other = text_of(await second.call_tool("counter_increment", {}))
        values.append(text_of(await first.call_tool("counter_increment", {})))
    return {"first_session": values, "second_session": other}


async def stream(url, mode):
    start = time.monotonic()
    progress_at = []

    async def on_progress(progress, total, message):
        progress_at.append(round((time.monotonic() - start) * 1000, 1))

    async with connect(url, mode) as client:
        start = time.monotonic()
        result = await client.call_tool(
            "slow_stream", {"count": 10, "interval_ms": 100}, progress_callback=on_progress)
        result_at = round((time.monotonic() - start) * 1000, 1)
    return {"progress_ms": progress_at, "result_ms": result_at, "text": text_of(result)}


async def notes(url, mode):
    async with connect(url, mode) as client:
        await client.call_tool("add_note", {"note": "one"})
        await client.call_tool("add_note", {"note": "two"})
        mine = text_of(await client.call_tool("list_notes", {}))
        async with connect(url, mode) as other:
            theirs = text_of(await other.call_tool("list_notes", {}))
    return {"mine": mine, "theirs": theirs}


async def fleet(url, mode):
    """Many calls in one session, then a stream: behind a scattering balancer every
    request may land on another worker."""
    start = time.monotonic()
    progress_at = []

    async def on_progress(progress, total, message):
        progress_at.append(round((time.monotonic() - start) * 1000, 1))

    async with connect(url, mode) as client:
        values = [text_of(await client.call_tool("counter_increment", {})) for _ in range(20)]
        tools = await client.list_tools()
        start = time.monotonic()
        result = await client.call_tool(
            "slow_stream", {"count": 10, "interval_ms": 100}, progress_callback=on_progress)
        result_at = round((time.monotonic() - start) * 1000, 1)
    return {"values": values, "tools": len(tools.tools), "progress_ms": progress_at,
            "result_ms": result_at, "text": text_of(result)}


async def echoes(url, mode):
    """Calls that need no session state, then a stream: in 2026-07-28 mode every
    request stands alone, so any worker may answer each one."""
    start = time.monotonic()
    progress_at = []

    async def on_progress(progress, total, message):
        progress_at.append(round((time.monotonic() - start) * 1000, 1))

    async with mcp.Client(url, mode=mode) as client:
        echoed = [text_of(await client.call_tool("echo", {"text": f"echo {i}"}))
                  for i in range(20)]
        tools = await client.list_tools()
        start = time.monotonic()
        result = await client.call_tool(
            "slow_stream", {"count": 10, "interval_ms": 100}, progress_callback=on_progress)
        result_at = round((time.monotonic() - start) * 1000, 1)
    return {"echoed": echoed, "tools": len(tools.tools), "progress_ms": progress_at,
            "result_ms": result_at, "text": text_of(result)}


SCENARIOS = {"basic": basic, "counter": counter, "stream": stream, "notes": notes, "fleet": fleet,
             "echoes": echoes}

if __name__ == "__main__":
    url, mode, scenario = sys.argv[1:4]
    print(json.dumps(asyncio.run(SCENARIOS[scenario](url, mode))), flush=True)
