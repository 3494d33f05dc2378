"""Admission limits: the arithmetic of the corpus-wide budgets, and the edge's local token buckets.

Two layers, with the same rate and burst:

- :class:`Gcra`: the generic cell rate algorithm behind the **corpus-wide** budgets, whose state (one
  theoretical arrival time per key) lives in PostgreSQL (migration 0005): the corpus writer keeps
  each agent's write budget in the transaction of every batch, ``POST /register`` each address's
  registration budget in the statement that inserts the agent. One or N web nodes give the same limit.
- :class:`KeyedTokenBucket`: a **per node process** pre-filter in memory, so that a flood from one
  agent or address is refused on the edge before it costs a database round trip. On its own it
  would let N nodes allow N times the rate, and a restart forgets it; the database budget decides.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: How many not-yet-full buckets :meth:`KeyedTokenBucket.take` looks at, oldest first, when it has to
#: make room. Bounding the scan keeps a flood of new keys from turning every request into a walk over
#: the whole table.
SCAN_LIMIT = 64

# Float slack when comparing refilled levels, so waiting exactly the advertised time always admits.
_EPSILON = 1e-9
# The same for epoch seconds (about 1.7e9, where a double resolves about 0.2 microseconds).
_CLOCK_SLACK = 1e-6


@dataclass(frozen=True, slots=True)
class Gcra:
    """The generic cell rate algorithm for ``rate`` requests a second with bursts of ``burst``.

    State per key is one number, the theoretical arrival time ``tat`` (seconds on a clock shared by
    everyone who decides, here the database's): the moment the key's budget would be fully spent
    at the sustained rate. A key with no state, or a ``tat`` in the past, has its whole burst.
    Request ``i`` (0-based) of several taken at ``now`` is admitted when
    ``max(tat, now) + i * interval <= now + tolerance``; taking ``n`` moves ``tat`` to
    ``max(tat, now) + n * interval``.
    """

    rate: float
    burst: float

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if not self.burst >= 1:
            raise ValueError(f"burst must be at least 1, got {self.burst}")

    @property
    def interval(self) -> float:
        """Seconds one request costs: 1 / rate."""
        return 1.0 / self.rate

    @property
    def tolerance(self) -> float:
        """How far ahead of ``now`` the ``tat`` may be for a request to be admitted: (burst - 1) / rate."""
        return (self.burst - 1.0) / self.rate

    def wait(self, tat: float, now: float, taken: int = 0) -> float:
        """Seconds until request number ``taken`` (0-based, after ``taken`` others at ``now``) is
        admitted; 0.0 when it is admitted now."""
        due = max(tat, now) + taken * self.interval - self.tolerance
        return 0.0 if due <= now + _CLOCK_SLACK else due - now

    def advance(self, tat: float, now: float, taken: int) -> float:
        """The new ``tat`` once ``taken`` requests were admitted at ``now``."""
        return max(tat, now) + taken * self.interval


def address_budget_ctes(table: str, *, address: str, interval: str, tolerance: str, drop: str) -> str:
    """The two CTEs that charge a per-address GCRA budget kept in ``table`` (columns ``address inet``,
    ``tat timestamptz``) inside one statement, for a caller to finish with its own ``select``.

    ``budget`` returns a row only when the address was admitted (its theoretical arrival time moved
    on by ``interval`` seconds, refused past ``tolerance``); ``dropped`` deletes up to ``drop`` rows of
    other addresses that no longer carry state, so the table shrinks back to the addresses active in
    the last window. The arguments are the statement's placeholders (``$5``...), never values.
    """
    return f"""
with budget as (
    insert into {table} as b (address, tat)
    values ({address}::inet, now() + make_interval(secs => {interval}))
    on conflict (address) do update set tat = greatest(b.tat, now()) + make_interval(secs => {interval})
        where b.tat <= now() + make_interval(secs => {tolerance})
    returning 1
), dropped as (
    delete from {table} where address = any(array(
        select address from {table} where tat < now() and address <> {address}::inet
        order by tat limit {drop} for update skip locked))
)"""


def write_budget(writes_per_second: float) -> Gcra:
    """Each agent's write budget (TOASTMACHINE_WRITES_PER_SECOND): that rate sustained, bursts of twice it."""
    return Gcra(rate=writes_per_second, burst=max(1.0, 2 * writes_per_second))


def registration_budget(per_minute: int) -> Gcra:
    """Each client address's registration budget (TOASTMACHINE_REGISTER_PER_MINUTE): bursts of a minute's worth."""
    return Gcra(rate=per_minute / 60.0, burst=float(per_minute))


def local_bucket(budget: Gcra, **kwargs: Any) -> KeyedTokenBucket:
    """The edge's in-memory pre-filter for ``budget``: the same rate and burst, in this process only."""
    return KeyedTokenBucket(rate=budget.rate, burst=budget.burst, **kwargs)


class _Bucket:
    __slots__ = ("tokens", "updated")

    def __init__(self, tokens: float, updated: float) -> None:
        self.tokens = tokens
        self.updated = updated


class KeyedTokenBucket:
    """One token bucket per key (a client address, an agent id), created on first use.

    Each bucket holds up to ``burst`` tokens and refills at ``rate`` tokens per second; a request
    costing ``cost`` tokens is admitted when the bucket holds that many. A refused request takes
    nothing, so a client that waits the advertised time is admitted.

    Memory is bounded by ``max_keys``. When a new key arrives at the limit, buckets that have refilled
    to full are dropped first (a full bucket is the same as no bucket, so forgetting it changes no
    decision); if none is found, the least recently used bucket is evicted, which can only make the
    limiter more lenient to that one key.

    The state lives in this process only (see the module docstring). Not thread-safe; meant for one
    event loop, where :meth:`take` runs without awaiting.
    """

    def __init__(
        self,
        rate: float,
        burst: float,
        *,
        max_keys: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``rate``: tokens added per second per key (> 0). ``burst``: capacity of a bucket (> 0).
        ``max_keys``: most buckets kept at once (>= 1). ``clock``: seconds, monotonic (injectable for tests).
        """
        if not rate > 0:
            raise ValueError(f"rate must be positive, got {rate}")
        if not burst > 0:
            raise ValueError(f"burst must be positive, got {burst}")
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys}")
        self.rate = float(rate)
        self.burst = float(burst)
        self.max_keys = max_keys
        self._clock = clock
        # Ordered by last use: take() re-inserts the key it touches, so the first entry is the oldest.
        self._buckets: dict[str, _Bucket] = {}

    def __len__(self) -> int:
        """How many buckets are held."""
        return len(self._buckets)

    def __contains__(self, key: object) -> bool:
        return key in self._buckets

    def take(self, key: str, cost: float = 1.0) -> float:
        """Try to take ``cost`` tokens from ``key``'s bucket.

        Returns 0.0 when admitted (the tokens are taken), otherwise the seconds to wait until the
        bucket will hold ``cost`` tokens (nothing is taken). Render a wait with
        :func:`retry_after_seconds`. Raises ValueError if ``cost`` is not in (0, burst].
        """
        if not 0 < cost <= self.burst:
            raise ValueError(f"cost must be in (0, {self.burst}], got {cost}")
        now = self._clock()
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._make_room(now)
            bucket = _Bucket(self.burst, now)
        else:
            bucket.tokens = self._level(bucket, now)
            bucket.updated = now
        self._buckets[key] = bucket
        if bucket.tokens + _EPSILON >= cost:
            bucket.tokens = max(0.0, bucket.tokens - cost)
            return 0.0
        return (cost - bucket.tokens) / self.rate

    def give_back(self, key: str, cost: float = 1.0) -> None:
        """Return ``cost`` tokens taken for a request that turned out to cost nothing (an idempotent
        replay); the bucket never goes above ``burst``. A key without a bucket is full already."""
        bucket = self._buckets.get(key)
        if bucket is not None:
            now = self._clock()
            bucket.tokens = min(self.burst, self._level(bucket, now) + cost)
            bucket.updated = now

    def _level(self, bucket: _Bucket, now: float) -> float:
        """Tokens in ``bucket`` at ``now``, capped at ``burst``."""
        elapsed = max(0.0, now - bucket.updated)
        return min(self.burst, bucket.tokens + elapsed * self.rate)

    def _make_room(self, now: float) -> None:
        """Free at least one slot: drop full buckets (oldest first), else evict the oldest bucket."""
        full: list[str] = []
        seen_partial = 0
        for key, bucket in self._buckets.items():
            if self._level(bucket, now) + _EPSILON >= self.burst:
                full.append(key)
            else:
                seen_partial += 1
                if seen_partial >= SCAN_LIMIT:
                    break
        for key in full:
            del self._buckets[key]
        if not full:
            del self._buckets[next(iter(self._buckets))]


def retry_after_seconds(wait: float) -> int:
    """A wait from :meth:`KeyedTokenBucket.take` as a ``Retry-After`` value: whole seconds, at least 1."""
    return max(1, math.ceil(wait))
