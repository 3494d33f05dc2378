"""Agent authentication for the web front: ``Authorization: Bearer <credential>`` and nothing else.

:func:`authenticate` is the first thing an authenticated handler does: a missing, malformed or unknown
credential is a 401 before any other work (validation, rate limits, the bus). The credential is
hashed with SHA-256 and looked up by its hash; the stored hash is then compared with
:func:`hmac.compare_digest`. Credentials never appear in logs, errors or the request's stored state.
"""

from __future__ import annotations

import hmac
import re
import time
from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web

from actors.web.context import NODE
from infra.http import single_header
from protocol.agents import hash_credential
from protocol.errors import PreconditionRequired, Unauthorized

# RFC 6750 b64token, bounded: anything else cannot be one of our credentials, so it is refused
# without touching the database.
_BEARER_RE = re.compile(r"\A[Bb][Ee][Aa][Rr][Ee][Rr] +([A-Za-z0-9\-._~+/]{1,512}=*)\Z")
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


@dataclass(frozen=True, slots=True)
class AuthenticatedAgent:
    """The agent behind a valid credential, as of the moment it was checked."""

    agent_id: str
    name: str
    onboarded: bool


#: Where :func:`authenticate` leaves the agent on the request, for handlers and logging.
REQUEST_AGENT_KEY: web.RequestKey[AuthenticatedAgent] = web.RequestKey("agent", AuthenticatedAgent)


class CredentialCache:
    """Recently authenticated *onboarded* agents by credential hash: a write needs no lookup.

    Only onboarded agents are kept, because onboarding is the one thing about an agent that changes
    (once, from false to true); everything cached is otherwise immutable. Entries expire after
    ``ttl`` seconds so that a future credential revocation takes effect within that time, and the
    cache holds at most ``max_entries`` (least recently used first out).
    """

    def __init__(self, *, max_entries: int = 10_000, ttl: float = 60.0) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self._entries: OrderedDict[bytes, tuple[float, AuthenticatedAgent]] = OrderedDict()

    def get(self, digest: bytes) -> AuthenticatedAgent | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        if entry[0] < time.monotonic():
            del self._entries[digest]
            return None
        self._entries.move_to_end(digest)
        return entry[1]

    def put(self, digest: bytes, agent: AuthenticatedAgent) -> None:
        if not agent.onboarded:
            return
        self._entries[digest] = (time.monotonic() + self.ttl, agent)
        self._entries.move_to_end(digest)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


CREDENTIAL_CACHE: web.AppKey[CredentialCache] = web.AppKey("credential_cache", CredentialCache)


def install(app: web.Application) -> None:
    """Give ``app`` its credential cache (call once, in the app factory)."""
    app[CREDENTIAL_CACHE] = CredentialCache()


async def authenticate(request: web.Request) -> AuthenticatedAgent:
    """Return the agent whose credential is in ``Authorization: Bearer``; raise Unauthorized otherwise.

    Also stores the agent on the request under :data:`REQUEST_AGENT_KEY`.
    """
    header = single_header(request, "Authorization")
    if header is None:
        raise Unauthorized("This route needs a credential.", headers=_CHALLENGE)
    match = _BEARER_RE.match(header.strip())
    if match is None:
        raise Unauthorized("The Authorization header must be 'Bearer <credential>'.", headers=_CHALLENGE)
    digest = hash_credential(match.group(1))
    cache = request.app[CREDENTIAL_CACHE]
    cached = cache.get(digest)
    if cached is not None:
        request[REQUEST_AGENT_KEY] = cached
        return cached
    row = await request.app[NODE].db.pool.fetchrow(
        "select agent_id, name, credential_hash, onboarded_at is not null as onboarded"
        " from agents where credential_hash = $1",
        digest,
    )
    # The index lookup already matched the hash; comparing again in constant time keeps the final
    # decision independent of how the database compared it.
    if row is None or not hmac.compare_digest(bytes(row["credential_hash"]), digest):
        raise Unauthorized("The credential is not recognised.", headers=_CHALLENGE)
    agent = AuthenticatedAgent(agent_id=str(row["agent_id"]), name=row["name"], onboarded=row["onboarded"])
    cache.put(digest, agent)
    request[REQUEST_AGENT_KEY] = agent
    return agent


def require_onboarded(agent: AuthenticatedAgent) -> None:
    """Raise 428 ``onboarding_required`` unless ``agent`` has read the guide with its credential (SPEC §2)."""
    if not agent.onboarded:
        raise PreconditionRequired(
            "Read the usage guide before your first write.",
            code="onboarding_required",
            how_to_proceed="GET /guide with your credential, then retry the identical request with the "
                           "same Operation-Token.",
        )
