"""HTTP plumbing shared by the aiohttp front-ends: JSON responses, the error envelope, trace ids.

One middleware renders every error (our :class:`ApiError`, aiohttp's own 404/405/413, and any
unexpected exception) as SPEC §3's envelope ``{"error": {code, message, how_to_proceed}}``. An
unexpected exception is logged with its traceback and the trace id, and answered with fixed public
text: no stack trace, SQL message or secret ever reaches a client.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler

from infra.client_address import Address, TrustedProxies, client_address
from infra.logs import bound_trace, get_logger, valid_trace_id
from infra.metrics import Metrics
from infra.outages import DB_UNAVAILABLE_ERRORS, unavailable
from protocol.errors import (
    ApiError,
    BadRequest,
    InternalError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    ReadTimeout,
    UnsupportedMediaType,
)
from protocol.validation import decode_json_body

log = get_logger("toastmachine.http")

TRACE_RESPONSE_HEADER = "X-Trace-Id"
#: The ``Server`` header of every answer of the web front, the ones aiohttp's parser refusals get
#: too. aiohttp's default names the Python and aiohttp versions, which tells an attacker which
#: published vulnerabilities to try; this names only the product.
SERVER_HEADER = "ToastMachine"
#: Where the middleware keeps a request's trace id (read by :func:`trace_header`).
TRACE_ID: web.RequestKey[str] = web.RequestKey("trace_id", str)
#: The request's client address, resolved once by the middleware (see :func:`request_client`).
CLIENT_ADDRESS: web.RequestKey[Address | None] = web.RequestKey("client_address")
#: The status of a streamed answer whose last byte was sent (set by :func:`delivered`).
DELIVERED: web.RequestKey[int] = web.RequestKey("delivered", int)

#: Seconds a request body may take to arrive (TOASTMACHINE_HTTP_READ_TIMEOUT); unset: no deadline.
READ_TIMEOUT: web.AppKey[float] = web.AppKey("read_timeout", float)
#: The status recorded for a request whose client left before the answer (nginx's convention):
#: never sent, but kept apart from the server's own failures in the metrics.
CLIENT_CLOSED = 499


class ClientGone(Exception):
    """The client closed its connection before its request was read: nobody is left to answer.

    Deliberately not an OSError: the middleware must not take it for the database going away.
    """


async def delivered(request: web.Request, response: web.StreamResponse) -> None:
    """End a streamed ``response`` (``write_eof``) and record it delivered: a client that closes
    the connection once it has the last byte (as curl does) makes aiohttp cancel the handler while
    it still tidies up (a transaction to end, a connection to give back); that is counted as the
    status sent, not as a client gone before its answer."""
    await response.write_eof()
    request[DELIVERED] = response.status


def json_response(data: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response encoded with orjson."""
    return web.Response(body=orjson.dumps(data), status=status, headers=headers,
                        content_type="application/json")


def error_response(error: ApiError) -> web.Response:
    """Render an ApiError as the public envelope with its status and headers."""
    return json_response(error.envelope(), status=error.status, headers=error.headers)


def _from_http_exception(exc: web.HTTPException) -> ApiError:
    """Map aiohttp's own errors (router 404/405, body too large...) onto our envelope."""
    if isinstance(exc, web.HTTPNotFound):
        return NotFound()
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return MethodNotAllowed(headers={"Allow": ", ".join(sorted(exc.allowed_methods))})
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return PayloadTooLarge()
    return ApiError(exc.reason or "HTTP error", status=exc.status,
                    code=(exc.reason or "http_error").lower().replace(" ", "_"),
                    how_to_proceed="Check the request against GET /openapi.json.")


def resolve_client(request: web.BaseRequest, trusted: TrustedProxies) -> Address | None:
    """The client address of ``request``: its TCP peer, or what trusted proxies forwarded
    (:mod:`infra.client_address`)."""
    return client_address(request.remote, request.headers.getall("Forwarded", []),
                          request.headers.getall("X-Forwarded-For", []), trusted)


def request_client(request: web.Request) -> Address | None:
    """The client address the middleware resolved for ``request`` (the TCP peer without it)."""
    if CLIENT_ADDRESS in request:
        return request[CLIENT_ADDRESS]
    return resolve_client(request, TrustedProxies())


async def trace_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the request's trace id on every answer, those a handler streams
    (prepares itself: the export, the SSE stream) too, which the middleware sees only once sent."""
    trace_id = request.get(TRACE_ID)
    if trace_id is not None:
        response.headers[TRACE_RESPONSE_HEADER] = trace_id


def make_middleware(metrics: Metrics | None = None, trusted_proxies: TrustedProxies | None = None) -> Any:
    """The one middleware: resolves the client address, binds a trace id, renders errors, records
    request metrics. ``trusted_proxies``: whose forwarding headers name the client (default nobody)."""
    trusted = trusted_proxies or TrustedProxies()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        incoming = request.headers.get(TRACE_RESPONSE_HEADER, "")
        started = time.perf_counter()
        client = request[CLIENT_ADDRESS] = resolve_client(request, trusted)

        def record(status: int) -> None:
            if metrics is not None:
                info = request.match_info.route.resource
                route = info.canonical if info is not None else "unmatched"
                metrics.requests.labels(request.method, route, str(status)).inc()
                metrics.latency.labels(request.method, route).observe(time.perf_counter() - started)

        with bound_trace(valid_trace_id(incoming),
                         method=request.method, path=request.path,
                         client=str(client) if client is not None else "unknown") as trace_id:
            request[TRACE_ID] = trace_id  # for answers streamed before the handler returns (trace_header)
            try:
                response = await handler(request)
            except asyncio.CancelledError:
                # aiohttp cancels the handler of a client that disconnected (handler_cancellation):
                # counted as the 499 it would have been answered, then the cancellation goes on;
                # unless the whole answer had been sent, and the client merely closed after it.
                if DELIVERED in request:
                    record(request[DELIVERED])
                elif request.transport is None or request.transport.is_closing():
                    log.info("http.client_gone")
                    record(CLIENT_CLOSED)
                raise
            except ClientGone:
                log.info("http.client_gone")
                response = web.Response(status=CLIENT_CLOSED)
            except ApiError as e:
                response = error_response(e)
            except web.HTTPException as e:
                if e.status < 400:  # redirects and the like are not errors
                    raise
                response = error_response(_from_http_exception(e))
            except Exception as e:
                # PostgreSQL stopped, restarting or unreachable, or the broker: a 503 the client can
                # retry, not a 500.
                outage = unavailable(e)
                if outage is not None:
                    log.warning("http.database_unavailable" if isinstance(e, DB_UNAVAILABLE_ERRORS)
                                else "http.bus_unavailable", error=repr(e))
                    response = error_response(outage)
                else:
                    log.exception("http.unhandled_error")
                    response = error_response(InternalError())
            record(response.status)  # (its X-Trace-Id is set as it is prepared: trace_header)
            return response

    return middleware


async def read_json(request: web.Request, *, allow_empty: bool = False) -> object:
    """The request's JSON body: 415 unless application/json, 413 over the size cap, 400 if malformed,
    422 if it breaks :func:`~protocol.validation.decode_json_body`'s depth or exact-number rule.

    With ``allow_empty``, an empty body (with or without a Content-Type) reads as ``{}``.
    """
    timeout = request.app.get(READ_TIMEOUT)
    try:
        async with asyncio.timeout(timeout):
            body = await request.read()  # aiohttp raises 413 past client_max_size; the middleware renders it
    except TimeoutError:
        raise ReadTimeout("The request body was not received in time.",
                             how_to_proceed="Send the whole body without pausing, then retry with the "
                                            "same Operation-Token.") from None
    except ConnectionError:
        raise ClientGone() from None
    except HttpProcessingError:  # a broken chunked encoding or a short body: the message says where
        raise BadRequest("The request body could not be read (bad framing).", code="malformed_request",
                         how_to_proceed="Send the body with a correct Content-Length or chunked encoding.") from None
    if allow_empty and not body.strip():
        return {}
    if request.content_type != "application/json":
        raise UnsupportedMediaType()
    if (request.charset or "utf-8").lower() not in ("utf-8", "utf8"):
        # JSON is UTF-8 (RFC 8259 §8.1): a body announced as another charset would be read as
        # something it says it is not.
        raise UnsupportedMediaType("Writes must be sent as UTF-8 JSON.",
                                   how_to_proceed="Send 'Content-Type: application/json' (or with "
                                                  "charset=utf-8) and the body encoded in UTF-8.")
    # 400 if malformed; 422 past the nesting limit or for a number that cannot be stored exactly.
    return decode_json_body(body)


def single_header(request: web.Request, name: str) -> str | None:
    """The value of a header that may appear once (a credential, a token, a resume position), or
    None when absent. Sent twice it is a 400 ``repeated_header`` naming it (RFC 9110 §5.3 lets
    only list-valued fields repeat): which of two Operation-Tokens or credentials a client meant
    is not a guess a server should make."""
    values = request.headers.getall(name, ())
    if len(values) > 1:
        raise BadRequest(f"The {name} header is sent {len(values)} times; it takes one value.",
                         code="repeated_header", extra={"field": name},
                         how_to_proceed=f"Send {name} once.")
    return values[0] if values else None


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    """``If-None-Match`` against ``etag``, with the weak comparison RFC 9110 prescribes for it:
    any listed tag equal but for a ``W/`` prefix, or ``*``."""
    if not if_none_match:
        return False
    for candidate in if_none_match.split(","):
        candidate = candidate.strip()
        if candidate == "*" or candidate.removeprefix("W/") == etag:
            return True
    return False


_QVALUE = re.compile(r"0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?")


def negotiate(accept: str | None, produced: tuple[str, ...]) -> str | None:
    """Pick one of ``produced`` (in server preference order) for an ``Accept`` header, or None.

    No header (or a blank one) means the first produced type. For each produced type, the most
    specific matching range (``type/sub`` over ``type/*`` over ``*/*``) gives its quality; the
    highest non-zero quality wins, then the more specific match, then server preference.
    """
    if accept is None or not accept.strip():
        return produced[0]
    ranges: list[tuple[str, str, float]] = []
    for part in accept.split(","):
        fields = [f.strip() for f in part.split(";")]
        media = fields[0].lower()
        if "/" not in media:
            continue
        main, sub = media.split("/", 1)
        q = 1.0
        for param in fields[1:]:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                # RFC 9110 §12.4.2's qvalue, nothing looser (float() takes NaN, inf, 1e-3...):
                # anything else counts as 0, "not acceptable".
                value = value.strip()
                q = float(value) if _QVALUE.fullmatch(value) else 0.0
        ranges.append((main, sub, q))
    best: tuple[float, int, int] | None = None
    chosen: str | None = None
    for preference, media in enumerate(produced):
        main, sub = media.split("/", 1)
        match: tuple[int, float] | None = None
        for r_main, r_sub, q in ranges:
            if r_main == main and r_sub == sub:
                specificity = 2
            elif r_main == main and r_sub == "*":
                specificity = 1
            elif r_main == "*" and r_sub == "*":
                specificity = 0
            else:
                continue
            if match is None or specificity > match[0]:
                match = (specificity, q)
        if match is None or match[1] <= 0:
            continue
        rank = (match[1], match[0], -preference)
        if best is None or rank > best:
            best, chosen = rank, media
    return chosen
