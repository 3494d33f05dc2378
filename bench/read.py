"""Reading the corpus: the read routes over HTTP against the same SQL through plain asyncpg.

Seeds a fresh database with ``--messages`` messages (default 100,000) using the seeder of
``toastmachine dev seed`` (agents, conversations, tags, mentions, relationships; COPY), then
measures four reads, each for ``--seconds`` per round at ``--concurrency`` (default 32) requests in
flight, alternating ours and the baseline for ``--rounds`` rounds (the median round is reported):

- ``conversation``: ``GET /conversations/{id}?limit=50`` (a conversation and its first 50 messages);
- ``messages``: ``GET /messages?tag=T&kinds=claim,question,post&limit=50`` (a filtered list);
- ``search``: ``GET /search?q=W&limit=20`` (full text, ranked; W a word in 0.2-1 % of messages);
- ``tags``: ``GET /tags?sort=count&min_count=2&limit=50`` (the tag listing).

Parameters rotate over a few conversations, tags and queries picked from the seeded data. The
baseline runs exactly the route's statements (built by the same plan functions in
``actors/reads/queries.py``) through an asyncpg pool of the same size as the web front's
(``TOASTMACHINE_DB_POOL_SIZE``), fetching the rows and nothing more: no HTTP, no JSON. The web front
runs in its own process (``--server subprocess``, the default) on the in-process bus (reads never
touch the bus). Prints requests/s, p50 and p99 of each, and the ratio ours/raw (target >= 0.5 for
each read; search p99 <= 50 ms).

Run: ``python bench/read.py [--database-url postgresql://...] [--messages N] [--concurrency C]
[--seconds S] [--rounds R] [--server subprocess|inprocess] [--database NAME] [--keep]``
(``--database`` reuses an already seeded database on that server instead of seeding a fresh one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import aiohttp
import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.reads import queries as reads
from bench.stream import fresh_database, front, percentile
from infra.config import Settings
from protocol.query import Query
from toastmachine.seed import seed_corpus

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
SEARCH_P99_TARGET_MS = 50.0


@dataclass(slots=True)
class Workload:
    """One read: how to ask it over HTTP, and the same statements through asyncpg."""

    name: str
    http: Callable[[int], str]  # request number → path and query
    raw: Callable[[asyncpg.Pool, int], Awaitable[Any]]


@dataclass(slots=True)
class Result:
    who: str
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


async def closed_loop(concurrency: int, seconds: float, one: Callable[[int], Awaitable[bool]], who: str) -> Result:
    """``concurrency`` workers issuing requests back to back for ``seconds``; latency of each."""
    latencies: list[float] = []
    errors = 0
    counter = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal counter, errors
        while time.perf_counter() < deadline:
            counter += 1
            started = time.perf_counter()
            ok = await one(counter)
            latencies.append(time.perf_counter() - started)
            errors += not ok

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return Result(who, len(latencies), elapsed, percentile(latencies, 0.5) * 1000, percentile(latencies, 0.99) * 1000,
                  errors)


async def pick_parameters(pool: asyncpg.Pool, matches_of: dict[str, int]) -> dict[str, list[Any]]:
    """A few realistic arguments for each read, taken from the seeded data (``matches_of``: each
    search term's number of matching messages)."""
    total = await pool.fetchval("select count(*) from messages")
    conversations = [r[0] for r in await pool.fetch(
        "select conversation_id from conversation_activity where message_count between 10 and 200"
        " order by last_sequence desc limit 8")]
    if not conversations:
        conversations = [r[0] for r in await pool.fetch(
            "select conversation_id from conversation_activity order by message_count desc limit 8")]
    tags = [r[0] for r in await pool.fetch("select tag from tag_stats order by message_count desc offset 3 limit 6")]
    # Search terms as people type them: specific words, matching a few hundred messages (0.1-0.6 % of
    # 100k), not the corpus's commonest words. Every match is ranked, so a search costs about 4 µs
    # per matching message on top of a fixed cost; the printout gives the match counts used.
    candidates = [r[0] for r in await pool.fetch(
        "select word from ts_stat($$select to_tsvector('simple', content) from messages"
        " where content is not null limit 5000$$) where length(word) > 3 and ndoc between 2 and 40"
        " order by ndoc desc, word limit 200")]
    low, high = max(20, total // 1000), max(60, total * 6 // 1000)
    queries: list[str] = []
    for word in candidates:
        matches = await pool.fetchval(
            "select count(*) from messages where search @@ (websearch_to_tsquery('english', $1)"
            " || websearch_to_tsquery('simple', $1))", word)
        if low <= matches <= high:
            queries.append(word)
            matches_of[word] = matches
        if len(queries) == 8:
            break
    return {"conversations": conversations, "tags": tags or ["none"], "queries": queries or ["agent"]}


def workloads(params: dict[str, list[Any]]) -> list[Workload]:
    conversations, tags, queries = params["conversations"], params["tags"], params["queries"]

    async def raw_conversation(pool: asyncpg.Pool, n: int) -> Any:
        cid = conversations[n % len(conversations)]
        async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            await conn.fetchrow(reads.CONVERSATION_SQL, cid)
            return await conn.fetch(reads.CONVERSATION_MESSAGES_SQL, cid, 0, 51)

    def messages_query(n: int) -> dict[str, str]:
        return {"tag": tags[n % len(tags)], "kinds": "post,claim,question", "limit": "50"}

    def search_query(n: int) -> dict[str, str]:
        return {"q": queries[n % len(queries)], "limit": "20"}

    tags_query = {"sort": "count", "min_count": "2", "limit": "50"}

    def raw_plan(plan_of: Callable[[Query], reads.Plan], accepted: tuple[str, ...],
                 query: Callable[[int], dict[str, str]]) -> Callable[[asyncpg.Pool, int], Awaitable[Any]]:
        async def run(pool: asyncpg.Pool, n: int) -> Any:
            plan = plan_of(Query(query(n), accepted))
            return await pool.fetch(plan.sql, *plan.params)
        return run

    return [
        Workload("conversation", lambda n: f"/conversations/{conversations[n % len(conversations)]}?limit=50",
                 raw_conversation),
        Workload("messages", lambda n: "/messages?" + urlencode(messages_query(n)),
                 raw_plan(reads.plan_messages, reads.MESSAGE_PARAMS, messages_query)),
        Workload("search", lambda n: "/search?" + urlencode(search_query(n)),
                 raw_plan(reads.plan_search, reads.SEARCH_PARAMS, search_query)),
        Workload("tags", lambda n: "/tags?" + urlencode(tags_query),
                 raw_plan(reads.plan_tags, reads.TAG_PARAMS, lambda n: tags_query)),
    ]


@contextlib.asynccontextmanager
async def seeded(args: argparse.Namespace) -> AsyncIterator[str]:
    if args.database:
        yield urlsplit(args.database_url)._replace(path="/" + args.database).geturl()
        return
    async with fresh_database(args.database_url, args.keep) as dsn:
        started = time.perf_counter()

        def progress(p: Any) -> None:
            print(f"  seeded {p.messages:,}/{p.total_messages:,} messages ({p.seconds:.0f} s)", flush=True)

        report = await seed_corpus(dsn, messages=args.messages, progress=progress)
        print(report.summary())
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("vacuum analyze")
        finally:
            await conn.close()
        print(f"seeded and analysed in {time.perf_counter() - started:.0f} s", flush=True)
        yield dsn


def _median(results: list[Result]) -> Result:
    """The round with the median throughput."""
    return sorted(results, key=lambda r: r.rate)[len(results) // 2]


async def main(args: argparse.Namespace) -> None:
    async with seeded(args) as dsn:
        pool_size = Settings.from_env({}).db_pool_size
        # The same planning as the web front's pool (see Database.connect's custom_plans).
        pool = await asyncpg.create_pool(dsn, min_size=pool_size, max_size=pool_size,
                                         server_settings={"plan_cache_mode": "force_custom_plan"})
        assert pool is not None
        try:
            matches_of: dict[str, int] = {}
            params = await pick_parameters(pool, matches_of)
            loads = workloads(params)
            print(f"concurrency {args.concurrency}, {args.seconds:.0f} s per side per round, {args.rounds} rounds, "
                  f"database pool {pool_size} on both sides; tags {params['tags']}; search terms (matches): "
                  + ", ".join(f"{w} ({n})" for w, n in matches_of.items()))
            results: dict[str, dict[str, list[Result]]] = {w.name: {"ours": [], "raw": []} for w in loads}
            async with front(dsn, args.server) as base:
                connector = aiohttp.TCPConnector(limit=args.concurrency)
                async with aiohttp.ClientSession(base, connector=connector) as session:
                    for load in loads:  # warm both sides (plans, caches, connections)
                        for n in range(args.concurrency):
                            async with session.get(load.http(n)) as resp:
                                if resp.status != 200:
                                    raise RuntimeError(f"{load.name}: {resp.status} {await resp.text()}")
                                await resp.read()
                            await load.raw(pool, n)

                    for _ in range(args.rounds):
                        for load in loads:
                            async def ours(n: int, load: Workload = load) -> bool:
                                async with session.get(load.http(n)) as resp:
                                    await resp.read()
                                    return resp.status == 200

                            async def raw(n: int, load: Workload = load) -> bool:
                                await load.raw(pool, n)
                                return True

                            results[load.name]["ours"].append(
                                await closed_loop(args.concurrency, args.seconds, ours, "ours"))
                            results[load.name]["raw"].append(
                                await closed_loop(args.concurrency, args.seconds, raw, "raw"))
        finally:
            await pool.close()

    print()
    print(f"{'read':<13}{'ours req/s':>11}{'p50 ms':>9}{'p99 ms':>9}{'raw req/s':>11}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'ratio':>8}  verdict")
    for name, sides in results.items():
        mine, theirs = _median(sides["ours"]), _median(sides["raw"])
        ratio = mine.rate / theirs.rate if theirs.rate else 0.0
        verdict = "met" if ratio >= 0.5 else "NOT met"
        if name == "search":
            verdict += f"; p99 {'<=' if mine.p99_ms <= SEARCH_P99_TARGET_MS else '>'} {SEARCH_P99_TARGET_MS:.0f} ms"
        errors = sum(r.errors for r in sides["ours"])
        if errors:
            verdict += f"; {errors} non-200 answers"
        print(f"{name:<13}{mine.rate:>11,.0f}{mine.p50_ms:>9.1f}{mine.p99_ms:>9.1f}{theirs.rate:>11,.0f}"
              f"{theirs.p50_ms:>9.1f}{theirs.p99_ms:>9.1f}{ratio:>8.2f}  {verdict}")
    print(f"(median of {args.rounds} rounds; ratio = ours/raw requests per second, target >= 0.5)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", default=DEFAULT_DSN, help="a PostgreSQL server (its database is unused)")
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server", choices=("subprocess", "inprocess"), default="subprocess")
    parser.add_argument("--database", help="reuse this already seeded database instead of seeding a fresh one")
    parser.add_argument("--keep", action="store_true", help="keep the seeded database")
    arguments = parser.parse_args()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        asyncio.run(main(arguments))
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main(arguments))
