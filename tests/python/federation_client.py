"""Drives a virtual server of mcpgw with the official MCP Python SDK client (legacy
mode: virtual servers serve 2025 clients) and prints one JSON line.

usage: federation_client.py URL SCENARIO
  SCENARIO:
    merged   the server's name, its merged tool list; a call of each member's tool
             (demo__echo, time__get_current_time, st__pid); counters of the demo and
             stdio members in two sessions; a call of an excluded tool
    open     initialize only: the server's name, its instructions and tool list
"""

import asyncio
import json
import sys

import mcp


def text_of(result):
    return "".join(c.text for c in result.content if getattr(c, "type", "") == "text")


async def error_of(client, name, arguments):
    try:
        result = await client.call_tool(name, arguments)
    except Exception as e:  # the SDK raises the JSON-RPC error
        return str(e)
    return f"no error: {text_of(result)}"


async def merged(url):
    async with mcp.Client(url, mode="legacy") as first:
        tools = await first.list_tools()
        echo = text_of(await first.call_tool("demo__echo", {"text": "through all"}))
        now = text_of(await first.call_tool("time__get_current_time", {"timezone": "UTC"}))
        first_counts = []
        for _ in range(2):
            first_counts.append([
                text_of(await first.call_tool("st__counter_increment", {})),
                text_of(await first.call_tool("demo__counter_increment", {})),
            ])
        async with mcp.Client(url, mode="legacy") as second:
            second_counts = [
                text_of(await second.call_tool("st__counter_increment", {})),
                text_of(await second.call_tool("demo__counter_increment", {})),
            ]
            second_pid = text_of(await second.call_tool("st__pid", {}))
        first_counts.append([
            text_of(await first.call_tool("st__counter_increment", {})),
            text_of(await first.call_tool("demo__counter_increment", {})),
        ])
        first_pid = text_of(await first.call_tool("st__pid", {}))
        excluded = await error_of(first, "demo__sleep_ms", {"ms": 1})
        return {
            "server": first.server_info.name if first.server_info else None,
            "tools": sorted(t.name for t in tools.tools),
            "echo": echo,
            "time": json.loads(now) if now.startswith("{") else now,
            "first_counts": first_counts,
            "second_counts": second_counts,
            "pids": [first_pid, second_pid],
            "excluded": excluded,
        }


async def opened(url):
    async with mcp.Client(url, mode="legacy") as client:
        tools = await client.list_tools()
        return {
            "server": client.server_info.name if client.server_info else None,
            "instructions": client.instructions,
            "tools": sorted(t.name for t in tools.tools),
        }


SCENARIOS = {"merged": merged, "open": opened}

if __name__ == "__main__":
    url, scenario = sys.argv[1], sys.argv[2]
    print(json.dumps(asyncio.run(SCENARIOS[scenario](url))))
