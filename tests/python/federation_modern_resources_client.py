"""Reads a virtual server's resources with the official MCP Python SDK client in
2026-07-28 mode (no session) and prints one JSON line.

usage: federation_modern_resources_client.py URL TOKEN URI...
  TOKEN: an API key, sent as Authorization: Bearer.
  Prints the merged resource and template lists (with their caching hints), the text
  of each URI read, a completion of beta__greet's `who`, and one of the template
  files://tpl{/path*}'s `path`. The SDK checks every result against the 2026-07-28
  schema, so a result missing what the revision requires fails here.
"""

import asyncio
import json
import sys

import mcp_types as types

from federation_modern_client import connect


def read_text(result):
    return "".join(getattr(c, "text", "") for c in result.contents)


async def main(url, token, uris):
    async with connect(url, token) as client:
        listed = await client.list_resources(cache_mode="refresh")
        templates = await client.list_resource_templates(cache_mode="refresh")
        reads = {uri: read_text(await client.read_resource(uri, cache_mode="refresh")) for uri in uris}
        prompt = await client.complete(types.PromptReference(name="beta__greet"), {"name": "who", "value": "al"})
        template = await client.complete(
            types.ResourceTemplateReference(uri="files://tpl{/path*}"), {"name": "path", "value": "d"})
        return {
            "version": client.protocol_version,
            "resources": [r.uri for r in listed.resources],
            "templates": [t.uri_template for t in templates.resource_templates],
            "hints": [listed.ttl_ms, listed.cache_scope],
            "reads": reads,
            "prompt_completion": prompt.completion.values,
            "template_completion": template.completion.values,
        }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:]))))
