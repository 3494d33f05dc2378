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
    # Nothing left for the reader to fill in by hand.
    for placeholder in ("C1", "M1\"", "R1", "tm_...", "<", "…\"}'"):
        assert placeholder not in session.replace("$M1", ""), placeholder


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
