"""The MCP front as a process: ``toastmachine mcp`` (the Procfile's ``mcp`` line) and beside the web
front in ``toastmachine up``, each announcing its URL and stopping cleanly on SIGTERM."""

from __future__ import annotations

from pathlib import Path

from tests import procs


async def _metadata_ok(mcp_url: str) -> None:
    base = mcp_url.removesuffix("/mcp")
    status, body = await procs.get_json(base + "/.well-known/oauth-authorization-server")
    assert status == 200 and body["issuer"] == base, body
    status, body = await procs.get_json(base + "/.well-known/oauth-protected-resource/mcp")
    assert status == 200 and body["resource"] == mcp_url, body


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
        web = await node.wait_listening(timeout=120)
        line = next(line for line in node.output if "listening on" in line)
        mcp_url = line.split(" and MCP at ", 1)[1].split()[0]
        await _metadata_ok(mcp_url)
        status, body = await procs.get_json(web + "/")
        # The front door links the MCP front at its real port (TOASTMACHINE_MCP_PORT=0 picked one).
        assert status == 200 and body["mcp"]["url"] == mcp_url, body
    finally:
        code = await node.stop()
    assert code == 0, "\n".join(node.output)
