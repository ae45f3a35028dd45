"""Drives a virtual server of mcpgw with the official MCP Python SDK client in
2026-07-28 mode (no session, no initialize) and prints one JSON line.

usage: federation_modern_client.py URL TOKEN_A TOKEN_B
  TOKEN_A, TOKEN_B: API keys of two principals, sent as Authorization: Bearer.
  Prints the merged tool list, a call of each member's tool (demo__echo,
  time__get_current_time, st__pid), the stateful member's counter for principal A
  three times, for B once, then for A again, and a call of an excluded tool.
"""

import asyncio
import json
import sys

import mcp
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

# The legacy-mode driver's helpers (this directory is on the import path).
from federation_client import error_of, text_of

MODE = "2026-07-28"


def connect(url, token):
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    return mcp.Client(streamable_http_client(url, http_client=http), mode=MODE)


async def count(client):
    return text_of(await client.call_tool("st__counter_increment", {}))


async def main(url, token_a, token_b):
    async with connect(url, token_a) as first:
        tools = await first.list_tools()
        echo = text_of(await first.call_tool("demo__echo", {"text": "modern through all"}))
        now = text_of(await first.call_tool("time__get_current_time", {"timezone": "UTC"}))
        first_counts = [await count(first) for _ in range(3)]
        first_pid = text_of(await first.call_tool("st__pid", {}))
        async with connect(url, token_b) as second:
            second_counts = [await count(second)]
            second_pid = text_of(await second.call_tool("st__pid", {}))
        first_counts.append(await count(first))
        excluded = await error_of(first, "demo__sleep_ms", {"ms": 1})
        return {
            "version": first.protocol_version,
            "tools": sorted(t.name for t in tools.tools),
            "echo": echo,
            "time": json.loads(now) if now.startswith("{") else now,
            "first_counts": first_counts,
            "second_counts": second_counts,
            "pids": [first_pid, second_pid],
            "excluded": excluded,
        }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:4]))))
