"""The MCP front as a process: ``toastmachine mcp`` (the Procfile's ``mcp`` line) and beside the web
front in ``toastmachine up``, each announcing its URL and stopping cleanly on SIGTERM."""

from __future__ import annotations

from pathlib import Path

import httpx2
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tests import procs
from tests.oauth_flow import sdk_oauth_client

#: SPEC §6: the 18 tools.
TOOL_NAMES = {
    "list_conversations", "get_conversation", "pull_conversation", "get_messages", "get_message", "search",
    "list_tags", "list_agents", "get_agent", "get_relationships", "get_changes", "get_corpus", "whoami",
    "get_operation_token", "create_conversation", "append_message", "assert_relationship", "retract_relationship",
}


async def _metadata_ok(mcp_url: str) -> None:
    base = mcp_url.removesuffix("/mcp")
    status, body = await procs.get_json(base + "/.well-known/oauth-authorization-server")
    assert status == 200 and body["issuer"] == base, body
    status, body = await procs.get_json(base + "/.well-known/oauth-protected-resource/mcp")
    assert status == 200 and body["resource"] == mcp_url, body


async def _up_urls(node: procs.NodeProcess) -> tuple[str, str]:
    """The web front's and the MCP front's URLs, as ``toastmachine up`` prints them."""
    web = await node.wait_listening(timeout=120)
    line = next(line for line in node.output if "listening on" in line)
    return web, line.split(" and MCP at ", 1)[1].split()[0]


async def test_mcp_command_serves_oauth_metadata_and_stops_cleanly(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    port = procs.free_port()
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_AMQP_URL=rabbitmq_url,
                          TOASTMACHINE_DATABASE_URL=database_url, TOASTMACHINE_MCP_PORT=str(port))
    node = await procs.start("mcp", env=env)
    try:
        match = await node.wait_for_line(r"ToastMachine MCP at (http://\S+)", timeout=60)
        assert match.group(1) == f"http://127.0.0.1:{port}/mcp"
        await _metadata_ok(match.group(1))
    finally:
        code = await node.stop()
    assert code == 0, "\n".join(node.output)
    assert not procs.unexpected_tracebacks(node.output), "\n".join(node.output)


async def test_up_prints_the_mcp_url_beside_the_web_url(tmp_path: Path) -> None:
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_PORT="0")
    node = await procs.start("up", env=env)
    try:
        web, mcp_url = await _up_urls(node)
        await _metadata_ok(mcp_url)
        status, body = await procs.get_json(web + "/")
        # The front door links the MCP front at its real port (TOASTMACHINE_MCP_PORT=0 picked one).
        assert status == 200 and body["mcp"]["url"] == mcp_url, body
    finally:
        code = await node.stop()
    assert code == 0, "\n".join(node.output)


async def test_an_ai_app_connects_to_up_with_only_the_mcp_url_and_contributes(tmp_path: Path) -> None:
    """The issue's "done when", on the embedded node: the SDK's own client, given only the printed MCP
    URL, completes OAuth (registration, consent creating an agent, code exchange), sees every tool,
    reads the guide resource (which onboards the agent), writes a conversation through the write
    tools, and the web front serves that same conversation, written by the consented agent."""
    env = procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path), TOASTMACHINE_PORT="0")
    node = await procs.start("up", env=env)
    try:
        web, mcp_url = await _up_urls(node)
        auth, _ = sdk_oauth_client(mcp_url, agent_name="mcp-author", client_name="end-to-end client",
                                   scope="toastmachine:read toastmachine:write")
        async with httpx2.AsyncClient(auth=auth, timeout=30) as http, \
                streamable_http_client(mcp_url, http_client=http) as (read, write), \
                ClientSession(read, write) as session:
            await session.initialize()
            names = {t.name for t in (await session.list_tools()).tools}
            assert names == TOOL_NAMES
            resources = {str(r.uri) for r in (await session.list_resources()).resources}
            assert {"toastmachine://guide", "toastmachine://corpus"} <= resources
            await session.read_resource("toastmachine://guide")  # onboards the agent
            token = await session.call_tool("get_operation_token", {})
            assert not token.is_error, token
            created = await session.call_tool("create_conversation", {
                "subject": "Written over MCP", "content": "hello from an AI app #mcp",
                "operation_token": token.structured_content["operation_token"]})  # type: ignore[index]
            assert not created.is_error, created
            conversation = created.structured_content["conversation"]  # type: ignore[index]
            read_back = await session.call_tool("get_conversation", {"conversation_id": conversation["id"]})
            assert not read_back.is_error, read_back
        status, body = await procs.get_json(f"{web}/conversations/{conversation['id']}")
        assert status == 200, body
        assert body["conversation"]["subject"] == "Written over MCP"
        assert body["conversation"]["author"]["name"] == "mcp-author"
        assert read_back.structured_content["conversation"] == body["conversation"]  # type: ignore[index]
    finally:
        code = await node.stop()
    assert code == 0, "\n".join(node.output)
