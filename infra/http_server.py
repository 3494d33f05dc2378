"""The HTTP connection layer under the web front: what happens before a request reaches the app.

aiohttp answers a request its parser rejects (a NUL or bare CR/LF in a header, an oversized line,
too many headers, a bad method) itself, with ``text/plain`` text that quotes the offending bytes, and
logs those bytes at error level with a traceback; a credential in an ``Authorization`` line would
leak both ways. :class:`GuardedRequestHandler` (aiohttp's per-connection protocol, subclassed)
answers them with the JSON error envelope instead, fixed text and the right status (400, 414 or
431), logs one warning without any request bytes and counts it in
``toastmachine_http_rejected_total{reason}``.

It also bounds how long a connection may take to deliver its request headers (``read_timeout``,
from the first byte of a request, or from the connection's start): a client that trickles headers
(slowloris) or opens connections and sends nothing is answered 408 and closed. Request bodies have
their own deadline where they are read (:func:`infra.http.read_json`). Idle keep-alive connections
and long-lived responses (SSE) are not affected: the deadline only runs while headers are awaited.

:class:`GuardedAppRunner` is ``web.AppRunner`` with this protocol; use it (or :func:`guarded_runner`)
wherever the web front is served.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    HttpProcessingError,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from infra.http import SERVER_HEADER, TRACE_ID, TRACE_RESPONSE_HEADER, error_response
from infra.logs import get_logger, new_trace_id
from infra.metrics import Metrics
from protocol.errors import ApiError, InternalError, ReadTimeout

log = get_logger("toastmachine.http.connection")

#: Longest request line (method, target, version) accepted; longer is 414. Deliberately not equal
#: to :data:`MAX_HEADER_FIELD`: aiohttp reports both with the same exception and only its limit
#: tells which one was exceeded.
MAX_REQUEST_LINE = 8192
#: Longest header field (name plus value) accepted; longer is 431 (aiohttp's default size).
MAX_HEADER_FIELD = 8190
#: Most header fields in one request; more is 431 (aiohttp's default).
MAX_HEADERS = 128
#: Default seconds a client has to deliver its request headers (and each body, see read_json).
DEFAULT_READ_TIMEOUT = 30.0

_FIX = "Send a well-formed HTTP/1.1 request (RFC 9112); GET /openapi.json lists every route."
#: Seconds a connection answered 408 stays open, its input read and dropped, after the answer and a
#: FIN were sent (see ``GuardedRequestHandler._linger_close``).
LINGER_AFTER_TIMEOUT = 1.0
_HEADER_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\nServer: " + SERVER_HEADER.encode() + b"\r\n"
    b"Content-Type: application/json\r\nConnection: close\r\n" + TRACE_RESPONSE_HEADER.encode() + b": %s\r\n"
    b"Content-Length: %d\r\n\r\n%s")


def classify(exc: BaseException, *, max_request_line: int = MAX_REQUEST_LINE) -> tuple[str, ApiError]:
    """The metric reason and the public error for a request aiohttp's parser rejected.

    Only the exception's *type* (and for an oversized line, the limit it names) is used: its text
    quotes the request's bytes and never goes anywhere.
    """
    if isinstance(exc, LineTooLong):
        if len(exc.args) > 1 and exc.args[1] == max_request_line:
            return "request_line_too_long", ApiError(
                "The request line is too long.", status=414, code="uri_too_long",
                how_to_proceed=f"Keep the request line under {max_request_line} bytes; send large "
                               "input in a JSON body instead of the query string.")
        return "header_too_large", ApiError(
            "A request header is too large.", status=431, code="header_too_large",
            how_to_proceed=f"Keep every header line under {MAX_HEADER_FIELD} bytes; a ToastMachine "
                           "credential is far shorter.")
    if isinstance(exc, HttpProcessingError) and exc.message.startswith("Too many headers"):
        return "too_many_headers", ApiError(
            "The request has too many header fields.", status=431, code="too_many_headers",
            how_to_proceed=f"Send at most {MAX_HEADERS} header fields.")
    if isinstance(exc, BadHttpMethod):
        return "bad_method", ApiError("The request method is not valid HTTP.", code="malformed_request",
                                      how_to_proceed=_FIX)
    if isinstance(exc, BadStatusLine | InvalidURLError):
        return "bad_request_line", ApiError("The request line is not valid HTTP.", code="malformed_request",
                                            how_to_proceed=_FIX)
    return "malformed", ApiError("The request is not valid HTTP (its headers could not be parsed).",
                                 code="malformed_request", how_to_proceed=_FIX)


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection protocol with enveloped parser errors and a header read timeout.

    Args (beyond aiohttp's): ``metrics`` counts rejections; ``read_timeout`` is the seconds a
    request's headers may take (0 disables the deadline).
    """

    def __init__(self, manager: web.Server, *, metrics: Metrics | None = None,
                 read_timeout: float = DEFAULT_READ_TIMEOUT, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._metrics = metrics
        self._read_timeout = read_timeout
        self._header_deadline: asyncio.TimerHandle | None = None
        #: Set once a 408 went out: further input is dropped until the connection closes.
        self._lingering: asyncio.TimerHandle | None = None

    # -- header read timeout --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()  # a connection that never sends anything is bounded too

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            return  # answered 408 already: what the client still sends is read only to be dropped
        # Bytes arriving while no request is being handled or queued are the start of a request:
        # its headers must be complete within the deadline. (Body bytes and pipelined requests
        # behind a running one arrive while a request is in progress and arm nothing.)
        if data and self._header_deadline is None and not self._request_in_progress and not self._messages:
            self._arm_header_deadline()
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # a whole request head (or a parse error) arrived
            self._cancel_header_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_deadline()
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._read_timeout > 0:
            self._header_deadline = self._loop.call_later(self._read_timeout, self._headers_timed_out)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_timed_out(self) -> None:
        self._header_deadline = None
        transport = self.transport
        if transport is None or self._request_in_progress or self._messages:
            return
        trace_id = self._reject("header_timeout", ReadTimeout())
        body = error_response(ReadTimeout()).body
        assert isinstance(body, bytes)
        transport.write(_HEADER_TIMEOUT_RESPONSE % (trace_id.encode(), len(body), body))
        self._linger_close(transport)

    def _linger_close(self, transport: asyncio.Transport) -> None:
        """Close after the answer the way RFC 9112 §9.6 asks: the answer and a FIN first (half
        close), the client's further bytes read and dropped for LINGER_AFTER_TIMEOUT, then the close.

        Closing at once while the client still sends (a slowloris trickling header bytes) leaves its
        bytes unread, which makes the kernel answer with a reset instead of a FIN; a reset can reach
        the client before it has read the 408, which it then never sees.
        """
        self._lingering = self._loop.call_later(LINGER_AFTER_TIMEOUT, self.force_close)
        if transport.can_write_eof():
            transport.write_eof()  # sent once the answer is flushed

    # -- parser errors ----------------------------------------------------------------------

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """The answer to a request the parser rejected (or that failed outside the app's middleware):
        the JSON envelope with fixed text; ``message`` (aiohttp's, quoting the request) is ignored."""
        # A request that reached the app already has the middleware's trace id (and its
        # on_response_prepare puts that one on the answer); one the parser refused has none.
        trace_id = request.get(TRACE_ID) or new_trace_id()
        if isinstance(exc, HttpProcessingError):
            reason, error = classify(exc, max_request_line=self.max_line_size)
            self._reject(reason, error, trace_id)
        elif status == 504:
            error = ApiError("The request took too long to handle.", status=504, code="handler_timeout",
                             how_to_proceed="Retry later.")
            log.warning("http.handler_timeout", trace_id=trace_id)
        else:
            # The app's middleware answers every handler error itself; reaching here is a bug, so
            # it is logged at error level, with the exception's type only (its text may quote input).
            error = InternalError()
            log.error("http.unhandled_outside_middleware", status=status, trace_id=trace_id,
                      error_type=type(exc).__name__ if exc is not None else None)
        if request.writer.output_size > 0:  # a response is under way: the connection is broken
            raise ConnectionError("Response is sent already, cannot send another response")
        response = error_response(error)
        # For a refused request the app's on_response_prepare does not run: its headers are set here.
        response.headers["Server"] = SERVER_HEADER
        response.headers[TRACE_RESPONSE_HEADER] = trace_id
        response.force_close()
        return response

    def _reject(self, reason: str, error: ApiError, trace_id: str | None = None) -> str:
        """Log and count a refusal; its trace id (``trace_id``, or a fresh one), for the answer."""
        trace_id = trace_id or new_trace_id()
        peer = None
        if self.transport is not None:
            info = self.transport.get_extra_info("peername")
            peer = info[0] if isinstance(info, tuple) else None
        log.warning("http.request_rejected", reason=reason, status=error.status, peer=peer, trace_id=trace_id)
        if self._metrics is not None:
            self._metrics.rejected.labels(reason).inc()
        return trace_id


class _GuardedServer(web.Server):
    """``web.Server`` making :class:`GuardedRequestHandler` connections."""

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are :class:`GuardedRequestHandler`.

    Args:
        app: the application.
        metrics: counts rejected requests.
        read_timeout: seconds a request's headers may take.
        **kwargs: as for ``web.AppRunner`` (``access_log``, ``shutdown_timeout``...).
    """

    def __init__(self, app: web.Application, *, metrics: Metrics | None = None,
                 read_timeout: float = DEFAULT_READ_TIMEOUT, **kwargs: Any) -> None:
        kwargs.setdefault("max_line_size", MAX_REQUEST_LINE)
        kwargs.setdefault("max_field_size", MAX_HEADER_FIELD)
        kwargs.setdefault("max_headers", MAX_HEADERS)
        # A request whose handler did not read its whole body is drained for at most this long
        # before the connection closes (aiohttp's default is 10 s); a stalled body is not waited on longer.
        kwargs.setdefault("lingering_time", min(10.0, read_timeout) if read_timeout > 0 else 10.0)
        # A client that disconnects has its handler cancelled (aiohttp's default is to let it run):
        # a search it gave up on stops its query (asyncpg cancels the statement), and a live stream
        # it dropped frees its slot at once instead of at the next write that fails. A write the
        # client left is unaffected: its command is already on the bus, and a retry with the same
        # Operation-Token gets the stored answer.
        kwargs.setdefault("handler_cancellation", True)
        super().__init__(app, metrics=metrics, read_timeout=read_timeout, **kwargs)

    async def _make_server(self) -> web.Server:
        # AppRunner builds the app's Server (running on_startup and freezing the app); the same
        # handler, request factory and settings are then served by the guarded protocol.
        server = await super()._make_server()
        return _GuardedServer(server.request_handler, request_factory=server.request_factory,
                              handler_cancellation=server.handler_cancellation, **server._kwargs)
