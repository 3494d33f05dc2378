"""The README's shell session runs as written (issue 9, item 8).

Every fenced ``sh`` block right after a ``<!-- readme-session ... -->`` comment is part of one
session: the blocks run in order, in one bash, against a real node started here (``toastmachine up``
on the embedded database, as the README's first command starts it). The only thing the test adds is
strictness a person pasting the session gets by reading the answers: ``set -euo pipefail``, and every
``curl`` failing on an HTTP error status (``--fail-with-body``), so a 4xx or 5xx anywhere fails the test
with the answer in its output.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from tests import procs

pytestmark = pytest.mark.timeout(180)

README = procs.ROOT / "README.md"
SESSION_RE = re.compile(r"^<!-- readme-session\b[^\n]*-->\n```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)

#: What the test puts before the session: strict mode, and curl failing on any HTTP error status.
PRELUDE = """\
set -euo pipefail
curl() { command curl --fail-with-body --show-error --max-time 30 "$@"; }
"""


def session_blocks(text: str) -> list[str]:
    """The README's session blocks, in order."""
    return [m.group(1) for m in SESSION_RE.finditer(text)]


def test_the_readme_marks_its_session() -> None:
    blocks = session_blocks(README.read_text())
    assert len(blocks) >= 2, "the write session and the read examples are marked <!-- readme-session -->"
    session = "\n".join(blocks)
    # Nothing left for the reader to fill in by hand: ids and the credential come from the answers.
    commands = "\n".join(line.split("#", 1)[0] for line in session.splitlines())  # comments may show examples
    for placeholder in ("C1", "M1", "M2", "R1", "tm_...", "<", "…"):
        assert placeholder not in re.sub(r"\$\w+|\b\w+=", "", commands), placeholder  # variables are fine


async def test_the_readme_session_runs_against_a_fresh_node(tmp_path: Path) -> None:
    node = await procs.start("up", env=procs.clean_env(TOASTMACHINE_DATA_DIR=str(tmp_path / "data"),
                                                       TOASTMACHINE_PORT="0"))
    try:
        url = await node.wait_listening(timeout=60)
        script = PRELUDE + "\n".join(session_blocks(README.read_text()))
        shell = await asyncio.create_subprocess_exec(
            "bash", "-c", script, env=procs.clean_env(N=url), cwd=str(tmp_path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        async with asyncio.timeout(120):
            out, _ = await shell.communicate()
        text = out.decode(errors="replace")
        assert shell.returncode == 0, text
        # What the session says happens, happened: ids captured, the replay recognised, the retraction made.
        assert re.search(r"(?im)^idempotent-replayed: true", text), text
        assert '"schema_validated":true' in text and '"retraction":' in text, text
        status, corpus = await procs.get_json(url + "/corpus")
        assert status == 200 and corpus["head_sequence"] >= 4, corpus
    finally:
        assert await node.stop() == 0


SCALE_OUT_RE = re.compile(r"^<!-- readme-scale-out\b[^\n]*-->\n```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)


@pytest.mark.rabbitmq
@pytest.mark.postgres
async def test_the_scale_out_block_runs_from_a_shell_without_the_venv_on_path(
        tmp_path: Path, rabbitmq_url: str, database_url: str) -> None:
    """The block as written, from the repository root, in a shell whose PATH knows nothing of the venv.

    Three changes, none to what the block relies on: the venv already exists (the first line would
    create it again and install from the network), the services are this test's own (a vhost, a
    database and a data directory of its own, not the shared defaults), and honcho gets a free port.
    """
    match = SCALE_OUT_RE.search(README.read_text())
    assert match, "the scale-out block is marked <!-- readme-scale-out -->"
    lines = match.group(1).splitlines()
    assert lines[0].startswith("python3 -m venv .venv && .venv/bin/pip install -e . honcho"), lines[0]
    port = procs.free_port(300)  # honcho gives mcp, the Procfile's fourth line, port + 300
    script = []
    for line in lines[1:]:
        line = re.sub(r"^export TOASTMACHINE_AMQP_URL=\S+", f"export TOASTMACHINE_AMQP_URL={rabbitmq_url}", line)
        line = re.sub(r"^export TOASTMACHINE_DATABASE_URL=\S+",
                      f"export TOASTMACHINE_DATABASE_URL={database_url}", line)
        line = re.sub(r"^export TOASTMACHINE_DATA_DIR=\S+", f"export TOASTMACHINE_DATA_DIR={tmp_path}", line)
        line = re.sub(r"^export TOASTMACHINE_MCP_PUBLIC_URL=http://127.0.0.1:5300\b",
                      f"export TOASTMACHINE_MCP_PUBLIC_URL=http://127.0.0.1:{port + 300}", line)
        line = re.sub(r"^honcho start\b", f"exec honcho start -p {port}", line)
        script.append(line)
    assert any(line.startswith("exec honcho start") for line in script), script
    env = procs.clean_env(PATH="/usr/bin:/bin", TOASTMACHINE_DATA_DIR=str(tmp_path))
    env.pop("VIRTUAL_ENV", None)
    group = await procs.start(program=("bash", "-c", "set -euo pipefail\n" + "\n".join(script)), env=env)
    try:
        url = await group.wait_listening(timeout=90)
        assert url.endswith(f":{port}")
        # Every process whose clean stop is checked below has started: SIGTERM before a process's
        # start-up is done (still importing, as the publisher once was) ends it by the signal.
        for name in ("writer", "publisher"):
            await group.wait_for_line(rf"{name}\.1\s+\|.*ToastMachine running {name}", timeout=60)
        status, body = await procs.get_json(url + "/readyz")
        assert status == 200, body
        # The front door sends AI apps to the MCP front where it really listens.
        await group.wait_for_line(r"mcp\.1\s+\|.*ToastMachine MCP at", timeout=60)
        status, front = await procs.get_json(url + "/")
        assert status == 200 and front["mcp"]["url"] == f"http://127.0.0.1:{port + 300}/mcp", front
        status, metadata = await procs.get_json(f"http://127.0.0.1:{port + 300}/.well-known/oauth-protected-resource/mcp")
        assert status == 200 and metadata["resource"] == front["mcp"]["url"], metadata
    finally:
        await group.stop()
    text = "\n".join(group.output)
    assert "command not found" not in text and "Traceback" not in text, text
    for name in ("web.1", "writer.1", "publisher.1"):
        assert re.search(rf"{re.escape(name)} stopped \(rc=0\)", text), text


PYTHON_RE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def test_the_readme_python_example_is_real_sdk_code() -> None:
    """The MCP section's Python example names what the installed SDK has: its imports import, the
    calls it makes exist with those parameters, and it parses (inside an async function, where it runs)."""
    import ast
    import inspect

    blocks = PYTHON_RE.findall(README.read_text())
    assert blocks, "the MCP section has a Python example"
    for block in blocks:
        tree = ast.parse("async def example():\n" + "".join("    " + line + "\n" for line in block.splitlines()))
        imports: list[ast.stmt] = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
        namespace: dict[str, object] = {}
        exec(compile(ast.Module(body=imports, type_ignores=[]), "README.md", "exec"), namespace)  # noqa: S102
    from mcp import Client
    from mcp.client.auth import OAuthClientProvider

    assert "listen" in dir(Client) and "call_tool" in dir(Client)
    assert {"redirect_handler", "callback_handler"} <= set(inspect.signature(OAuthClientProvider).parameters)
    assert "http_client" in inspect.signature(namespace["streamable_http_client"]).parameters  # type: ignore[arg-type]
