"""A stdio MCP server built with the official Python SDK's low-level Server whose
tools/list is paginated, for the federation tests: 7 tools (page_0 .. page_6), three
per page, each page after the first named by the previous page's nextCursor.

usage: paging_server.py
"""

import anyio

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

TOOLS = [f"page_{i}" for i in range(7)]
PAGE = 3


async def list_tools(ctx, params):
    start = int(params.cursor) if params is not None and params.cursor else 0
    names = TOOLS[start:start + PAGE]
    following = start + PAGE
    return types.ListToolsResult(
        tools=[types.Tool(name=name, input_schema={"type": "object", "properties": {}})
               for name in names],
        next_cursor=str(following) if following < len(TOOLS) else None,
    )


async def call_tool(ctx, params):
    return types.CallToolResult(content=[types.TextContent(type="text", text=f"ran {params.name}")])


server = Server("paging", on_list_tools=list_tools, on_call_tool=call_tool)


async def main():
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


if __name__ == "__main__":
    anyio.run(main)
