"""Drives a virtual server of mcpgw with the official MCP Python SDK client (legacy
mode: virtual servers serve 2025 clients) and prints one JSON line.

usage: federation_client.py URL SCENARIO
  SCENARIO:
    merged   the server's name, its merged tool list; a call of each member's tool
             (demo__echo, time__get_current_time, st__pid); counters of the demo and
             stdio members in two sessions; a call of an excluded tool
    open     initialize only: the server's name, its instructions and tool list
    resources  the announced capabilities, the merged resource and template lists,
             reads of listed and template-matched URIs, completions of a prompt
             argument and a template variable, subscribe (and the updated
             notification, on the GET stream: the member sends it when the client
             says its roots changed), unsubscribe, each member's subscriptions
    asking   two members (a__, b__) asking the client for sampling in one call each,
             at once: the ids the client saw, the answer it gave to each, and what
             each member says it was answered
    outside  two outside_server.py members, h (HTTP) and s (stdio): once h's own GET
             stream is open, the client says its roots changed, and each member
             sends a resource update and asks roots/list outside any request: the
             updates and requests the client saw, each member's report of the
             answer it got, and h's open GET streams before the client leaves
"""

import asyncio
import json
import sys
import warnings

import mcp
import mcp_types as types


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


def read_text(result):
    return "".join(getattr(c, "text", "") for c in result.contents)


async def resources(url):
    updates = asyncio.Queue()

    async def on_message(message):
        if isinstance(message, types.ResourceUpdatedNotification):
            await updates.put(message.params.uri)

    async with mcp.Client(url, mode="legacy", message_handler=on_message) as client:
        capabilities = client.server_capabilities
        listed = await client.list_resources()
        templates = await client.list_resource_templates()
        reads = {}
        for uri in ["mem://alpha/readme", "shared://common", "mem://beta/notes/n1", "shared://any/x",
                    "demo://session/state"]:
            reads[uri] = read_text(await client.read_resource(uri, cache_mode="refresh"))
        prompt = await client.complete(types.PromptReference(name="beta__greet"), {"name": "who", "value": "al"})
        template = await client.complete(
            types.ResourceTemplateReference(uri="mem://alpha/notes/{note}"), {"name": "note", "value": "n"})
        await client.subscribe_resource("mem://beta/readme")
        subscribed = {
            member: text_of(await client.call_tool(f"{member}__subscriptions", {}))
            for member in ("alpha", "beta")
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            await client.send_roots_list_changed()
        updated = await asyncio.wait_for(updates.get(), 120)
        await client.unsubscribe_resource("mem://beta/readme")
        after = text_of(await client.call_tool("beta__subscriptions", {}))
        return {
            "capabilities": capabilities.model_dump(by_alias=True, exclude_none=True),
            "resources": [r.uri for r in listed.resources],
            "resources_meta": (listed.meta or {}).get("mcpgw/federation"),
            "templates": [t.uri_template for t in templates.resource_templates],
            "reads": reads,
            "prompt_completion": prompt.completion.values,
            "template_completion": template.completion.values,
            "subscribed": subscribed,
            "updated": updated,
            "after_unsubscribe": after,
        }


async def asking(url):
    seen = []

    async def on_sampling(context, params):
        # Each request gets its own answer, named by the id it came with, so each
        # member's report shows whether the answer it got was the one meant for it.
        answer = f"answer to {context.request_id}"
        seen.append({"id": context.request_id, "answer": answer})
        return types.CreateMessageResult(
            role="assistant",
            content=types.TextContent(type="text", text=answer),
            model="test",
        )

    async with mcp.Client(url, mode="legacy", sampling_callback=on_sampling) as client:
        a, b = await asyncio.gather(
            client.call_tool("a__ask_client", {"kind": "sampling"}),
            client.call_tool("b__ask_client", {"kind": "sampling"}),
        )
        return {"seen": seen, "a": text_of(a), "b": text_of(b)}


async def outside(url):
    updates, asked = asyncio.Queue(), asyncio.Queue()

    async def on_message(message):
        if isinstance(message, types.ResourceUpdatedNotification):
            await updates.put(message.params.uri)

    async def on_roots(context):
        # Named by the id it came with, so each member's report shows whether the
        # answer it got was the one meant for it.
        answer = f"answer to {context.request_id}"
        await asked.put({"id": context.request_id, "answer": answer})
        return types.ListRootsResult(roots=[types.Root(uri="file:///srv", name=answer)])

    async with mcp.Client(url, mode="legacy", message_handler=on_message,
                          list_roots_callback=on_roots) as client:
        # What h sends outside a request is dropped until a GET stream of its session
        # is open: the gateway opens it once the client's GET reaches the owner.
        deadline = asyncio.get_running_loop().time() + 60
        while text_of(await client.call_tool("h__get_streams", {})) == "0":
            assert asyncio.get_running_loop().time() < deadline, "h's GET stream never opened"
            await asyncio.sleep(0.05)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            await client.send_roots_list_changed()
        updated = sorted([await asyncio.wait_for(updates.get(), 120) for _ in range(2)])
        seen = [await asyncio.wait_for(asked.get(), 120) for _ in range(2)]
        reports = {
            member: json.loads(text_of(await client.call_tool(f"{member}__roots_answer", {})))
            for member in ("h", "s")
        }
        open_before = int(text_of(await client.call_tool("h__get_streams", {})))
    return {"updated": updated, "seen": seen, "reports": reports, "h_get_streams": open_before}


SCENARIOS = {"merged": merged, "open": opened, "resources": resources, "asking": asking,
             "outside": outside}

if __name__ == "__main__":
    url, scenario = sys.argv[1], sys.argv[2]
    print(json.dumps(asyncio.run(SCENARIOS[scenario](url))))
