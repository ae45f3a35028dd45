"""A stdio MCP server built with the official Python SDK's low-level Server that has
resources, resource templates, subscriptions, a prompt and completion, for the
federation tests. Every answer names the server (NAME), so a test knows which member
answered.

usage: resource_server.py NAME [LIST_DELAY_S]

  LIST_DELAY_S: tools/list answers only after this many seconds (a slow member).

  resources  mem://NAME/readme, mem://NAME/hidden, shared://common (every instance
             lists this one: a conflict between members)
  templates  mem://NAME/notes/{note}, shared://any/{thing} (in every instance too)
  prompt     greet (argument who); completion for its `who` and for templates
  tools      subscriptions (the URIs subscribed, as JSON), pid
  resources/subscribe, resources/unsubscribe keep the set `subscriptions` shows.
  A client's notifications/roots/list_changed makes it send
  notifications/resources/updated for every subscribed URI: a notification that is
  no answer to any request, so the gateway must deliver it on the session's GET
  stream (a trigger without a timer, so the test waits for nothing but the event).
"""

import json
import os
import sys

import anyio

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

NAME = sys.argv[1]
LIST_DELAY_S = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
subscribed: set[str] = set()


def text(uri: str, body: str) -> types.ReadResourceResult:
    return types.ReadResourceResult(contents=[types.TextResourceContents(uri=uri, text=body)])


async def list_resources(ctx, params):
    return types.ListResourcesResult(resources=[
        types.Resource(uri=f"mem://{NAME}/readme", name="readme"),
        types.Resource(uri=f"mem://{NAME}/hidden", name="hidden"),
        types.Resource(uri="shared://common", name="common"),
    ])


async def list_templates(ctx, params):
    return types.ListResourceTemplatesResult(resource_templates=[
        types.ResourceTemplate(uri_template=f"mem://{NAME}/notes/{{note}}", name="note"),
        types.ResourceTemplate(uri_template="shared://any/{thing}", name="any"),
    ])


async def read_resource(ctx, params):
    uri = params.uri
    if uri == f"mem://{NAME}/readme":
        return text(uri, f"readme of {NAME}")
    if uri == f"mem://{NAME}/hidden":
        return text(uri, f"hidden of {NAME}")
    if uri == "shared://common":
        return text(uri, f"common of {NAME}")
    for prefix, what in ((f"mem://{NAME}/notes/", "note"), ("shared://any/", "any")):
        if uri.startswith(prefix):
            return text(uri, f"{what} {uri[len(prefix):]} of {NAME}")
    raise ValueError(f"{NAME} has no resource {uri}")


async def subscribe(ctx, params):
    subscribed.add(params.uri)
    return types.EmptyResult()


async def unsubscribe(ctx, params):
    subscribed.discard(params.uri)
    return types.EmptyResult()


async def list_prompts(ctx, params):
    return types.ListPromptsResult(prompts=[
        types.Prompt(name="greet", arguments=[types.PromptArgument(name="who", required=True)]),
    ])


async def get_prompt(ctx, params):
    who = (params.arguments or {}).get("who", "nobody")
    return types.GetPromptResult(messages=[
        types.PromptMessage(role="user", content=types.TextContent(type="text", text=f"hello {who} from {NAME}")),
    ])


async def complete(ctx, params):
    ref, value = params.ref, params.argument.value
    if isinstance(ref, types.PromptReference):
        if ref.name != "greet":
            raise ValueError(f"{NAME} has no prompt {ref.name}")
        values = [f"{NAME}-{value}-prompt"]
    else:
        values = [f"{NAME}-{value}-for-{ref.uri}"]
    return types.CompleteResult(completion=types.Completion(values=values))


async def list_tools(ctx, params):
    if LIST_DELAY_S:
        await anyio.sleep(LIST_DELAY_S)
    empty = {"type": "object", "properties": {}}
    return types.ListToolsResult(tools=[
        types.Tool(name="subscriptions", input_schema=empty),
        types.Tool(name="pid", input_schema=empty),
    ])


async def call_tool(ctx, params):
    if params.name == "pid":
        answer = str(os.getpid())
    else:
        answer = json.dumps(sorted(subscribed))
    return types.CallToolResult(content=[types.TextContent(type="text", text=answer)])


async def roots_changed(ctx, params):
    for uri in sorted(subscribed):
        await ctx.session.send_resource_updated(uri)


server = Server(
    f"resources-{NAME}",
    on_list_resources=list_resources,
    on_list_resource_templates=list_templates,
    on_read_resource=read_resource,
    on_subscribe_resource=subscribe,
    on_unsubscribe_resource=unsubscribe,
    on_list_prompts=list_prompts,
    on_get_prompt=get_prompt,
    on_completion=complete,
    on_list_tools=list_tools,
    on_call_tool=call_tool,
)
server.add_notification_handler("notifications/roots/list_changed", types.NotificationParams, roots_changed)


async def main():
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


if __name__ == "__main__":
    print(f"resource_server {NAME} pid {os.getpid()} on stdio", file=sys.stderr, flush=True)
    anyio.run(main)
