"""A tiny headless-Chromium driver for tests: the Chrome DevTools Protocol over aiohttp's websocket.

No extra packages: Chromium is started with ``--remote-debugging-port=0``, prints the browser's
DevTools websocket URL on stderr, and we speak CDP to it (``Target.createTarget`` + a flattened
session per page, ``Page.navigate``, ``Runtime.evaluate`` with ``returnByValue``). Waiting is always
for a JavaScript condition, polled with a deadline, never a sleep.

Chromium comes from Debian's ``chromium`` package (``.ci/run`` installs it); set
``TOASTMACHINE_TEST_CHROMIUM`` to use another binary. Locally a missing browser skips the browser
tests (the run's summary says so); with ``TOASTMACHINE_REQUIRE_SERVICES=1`` it fails them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest

from tests import services

_LISTENING_RE = re.compile(r"DevTools listening on (ws://\S+)")
#: Seconds Chromium may take to print its DevTools URL (a cold start in a container is slow).
START_TIMEOUT = 60.0
#: Seconds one CDP command may take to answer.
COMMAND_TIMEOUT = 30.0

FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--no-default-browser-check", "--no-proxy-server",
    "--remote-debugging-port=0",
)


def chromium_path() -> str | None:
    """The Chromium binary to drive, or None when there is none."""
    configured = os.environ.get("TOASTMACHINE_TEST_CHROMIUM")
    if configured:
        return shutil.which(configured)
    return shutil.which("chromium") or shutil.which("chromium-browser")


def require_chromium() -> str:
    """The Chromium binary, or skip the test (locally, recorded for the summary) / fail it (CI)."""
    path = chromium_path()
    if path is not None:
        return path
    configured = os.environ.get("TOASTMACHINE_TEST_CHROMIUM")
    why = (f"TOASTMACHINE_TEST_CHROMIUM={configured!r} is not an executable" if configured else
           "no chromium binary on PATH (apt-get install chromium, or set TOASTMACHINE_TEST_CHROMIUM)")
    if services.REQUIRED:
        pytest.fail(f"chromium is required (TOASTMACHINE_REQUIRE_SERVICES=1) but missing: {why}")
    services.SKIPPED["chromium"] = why + "; the browser tests did not run"
    pytest.skip(f"chromium missing: {why}")


#: Chromium's answers to an evaluation whose document was being replaced by a navigation.
_NAVIGATING = ("Inspected target navigated or closed", "Cannot find context with specified id",
               "Execution context was destroyed")


class CDPError(AssertionError):
    """A DevTools command failed, or the page's JavaScript threw."""


@dataclass
class Page:
    """One browser tab, reached through its flattened CDP session."""

    browser: Browser
    session_id: str
    #: Console messages, uncaught exceptions and browser log entries (CSP violations land here).
    log: list[str] = field(default_factory=list)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        return await self.browser.send(method, params, session_id=self.session_id)

    async def navigate(self, url: str, timeout: float = 30.0) -> None:
        """Load ``url`` and wait until its document has finished loading."""
        result = await self.send("Page.navigate", url=url)
        if result.get("errorText"):
            raise CDPError(f"navigation to {url} failed: {result['errorText']}")
        # Page.navigate returns once the new document is committed: its readyState is the one polled.
        await self.wait_for("document.readyState === 'complete'", timeout=timeout)

    async def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (JSON-serialisable; promises are awaited)."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise CDPError(f"JavaScript error in {expression!r}: {text}")
        return result["result"].get("value")

    async def wait_for(self, condition: str, timeout: float = 30.0, interval: float = 0.05) -> Any:
        """Poll ``condition`` until it is truthy; return its value, or fail with the last one seen."""
        last: Any = None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        last = await self.evaluate(condition)
                    except CDPError as e:
                        # A condition polled across a navigation (a click on a link) can be asked of
                        # the document being replaced; Chromium then refuses that one evaluation.
                        # The next poll asks the new document.
                        if not any(text in str(e) for text in _NAVIGATING):
                            raise
                        last = None
                    if last:
                        return last
                    await asyncio.sleep(interval)  # a polling interval, not a synchronisation
        except TimeoutError:
            raise AssertionError(f"page condition {condition!r} not met within {timeout}s (last value {last!r});"
                                 f" page log: {self.log[-20:]}") from None

    def _on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled":
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.log.append(f"console.{params.get('type')}: {args}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.log.append(f"exception: {details.get('exception', {}).get('description') or details.get('text')}")
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            self.log.append(f"log.{entry.get('level')}/{entry.get('source')}: {entry.get('text')}")


class Browser:
    """A running headless Chromium and the websocket to its DevTools endpoint."""

    def __init__(self, proc: asyncio.subprocess.Process, profile: str) -> None:
        self.proc = proc
        self.profile = profile
        self.stderr: list[str] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._pages: dict[str, Page] = {}
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def _connect(self, url: str) -> None:
        self._session = aiohttp.ClientSession()
        self._ws = await self._session.ws_connect(url, max_msg_size=0, autoping=True)
        self._tasks.append(asyncio.create_task(self._receive(), name="cdp-receive"))

    async def _receive(self) -> None:
        assert self._ws is not None
        try:
            async for msg in self._ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = orjson.loads(msg.data)
                if "id" in data:
                    future = self._pending.pop(data["id"], None)
                    if future is not None and not future.done():
                        future.set_result(data)
                elif (page := self._pages.get(data.get("sessionId", ""))) is not None:
                    page._on_event(data.get("method", ""), data.get("params", {}))
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(CDPError("the DevTools connection closed"))
            self._pending.clear()

    async def send(self, method: str, params: dict[str, Any] | None = None, *,
                   session_id: str | None = None) -> dict[str, Any]:
        """Send one CDP command and return its result (raise :class:`CDPError` on an error answer)."""
        if self._ws is None or self._ws.closed:
            raise CDPError("the DevTools connection is closed")
        command_id = next(self._ids)
        message: dict[str, Any] = {"id": command_id, "method": method, "params": params or {}}
        if session_id is not None:
            message["sessionId"] = session_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[command_id] = future
        await self._ws.send_json(message)
        try:
            async with asyncio.timeout(COMMAND_TIMEOUT):
                answer = await future
        finally:
            self._pending.pop(command_id, None)
        if "error" in answer:
            raise CDPError(f"{method} failed: {answer['error']}")
        return answer.get("result", {})  # type: ignore[no-any-return]

    async def new_page(self) -> Page:
        """A fresh blank tab with console, exception and log events recorded."""
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})
        page = Page(self, attached["sessionId"])
        self._pages[page.session_id] = page
        for domain in ("Page", "Runtime", "Log"):
            await page.send(f"{domain}.enable")
        return page

    async def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            self.stderr.append(raw.decode(errors="replace").rstrip())
            del self.stderr[:-200]  # keep the tail only: Chromium can be chatty

    async def close(self) -> None:
        """Close the connection, stop Chromium (SIGTERM, SIGKILL after 10 s, then its process group), remove the profile."""
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self.proc.returncode is None:
            # The browser process stops (and reaps) its renderers and helpers itself on SIGTERM.
            self.proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: anything it left behind
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        shutil.rmtree(self.profile, ignore_errors=True)


@contextlib.asynccontextmanager
async def chromium(binary: str | None = None) -> AsyncIterator[Browser]:
    """A headless Chromium with a throw-away profile, stopped and removed on exit."""
    binary = binary or require_chromium()
    profile = tempfile.mkdtemp(prefix="tm-chromium-")
    proc = await asyncio.create_subprocess_exec(
        binary, *FLAGS, f"--user-data-dir={profile}", "about:blank",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        start_new_session=True)
    browser = Browser(proc, profile)
    try:
        assert proc.stderr is not None
        url = None
        try:
            async with asyncio.timeout(START_TIMEOUT):
                async for raw in proc.stderr:
                    line = raw.decode(errors="replace").rstrip()
                    browser.stderr.append(line)
                    if m := _LISTENING_RE.search(line):
                        url = m.group(1)
                        break
        except TimeoutError:
            pass
        if url is None:
            raise AssertionError(f"{binary} printed no DevTools URL within {START_TIMEOUT}s; stderr:\n"
                                 + "\n".join(browser.stderr[-40:]))
        browser._tasks.append(asyncio.create_task(browser._drain_stderr(), name="chromium-stderr"))
        await browser._connect(url)
        yield browser
    finally:
        await browser.close()
