"""Admission limits: token buckets keyed by client address or agent, in bounded memory.

These limits are **per node process**: each web node keeps its own buckets in memory, so with N
nodes behind a load balancer a client can get up to N times the configured rate, and a restart
forgets every bucket. That is the intended trade-off for a cheap first line of defence in front of
the database; a corpus-wide quota would need shared state (PostgreSQL or RabbitMQ), not this.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

#: How many not-yet-full buckets :meth:`KeyedTokenBucket.take` looks at, oldest first, when it has to
#: make room. Bounding the scan keeps a flood of new keys from turning every request into a walk over
#: the whole table.
SCAN_LIMIT = 64

# Float slack when comparing refilled levels, so waiting exactly the advertised time always admits.
_EPSILON = 1e-9


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
