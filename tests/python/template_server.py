"""A stdio MCP server built with the official Python SDK's low-level Server whose
resource templates go beyond RFC 6570 level 1, for the federation tests. Every answer
names the server (NAME), so a test knows which member answered.

usage: template_server.py NAME

  resources  none
  templates  files://NAME{/path*}          (level 4: exploded path segments)
             search://NAME/items{?q,limit}  (level 3: optional query parameters)
  reads      files://NAME/a/b -> "file a/b of NAME";
             search://NAME/items?q=x&limit=2 -> "search q=x limit=2 of NAME"
  completion for a template's variable: ["NAME-VALUE-for-TEMPLATE"]
"""

import os
import sys
from urllib.parse import parse_qs, urlsplit

import anyio

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

NAME = sys.argv[1]
FILES = f"files://{NAME}"
SEARCH = f"search://{NAME}/items"


def text(uri: str, body: str) -> types.ReadResourceResult:
    return types.ReadResourceResult(contents=[types.TextResourceContents(uri=uri, text=body)])


async def list_resources(ctx, params):
    return types.ListResourcesResult(resources=[])


async def list_templates(ctx, params):
    return types.ListResourceTemplatesResult(resource_templates=[
        types.ResourceTemplate(uri_template=FILES + "{/path*}", name="file"),
        types.ResourceTemplate(uri_template=SEARCH + "{?q,limit}", name="search"),
    ])


async def read_resource(ctx, params):
    uri = str(params.uri)
    if uri.startswith(FILES + "/"):
        return text(uri, f"file {uri[len(FILES) + 1:]} of {NAME}")
    if uri.startswith(SEARCH):
        query = parse_qs(urlsplit(uri).query)
        found = " ".join(f"{key}={query[key][0]}" for key in ("q", "limit") if key in query)
        return text(uri, f"search {found} of {NAME}")
    raise ValueError(f"{NAME} has no resource {uri}")


async def complete(ctx, params):
    ref, value = params.ref, params.argument.value
    return types.CompleteResult(completion=types.Completion(values=[f"{NAME}-{value}-for-{ref.uri}"]))


server = Server(
    f"templates-{NAME}",
    on_list_resources=list_resources,
    on_list_resource_templates=list_templates,
    on_read_resource=read_resource,
    on_completion=complete,
)


async def main():
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


if __name__ == "__main__":
    print(f"template_server {NAME} pid {os.getpid()} on stdio", file=sys.stderr, flush=True)
    anyio.run(main)
