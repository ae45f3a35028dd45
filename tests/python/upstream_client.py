"""Drives mcpgw with the official MCP Python SDK client for the upstream tests and
prints one JSON line.

usage: upstream_client.py URL MODE SCENARIO [TOKEN]
  MODE: legacy | 2026-07-28
  TOKEN: sent as Authorization: Bearer TOKEN
  SCENARIO:
    time     tools of mcp-server-time: list, get_current_time, convert_time
    counter  counter_increment three times
    elicit   ask: the server elicits an answer mid-call; the callback gives one
"""

import asyncio
import json
import sys

import httpx2
import mcp
from mcp import types
from mcp.client.streamable_http import streamable_http_client


def text_of(result):
    return "".join(c.text for c in result.content if getattr(c, "type", "") == "text")


async def time_tools(client):
    tools = sorted(t.name for t in (await client.list_tools()).tools)
    now = [json.loads(text_of(await client.call_tool("get_current_time", {"timezone": zone})))
           for zone in ("UTC", "Europe/Paris", "Asia/Tokyo", "America/New_York")]
    converted = json.loads(text_of(await client.call_tool(
        "convert_time",
        {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"})))
    return {"tools": tools, "zones": [n["timezone"] for n in now],
            "converted": converted["target"]["datetime"]}


async def counter(client):
    return {"values": [text_of(await client.call_tool("counter_increment", {})) for _ in range(3)]}


async def elicit(client):
    result = await client.call_tool("ask", {"question": "What is the answer?"})
    return {"text": text_of(result), "is_error": bool(result.is_error)}


SCENARIOS = {"time": time_tools, "counter": counter, "elicit": elicit}


async def main(url, mode, scenario, token):
    asked = []

    async def on_elicit(context, params):
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"answer": "forty-two"})

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(headers=headers, timeout=60) as http:
        transport = streamable_http_client(url, http_client=http)
        async with mcp.Client(transport, mode=mode, elicitation_callback=on_elicit) as client:
            out = await SCENARIOS[scenario](client)
    out["asked"] = asked
    return out


if __name__ == "__main__":
    url, mode, scenario = sys.argv[1:4]
    token = sys.argv[4] if len(sys.argv) > 4 else None
    print(json.dumps(asyncio.run(main(url, mode, scenario, token))), flush=True)
