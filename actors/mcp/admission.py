"""Admission on the MCP front: who the client is, and the per-address limit on authorization requests.

The client address is the TCP peer, or what a trusted proxy forwarded (``TOASTMACHINE_TRUSTED_PROXIES``,
the rules of :mod:`infra.client_address`, shared with the web front). ``GET``/``POST /authorize`` is
charged against a corpus-wide GCRA budget per address kept in ``oauth_authorize_budget`` (one
statement, so N MCP nodes allow what one does), behind an in-memory pre-filter of the same rate.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infra.client_address import Address, TrustedProxies, admission_key, client_address
from infra.db.pool import Database
from infra.ratelimit import Gcra, KeyedTokenBucket, address_budget_ctes, local_bucket, retry_after_seconds
from protocol.errors import TooManyRequests

#: Stateless rows each charge deletes (more than the one it may add, so the table shrinks).
_ROWS_DROPPED = 2

# $1 address, $2 emission interval, $3 tolerance (seconds), $4 rows to drop.
_CHARGE = address_budget_ctes("oauth_authorize_budget", address="$1", interval="$2", tolerance="$3", drop="$4") + """
select exists (select 1 from budget) as admitted,
       (select extract(epoch from tat)::float8 from oauth_authorize_budget where address = $1::inet) as tat,
       extract(epoch from now())::float8 as now
"""


def request_address(request: Request, trusted: TrustedProxies) -> Address | None:
    """The client address of a Starlette request (peer, or forwarded by a trusted proxy)."""
    peer = request.client.host if request.client else None
    return client_address(peer, request.headers.getlist("forwarded"), request.headers.getlist("x-forwarded-for"),
                          trusted)


class AuthorizeLimiter:
    """The per-address budget of authorization requests (see the module docstring)."""

    def __init__(self, db: Database, per_minute: int, trusted: TrustedProxies) -> None:
        self.db = db
        self.budget = Gcra(rate=per_minute / 60.0, burst=float(per_minute))
        self.local: KeyedTokenBucket = local_bucket(self.budget)
        self.trusted = trusted

    async def refuse(self, request: Request) -> Response | None:
        """A 429 answer when this request's address is over budget; None when it may proceed."""
        key = admission_key(request_address(request, self.trusted))
        wait = self.local.take(key)
        if wait <= 0:
            row = await self.db.pool.fetchrow(_CHARGE, key, self.budget.interval, self.budget.tolerance,
                                              _ROWS_DROPPED)
            if row["admitted"]:
                return None
            wait = self.budget.wait(row["tat"], row["now"]) if row["tat"] is not None else 1.0
        seconds = retry_after_seconds(wait)
        error = TooManyRequests("Too many authorization requests from this address.",
                                headers={"Retry-After": str(seconds)}, extra={"retry_after": seconds})
        return JSONResponse(error.envelope(), status_code=error.status,
                            headers={"Cache-Control": "no-store", **error.headers})
