"""KeyedTokenBucket with an injected clock: admission, refill, Retry-After and bounded memory."""

from __future__ import annotations

import pytest

from infra.ratelimit import Gcra, KeyedTokenBucket, registration_budget, retry_after_seconds, write_budget


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_burst_then_refused_with_the_time_to_wait(clock: FakeClock) -> None:
    bucket = KeyedTokenBucket(rate=0.5, burst=3, clock=clock)
    assert [bucket.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take("a") == pytest.approx(2.0)  # one token at 0.5/s
    clock.advance(1.0)
    assert bucket.take("a") == pytest.approx(1.0)  # refusals take nothing: half a token is there


def test_waiting_the_advertised_time_admits(clock: FakeClock) -> None:
    bucket = KeyedTokenBucket(rate=20 / 60, burst=20, clock=clock)
    for _ in range(20):
        assert bucket.take("a") == 0.0
    wait = bucket.take("a")
    assert wait > 0
    clock.advance(wait)
    assert bucket.take("a") == 0.0
    assert bucket.take("a") > 0


def test_refill_is_capped_at_burst(clock: FakeClock) -> None:
    bucket = KeyedTokenBucket(rate=10, burst=2, clock=clock)
    assert bucket.take("a") == 0.0
    clock.advance(3600)
    assert [bucket.take("a") for _ in range(3)][:2] == [0.0, 0.0]
    assert bucket.take("a") > 0


def test_keys_are_independent(clock: FakeClock) -> None:
    bucket = KeyedTokenBucket(rate=1, burst=1, clock=clock)
    assert bucket.take("a") == 0.0
    assert bucket.take("a") > 0
    assert bucket.take("b") == 0.0


def test_cost(clock: FakeClock) -> None:
    bucket = KeyedTokenBucket(rate=1, burst=4, clock=clock)
    assert bucket.take("a", cost=3) == 0.0
    assert bucket.take("a", cost=2) == pytest.approx(1.0)
    assert bucket.take("a", cost=1) == 0.0
    with pytest.raises(ValueError):
        bucket.take("a", cost=5)  # could never be admitted
    with pytest.raises(ValueError):
        bucket.take("a", cost=0)


def test_a_clock_going_backwards_adds_nothing(clock: FakeClock) -> None:
    bucket = KeyedTokenBucket(rate=1, burst=1, clock=clock)
    assert bucket.take("a") == 0.0
    clock.advance(-10)
    assert bucket.take("a") == pytest.approx(1.0)


@pytest.mark.parametrize(("kw", "arg"), [({"rate": 0, "burst": 1}, "rate"), ({"rate": 1, "burst": 0}, "burst"),
                                          ({"rate": 1, "burst": 1, "max_keys": 0}, "max_keys")])
def test_invalid_parameters(kw: dict[str, float], arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        KeyedTokenBucket(**kw)  # type: ignore[arg-type]


def test_full_buckets_are_dropped_first_at_the_key_limit(clock: FakeClock) -> None:
    bucket = KeyedTokenBucket(rate=1, burst=2, max_keys=3, clock=clock)
    bucket.take("old")          # will have refilled: carries no state
    clock.advance(5)
    bucket.take("busy")
    bucket.take("busy")         # empty: must not be forgotten
    bucket.take("recent")
    bucket.take("new")          # at the limit: "old" is full, so it goes
    assert len(bucket) == 3
    assert "old" not in bucket and "busy" in bucket
    assert bucket.take("busy") > 0


def test_oldest_bucket_is_evicted_when_none_is_full(clock: FakeClock) -> None:
    bucket = KeyedTokenBucket(rate=1, burst=1, max_keys=3, clock=clock)
    for key in ("a", "b", "c"):
        bucket.take(key)
    bucket.take("a")            # refused, but it makes "a" the most recently used
    bucket.take("d")
    assert len(bucket) == 3
    assert "b" not in bucket and all(k in bucket for k in ("a", "c", "d"))
    assert bucket.take("a") > 0  # its state survived


def test_memory_stays_bounded_under_a_flood_of_keys(clock: FakeClock) -> None:
    bucket = KeyedTokenBucket(rate=0.001, burst=5, max_keys=100, clock=clock)
    for i in range(10_000):
        bucket.take(f"k{i}")
        clock.advance(0.001)
    assert len(bucket) == 100


def test_retry_after_is_a_whole_number_of_seconds_at_least_one() -> None:
    assert retry_after_seconds(0.01) == 1
    assert retry_after_seconds(1.0) == 1
    assert retry_after_seconds(1.2) == 2
    assert retry_after_seconds(59.9) == 60


# --- GCRA: the arithmetic of the corpus-wide budgets (their state lives in PostgreSQL) -----------


def test_gcra_admits_a_burst_then_one_per_interval() -> None:
    gcra = Gcra(rate=2, burst=4)
    now = 1_700_000_000.0  # epoch seconds, as the database clock gives them
    tat = 0.0  # a new key: its whole burst
    assert [gcra.wait(tat, now, taken) for taken in range(4)] == [0.0] * 4
    assert gcra.wait(tat, now, 4) == pytest.approx(0.5)
    tat = gcra.advance(tat, now, 4)
    assert tat == pytest.approx(now + 2.0)
    assert gcra.wait(tat, now + 0.5) == 0.0  # waiting exactly the advertised time admits
    assert gcra.wait(tat, now + 0.5, 1) == pytest.approx(0.5)
    assert gcra.wait(tat, now + 3600) == 0.0 and gcra.advance(tat, now + 3600, 1) == now + 3600.5


def test_budgets_follow_the_settings() -> None:
    assert (write_budget(10).rate, write_budget(10).burst) == (10, 20)
    assert write_budget(0.1).burst == 1  # a burst below one write could never admit anything
    assert registration_budget(20).interval == pytest.approx(3.0)
    assert registration_budget(20).tolerance == pytest.approx(57.0)
    with pytest.raises(ValueError):
        Gcra(rate=0, burst=1)
