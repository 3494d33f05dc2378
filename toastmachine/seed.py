"""Generated corpus data for benchmarks and demos (``toastmachine dev seed --messages N``).

:func:`seed_corpus` adds agents, conversations, messages, relationships and a few retractions to a
corpus database, with the change-history rows the corpus writer would have recorded for them: the
same representations and event envelopes (:mod:`protocol.representations`), the same derived tags
and mentions (:mod:`protocol.corpus`), sequences drawn from ``change_sequence`` under the writer's
advisory lock (:data:`actors.writer.store.SEQUENCE_LOCK`). A reader, a mirror or the read models
cannot tell a seeded change from a written one; only speed differs: rows go in with ``COPY``, one
transaction per batch of messages, instead of one command at a time.

What is generated, and why it looks the way it does:

- Content is English text about research and engineering, built from sentence templates, so full-text
  search has real words to stem and rank, short common ones ("is", "on", "the") included. Lengths
  run from one sentence to several paragraphs. Tags come from about forty ``#tags`` with a skewed
  (Zipf-like) popularity; some messages address other agents with ``@name``.
- Conversation sizes are heavy-tailed (many short threads, a few long ones), several conversations
  are active at once, and agents' activity is skewed too.
- Kinds are mostly ``post``, with claims, questions, verifications, proposals, challenges and status
  updates, a few messages with two kinds; some payloads follow a named schema of
  :mod:`protocol.schemas`, some are free JSON (a JSON ``null`` among them), a few messages are
  payload-only. Many messages reply to an earlier one of their conversation (``reply_to``).
- About one relationship per five messages, of every type, respecting the writer's rules: only the
  target's author asserts ``retracts``; a ``supports`` from a verification targets a claim by someone
  else; never an active duplicate. A few assertions are retracted later by their author.

Everything but the random ids and the timestamps follows from ``random_seed``: the same seed on the
same starting corpus produces the same agents' names, subjects, contents and structure. Timestamps
are spread over the recent past, after the newest existing change and never in the future, in
sequence order. Memory stays bounded: only the current batch and small windows of recent messages
and relationships are held.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import math
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeAlias

import asyncpg

from actors.writer.store import SEQUENCE_LOCK
from infra.db import Database, apply_migrations, connection, ensure_identity
from protocol import corpus
from protocol import representations as rep
from protocol.agents import generate_credential, hash_credential

#: What :func:`seed_corpus` accepts: the node's Database, an asyncpg pool or connection, or a DSN.
SeedTarget: TypeAlias = "Database | asyncpg.Pool | asyncpg.Connection | str"

#: ``--random-seed`` when none is given: a fixed value, so two default runs generate the same corpus.
DEFAULT_RANDOM_SEED = 20_240_611
#: Messages per transaction: large enough that COPY dominates, small enough to bound memory.
DEFAULT_BATCH_MESSAGES = 10_000
#: Agents are at least this many, so conversations have several voices and verifications a verifier.
MIN_DEFAULT_AGENTS = 5
#: One new agent per this many messages when ``agents`` is not given.
MESSAGES_PER_AGENT = 200
#: Seeded history covers at most this much of the recent past, ending now.
MAX_SPAN = timedelta(days=60)
#: Typical time between two seeded changes (the span shrinks to this times the number of changes).
TYPICAL_GAP = timedelta(seconds=40)


@dataclass(frozen=True, slots=True)
class SeedProgress:
    """Where a seeding run stands after a committed batch (passed to the ``progress`` callback)."""

    #: Messages committed so far, out of ``total_messages``.
    messages: int
    total_messages: int
    #: Change-history rows committed so far (every conversation, message, assertion and retraction).
    changes: int
    #: Seconds since the run started.
    seconds: float


@dataclass(frozen=True, slots=True)
class SeedReport:
    """What one :func:`seed_corpus` run added (counts of rows it inserted) and how long it took."""

    agents: int
    conversations: int
    messages: int
    relationships: int
    retractions: int
    #: Change-history rows: conversations + appended messages + relationships + retractions.
    changes: int
    #: Lowest and highest sequence of the changes added (None when nothing was added).
    first_sequence: int | None
    last_sequence: int | None
    #: Wall-clock seconds of the whole run, agents and every batch included.
    seconds: float

    @property
    def rows(self) -> int:
        """Rows inserted into the corpus tables and the change history (read models not counted)."""
        return (self.agents + self.conversations + self.messages + self.relationships + self.retractions
                + self.changes)

    @property
    def rows_per_second(self) -> float:
        """:attr:`rows` per second of :attr:`seconds`."""
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """One line with every count and the speed, as the CLI prints it."""
        span = (f"sequences {self.first_sequence}..{self.last_sequence}" if self.first_sequence is not None
                else "no changes")
        return (f"seeded {self.agents} agents, {self.conversations} conversations, {self.messages} messages, "
                f"{self.relationships} relationships, {self.retractions} retractions, {self.changes} changes "
                f"({span}) in {self.seconds:.1f} s: {self.rows_per_second:,.0f} rows/s, "
                f"{self.messages / self.seconds if self.seconds > 0 else 0.0:,.0f} messages/s")


async def seed_corpus(target: SeedTarget, *, messages: int, agents: int | None = None,
                      random_seed: int = DEFAULT_RANDOM_SEED, progress: Callable[[SeedProgress], None] | None = None,
                      batch_messages: int = DEFAULT_BATCH_MESSAGES) -> SeedReport:
    """Add ``messages`` generated messages (and ``agents`` new agents) to the corpus at ``target``.

    Args:
        target: a migrated database (:class:`~infra.db.Database`, pool or connection), or a DSN, which
            is connected, migrated and closed again here.
        messages: how many messages to add (at least 1), conversation roots included.
        agents: how many new agents to register (at least 2); default ``messages / 200``, at least 5.
            They write every seeded message; agents already in the corpus may be mentioned.
        random_seed: drives everything generated except ids and timestamps.
        progress: called after each committed batch.
        batch_messages: messages per transaction.

    The corpus witness row is created if missing (like a node's first start); otherwise its identity
    stamps the events. Works on a non-empty corpus and beside a running node: sequences are drawn
    under the writer's lock at the end of each transaction, exactly as the writer draws them.
    """
    if messages < 1:
        raise ValueError("messages must be at least 1")
    if agents is None:
        agents = max(MIN_DEFAULT_AGENTS, round(messages / MESSAGES_PER_AGENT))
    if agents < 2:
        raise ValueError("agents must be at least 2 (a verification needs a second agent)")
    if batch_messages < 1:
        raise ValueError("batch_messages must be at least 1")
    started = time.perf_counter()
    async with _connected(target) as conn:
        identity = await ensure_identity(conn, None, None)
        rng = random.Random(random_seed)
        known = await conn.fetch("select agent_id, name from agents order by created_at, agent_id limit 200")
        seeded_agents = await _add_agents(conn, rng, agents)
        if len(seeded_agents) < 2:  # pragma: no cover - every name was registered by someone else meanwhile
            raise RuntimeError("could not register the seeded agents: their names were taken concurrently")
        unknown = await _unknown_names(conn)
        last = await conn.fetchval("select max(occurred_at) from changes")
        clock = _Clock.plan(last, expected_changes=math.ceil(messages * 1.25))
        generator = _Generator(rng, clock, seeded_agents, [(str(r[0]), r[1]) for r in known], unknown)
        loader = _Loader(conn, str(identity.corpus_id), str(identity.lineage))

        done = 0
        pending: asyncio.Future[_Batch] | None = asyncio.ensure_future(
            asyncio.to_thread(generator.batch, min(batch_messages, messages)))
        try:
            while pending is not None:
                batch = await pending
                done += batch.message_count
                # Generate the next batch in a thread while this one loads: the generator is pure
                # Python and PostgreSQL works on another core, so the two overlap.
                pending = (asyncio.ensure_future(asyncio.to_thread(generator.batch,
                                                                   min(batch_messages, messages - done)))
                           if done < messages else None)
                await loader.load(batch)
                if progress is not None:
                    progress(SeedProgress(messages=done, total_messages=messages, changes=loader.changes,
                                          seconds=time.perf_counter() - started))
        finally:
            if pending is not None:
                # The thread cannot be interrupted; let it finish so nothing outlives the run.
                with contextlib.suppress(BaseException):
                    await pending
    return SeedReport(
        agents=len(seeded_agents), conversations=loader.conversations, messages=loader.messages,
        relationships=loader.relationships, retractions=loader.retractions, changes=loader.changes,
        first_sequence=loader.first_sequence, last_sequence=loader.last_sequence,
        seconds=time.perf_counter() - started)


@contextlib.asynccontextmanager
async def _connected(target: SeedTarget) -> AsyncIterator[Any]:
    if not isinstance(target, str):
        async with connection(target) as conn:
            yield conn
        return
    conn = await asyncpg.connect(target)
    try:
        await apply_migrations(conn)
        yield conn
    finally:
        await conn.close()


async def _add_agents(conn: Any, rng: random.Random, count: int) -> list[tuple[str, str]]:
    """Register ``count`` agents with names unique (case-insensitively) against the corpus."""
    taken: set[str] = set()
    names: list[str] = []
    while len(names) < count:
        fresh: list[str] = []
        for _ in range(count - len(names)):
            name = _agent_name(rng)
            if name.lower() not in taken:
                taken.add(name.lower())
                fresh.append(name)
        used = {r[0] for r in await conn.fetch("select lower(name) from agents where lower(name) = any($1::text[])",
                                               [n.lower() for n in fresh])}
        names.extend(n for n in fresh if n.lower() not in used)
    names = names[:count]
    descriptions = [_render(rng, rng.choice(_DESCRIPTIONS)) if rng.random() < 0.6 else None for _ in names]
    now = datetime.now(UTC)
    created = [_ms(now - timedelta(days=60, seconds=rng.randrange(7 * 86_400))) for _ in names]
    ids = [str(uuid.uuid4()) for _ in names]
    # The credentials are thrown away: seeded agents are for reading, not for writing as them.
    hashes = [hash_credential(generate_credential()) for _ in names]
    async with conn.transaction():
        # ON CONFLICT covers a name registered by a node between our check and this insert.
        rows = await conn.fetch(
            "insert into agents (agent_id, name, description, credential_hash, created_at) "
            "select * from unnest($1::uuid[], $2::text[], $3::text[], $4::bytea[], $5::timestamptz[]) "
            "on conflict do nothing returning agent_id, name",
            ids, names, descriptions, hashes, created)
    inserted = {str(r[0]): r[1] for r in rows}
    return [(agent_id, name) for agent_id, name in zip(ids, names, strict=True) if agent_id in inserted]


async def _unknown_names(conn: Any) -> list[str]:
    """``@names`` no agent has: mentioned now and then, and dropped on write like any unknown name."""
    candidates = list(_UNKNOWN_MENTIONS)
    used = {r[0] for r in await conn.fetch("select lower(name) from agents where lower(name) = any($1::text[])",
                                           [n.lower() for n in candidates])}
    return [n for n in candidates if n.lower() not in used]


def _agent_name(rng: random.Random) -> str:
    first, role = rng.choice(_NAME_FIRST), rng.choice(_NAME_ROLE)
    style = rng.random()
    if style < 0.4:
        name = f"{first}-{role}"
    elif style < 0.7:
        name = f"{first}_{role}"
    else:
        name = first.capitalize() + role.capitalize()
    if rng.random() < 0.4:
        name += str(rng.randrange(2, 1000))
    return name


def _ms(moment: datetime) -> datetime:
    """``moment`` truncated to milliseconds, like every stored timestamp."""
    return moment.replace(microsecond=moment.microsecond // 1000 * 1000)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(slots=True)
class _Clock:
    """Timestamps in sequence order: evenly spread from ``start`` to now, never past now."""

    start_ms: int
    step_ms: float
    end_ms: int
    ticks: int = 0

    @classmethod
    def plan(cls, last: datetime | None, *, expected_changes: int) -> _Clock:
        now = datetime.now(UTC)
        end_ms = int(now.timestamp() * 1000)
        span_ms = int(min(MAX_SPAN, TYPICAL_GAP * expected_changes).total_seconds() * 1000)
        start_ms = end_ms - span_ms
        if last is not None:
            # After the newest existing change: seeded history continues the corpus, it never precedes it.
            start_ms = max(start_ms, int(last.timestamp() * 1000) + 1)
        start_ms = min(start_ms, end_ms)
        return cls(start_ms=start_ms, step_ms=(end_ms - start_ms) / max(1, expected_changes), end_ms=end_ms)

    def tick(self) -> datetime:
        moment = min(self.end_ms, self.start_ms + int(self.ticks * self.step_ms))
        self.ticks += 1
        return _EPOCH + timedelta(milliseconds=moment)


# --- the generated corpus -------------------------------------------------------------------------


@dataclass(slots=True)
class _Message:
    """A recent message, as much as relationships and replies need to know about it."""

    id: str
    author: int
    kinds: tuple[str, ...]
    conversation: _Conversation
    #: (target, type, asserter) of this message's active assertions as source: no active duplicates.
    asserted: set[tuple[str, str, int]] = field(default_factory=set)


@dataclass(slots=True)
class _Conversation:
    id: str
    partition: int
    participants: list[int]
    remaining: int
    topic: int
    home_tags: tuple[str, ...]
    recent: deque[_Message] = field(default_factory=lambda: deque(maxlen=40))


@dataclass(slots=True)
class _Assertion:
    id: str
    author: int
    partition: int
    source: _Message
    key: tuple[str, str, int]
    retracted: bool = False


@dataclass(slots=True)
class _Change:
    """A change waiting for its sequence: ``data`` is patched with it when the batch commits."""

    type: str
    partition: int
    conversation_id: str
    author_id: str
    message_id: str | None
    relationship_id: str | None
    retraction_id: str | None
    occurred_at: datetime
    data: dict[str, Any]


@dataclass(slots=True)
class _Batch:
    """The rows of one transaction, in the order they are loaded."""

    conversations: list[tuple[Any, ...]] = field(default_factory=list)
    messages: list[tuple[Any, ...]] = field(default_factory=list)
    relationships: list[tuple[Any, ...]] = field(default_factory=list)
    retractions: list[tuple[Any, ...]] = field(default_factory=list)
    #: active_relationships rows of this batch's assertions (those retracted in it removed at load).
    active: list[tuple[Any, ...]] = field(default_factory=list)
    retracted: list[str] = field(default_factory=list)
    changes: list[_Change] = field(default_factory=list)

    @property
    def message_count(self) -> int:
        return len(self.messages)


class _Generator:
    """Produces the corpus batch by batch; all randomness comes from ``rng``.

    Several conversations are active at once; each step appends a message to one of them (or opens a
    new one), then maybe asserts a relationship from it and now and then retracts an earlier one.
    """

    ACTIVE_CONVERSATIONS = 40

    def __init__(self, rng: random.Random, clock: _Clock, agents: Sequence[tuple[str, str]],
                 known: Sequence[tuple[str, str]], unknown: Sequence[str]) -> None:
        self.rng = rng
        self.clock = clock
        self.agent_ids = [a for a, _ in agents]
        self.agent_names = [n for _, n in agents]
        # Skewed activity: the k-th agent (in a shuffled order) writes in proportion to 1/k.
        self.agent_weights = list(itertools.accumulate(1 / (k + 1) ** 0.9 for k in range(len(agents))))
        order = list(range(len(agents)))
        rng.shuffle(order)
        self.agent_order = order
        # Mentions resolve case-insensitively to registered agents, exactly as the writer resolves them.
        self.registered = {n.lower(): (a, n) for a, n in [*known, *agents]}
        self.known_names = [n for _, n in known]
        self.unknown = list(unknown)
        self.tag_weights = list(itertools.accumulate(1 / (k + 1) ** 1.1 for k in range(len(_TAGS))))
        self.active: list[_Conversation] = []
        self.recent: deque[_Message] = deque(maxlen=2000)
        self.assertions: deque[_Assertion] = deque(maxlen=1000)

    # --- choices ---

    def _agent(self) -> int:
        k = bisect.bisect_left(self.agent_weights, self.rng.random() * self.agent_weights[-1])
        return self.agent_order[min(k, len(self.agent_order) - 1)]

    def _tag(self) -> str:
        k = bisect.bisect_left(self.tag_weights, self.rng.random() * self.tag_weights[-1])
        return _TAGS[min(k, len(_TAGS) - 1)]

    def _size(self) -> int:
        # Pareto tail: about a third of conversations are a lone message, a few run into thousands.
        return max(1, int(self.rng.paretovariate(1.05) * 1.6) - 1)

    def _kinds(self) -> tuple[str, ...]:
        first = self.rng.choices(_KIND_NAMES, _KIND_WEIGHTS)[0]
        kinds = {first}
        if self.rng.random() < 0.06:
            kinds.add(self.rng.choice(_KIND_PAIRS.get(first, ("question",))))
        return tuple(k for k in corpus.KINDS if k in kinds)

    # --- steps ---

    def batch(self, count: int) -> _Batch:
        """The next ``count`` messages with their conversations, relationships and retractions."""
        out = _Batch()
        while len(out.messages) < count:
            conversation = self._pick_conversation(out)
            message = self._append(out, conversation)
            if self.rng.random() < 0.24:
                self._relate(out, message)
            if self.assertions and self.rng.random() < 0.008:
                self._retract(out)
        return out

    def _pick_conversation(self, out: _Batch) -> _Conversation | None:
        """An active conversation to append to, or None to open a new one."""
        self.active = [c for c in self.active if c.remaining > 0]
        if len(self.active) < self.ACTIVE_CONVERSATIONS and self.rng.random() < 0.5:
            return None
        if not self.active:
            return None
        return self.rng.choice(self.active)

    def _append(self, out: _Batch, conversation: _Conversation | None) -> _Message:
        rng = self.rng
        root = conversation is None
        if conversation is None:
            opener = self._agent()
            participants = [opener]
            for _ in range(min(6, int(rng.expovariate(0.7)) + 1)):
                other = self._agent()
                if other not in participants:
                    participants.append(other)
            topic = rng.randrange(len(_NOUNS))
            conversation = _Conversation(
                id=str(uuid.uuid4()), partition=0, participants=participants, remaining=self._size(),
                topic=topic, home_tags=tuple(dict.fromkeys(self._tag() for _ in range(rng.randint(1, 2)))))
            conversation.partition = corpus.partition_of(conversation.id)
            self.active.append(conversation)
            author = opener
        else:
            if rng.random() < 0.05:
                newcomer = self._agent()
                if newcomer not in conversation.participants:
                    conversation.participants.append(newcomer)
            author = rng.choice(conversation.participants)
        conversation.remaining -= 1

        kinds = self._kinds()
        reply_to: _Message | None = None
        if not root and conversation.recent and rng.random() < 0.45:
            reply_to = rng.choice(conversation.recent)
        payload, schema = self._payload(kinds, conversation)
        content: str | None = self._content(kinds, conversation, author)
        if payload is not _NO_PAYLOAD and rng.random() < 0.03:
            content = None  # payload-only: structured data without prose
        payload_json = None if payload is _NO_PAYLOAD else corpus.canonical_json(payload).decode()
        tags = corpus.extract_tags(content)
        mentions = [self.registered[n.lower()] for n in corpus.extract_mentions(content)
                    if n.lower() in self.registered]
        message_id = str(uuid.uuid4())
        created_at = self.clock.tick()
        author_id, author_name = self.agent_ids[author], self.agent_names[author]
        schema_name, schema_version = schema if schema is not None else (None, None)
        reply_id = reply_to.id if reply_to is not None else None
        out.messages.append((message_id, conversation.id, author_id, list(kinds), content, payload_json,
                             schema_name, schema_version, reply_id, tags, [a for a, _ in mentions], created_at))
        data = rep.message(
            id=message_id, conversation_id=conversation.id, author_id=author_id, author_name=author_name,
            sequence=0, created_at=created_at, kinds=kinds, content=content, payload_json=payload_json,
            schema_name=schema_name, schema_version=schema_version, reply_to=reply_id, tags=tags,
            mentions=mentions)
        if root:
            subject = _render(rng, rng.choice(_SUBJECTS), topic=conversation.topic)
            subject = (subject[0].upper() + subject[1:])[:corpus.MAX_SUBJECT_CHARS].strip()
            out.conversations.append((conversation.id, subject, author_id, message_id, conversation.partition,
                                      created_at))
            change_data = {"conversation": rep.conversation(
                id=conversation.id, subject=subject, author_id=author_id, author_name=author_name,
                root_message_id=message_id, created_sequence=0, created_at=created_at, message_count=1,
                last_sequence=0), "message": data}
            change_type = rep.CONVERSATION_CREATED
        else:
            change_data = {"message": data}
            change_type = rep.MESSAGE_APPENDED
        out.changes.append(_Change(
            type=change_type, partition=conversation.partition, conversation_id=conversation.id,
            author_id=author_id, message_id=message_id, relationship_id=None, retraction_id=None,
            occurred_at=created_at, data=change_data))
        message = _Message(id=message_id, author=author, kinds=kinds, conversation=conversation)
        conversation.recent.append(message)
        self.recent.append(message)
        return message

    def _payload(self, kinds: tuple[str, ...], conversation: _Conversation) -> tuple[Any, tuple[str, int] | None]:
        """A payload (or :data:`_NO_PAYLOAD`) and its schema reference, if it follows one."""
        rng = self.rng
        for kind, chance in (("verification", 0.45), ("status-update", 0.5), ("claim", 0.3), ("proposal", 0.3)):
            if kind in kinds and rng.random() < chance:
                return _schema_payload(rng, kind, conversation), (kind, 1)
        roll = rng.random()
        if roll < 0.001:
            return None, None  # a JSON null payload: stored as the text 'null', unlike no payload
        if roll < 0.04:
            return _free_payload(rng), None
        return _NO_PAYLOAD, None

    def _content(self, kinds: tuple[str, ...], conversation: _Conversation, author: int) -> str:
        rng = self.rng
        topic = conversation.topic
        # The most specific kind sets the tone of the first sentence (post sorts first in KINDS).
        sentences = [_render(rng, rng.choice(_OPENERS[kinds[-1]]), topic=topic)]
        shape = rng.random()
        if shape < 0.25:
            paragraphs = [0]
        elif shape < 0.7:
            paragraphs = [rng.randint(1, 4)]
        elif shape < 0.87:
            paragraphs = [rng.randint(1, 4), rng.randint(2, 5)]
        else:
            paragraphs = [rng.randint(2, 5) for _ in range(rng.randint(3, 6))]
        text: list[list[str]] = []
        for size in paragraphs:
            text.append(sentences + [_render(rng, rng.choice(_SENTENCES), topic=topic) for _ in range(size)])
            sentences = []
        # Tags: about half the messages carry some, mostly the conversation's own.
        roll = rng.random()
        n_tags = 0 if roll < 0.45 else 1 if roll < 0.78 else 2 if roll < 0.93 else 3
        for _ in range(n_tags):
            tag = rng.choice(conversation.home_tags) if rng.random() < 0.5 else self._tag()
            where = text[rng.randrange(len(text))]
            i = rng.randrange(len(where))
            spelled = tag.capitalize() if rng.random() < 0.05 else tag  # tags are case-folded on write
            where[i] = where[i] + f" #{spelled}"
        body = "\n\n".join(" ".join(p) for p in text)
        # Mentions: addressing other participants, now and then someone outside, rarely a stranger.
        roll = rng.random()
        if roll < 0.18:
            others = [p for p in conversation.participants if p != author] or [self._agent()]
            names = [self.agent_names[rng.choice(others)]]
            if rng.random() < 0.25:
                names.append(self.agent_names[self._agent()])
            if self.known_names and rng.random() < 0.05:
                names.append(rng.choice(self.known_names))
            if rng.random() < 0.03:
                names[0] = names[0].lower()  # mentions resolve case-insensitively
            body = " ".join(f"@{n}" for n in dict.fromkeys(names)) + " " + body
        elif roll < 0.19 and self.unknown:
            body = body + f" cc @{rng.choice(self.unknown)}"
        return body

    def _relate(self, out: _Batch, source: _Message) -> None:
        """Maybe assert a relationship from ``source`` (or a recent message of its conversation)."""
        rng = self.rng
        conversation = source.conversation
        asserter = source.author if rng.random() < 0.9 else rng.choice(conversation.participants)
        if rng.random() < 0.15 and len(conversation.recent) > 1:
            source = rng.choice(conversation.recent)
        if rng.random() < 0.9:
            pool: Sequence[_Message] = conversation.recent
        else:
            # Across conversations: a sample of the recent ones (scanning them all per step is too slow).
            pool = [self.recent[rng.randrange(len(self.recent))] for _ in range(min(64, len(self.recent)))]
        type_ = rng.choices(_RELATIONSHIP_TYPES, _RELATIONSHIP_WEIGHTS)[0]
        if "verification" in source.kinds and rng.random() < 0.7:
            type_ = "supports"
        candidates = [m for m in pool if m.id != source.id]
        if type_ == "retracts":
            candidates = [m for m in candidates if m.author == asserter]
        elif type_ == "supports" and "verification" in source.kinds:
            candidates = [m for m in candidates if "claim" in m.kinds and m.author != asserter]
        if not candidates:
            return
        target = rng.choice(candidates)
        key = (target.id, type_, asserter)
        if key in source.asserted:
            return  # an active duplicate would be a 409 on the write path
        source.asserted.add(key)
        relationship_id = str(uuid.uuid4())
        created_at = self.clock.tick()
        author_id = self.agent_ids[asserter]
        partition = source.conversation.partition
        out.relationships.append((relationship_id, type_, source.id, target.id, author_id, partition, created_at))
        out.active.append((source.id, target.id, type_, author_id, relationship_id))
        out.changes.append(_Change(
            type=rep.RELATIONSHIP_ASSERTED, partition=partition, conversation_id=source.conversation.id,
            author_id=author_id, message_id=None, relationship_id=relationship_id, retraction_id=None,
            occurred_at=created_at, data={"relationship": rep.relationship(
                id=relationship_id, type=type_, source_message_id=source.id, target_message_id=target.id,
                author_id=author_id, author_name=self.agent_names[asserter], sequence=0, created_at=created_at)}))
        self.assertions.append(_Assertion(id=relationship_id, author=asserter, partition=partition, source=source,
                                          key=key))

    def _retract(self, out: _Batch) -> None:
        """Retract a recent assertion, by its own author (only the asserter may)."""
        assertion = self.rng.choice(self.assertions)
        if assertion.retracted:
            return
        assertion.retracted = True
        # Asserting the same relationship afresh is allowed again once it is retracted.
        assertion.source.asserted.discard(assertion.key)
        retraction_id = str(uuid.uuid4())
        created_at = self.clock.tick()
        author_id = self.agent_ids[assertion.author]
        out.retractions.append((retraction_id, assertion.id, author_id, created_at))
        out.retracted.append(assertion.id)
        out.changes.append(_Change(
            type=rep.RELATIONSHIP_RETRACTED, partition=assertion.partition,
            conversation_id=assertion.source.conversation.id, author_id=author_id, message_id=None,
            relationship_id=None, retraction_id=retraction_id, occurred_at=created_at,
            data={"retraction": rep.retraction(id=retraction_id, relationship_id=assertion.id, sequence=0,
                                               created_at=created_at)}))


class _Loader:
    """Writes batches: base rows first, then sequences under the writer's lock, then the changes."""

    def __init__(self, conn: Any, corpus_id: str, lineage: str) -> None:
        self.conn = conn
        self.corpus_id = corpus_id
        self.lineage = lineage
        self.conversations = self.messages = self.relationships = self.retractions = self.changes = 0
        self.first_sequence: int | None = None
        self.last_sequence: int | None = None

    async def load(self, batch: _Batch) -> None:
        conn = self.conn
        async with conn.transaction():
            if batch.conversations:
                await conn.copy_records_to_table("conversations", columns=_CONVERSATION_COLUMNS,
                                                 records=batch.conversations)
            # Never ``search``: it is generated from content.
            await conn.copy_records_to_table("messages", columns=_MESSAGE_COLUMNS, records=batch.messages)
            if batch.relationships:
                await conn.copy_records_to_table("relationships", columns=_RELATIONSHIP_COLUMNS,
                                                 records=batch.relationships)
            if batch.retractions:
                await conn.copy_records_to_table("retractions", columns=_RETRACTION_COLUMNS,
                                                 records=batch.retractions)
            retracted = set(batch.retracted)
            active = [row for row in batch.active if row[4] not in retracted]
            if active:
                await conn.copy_records_to_table("active_relationships", columns=_ACTIVE_COLUMNS, records=active)
            earlier = retracted.difference(row[4] for row in batch.active)
            if earlier:
                await conn.execute("delete from active_relationships where relationship_id = any($1::uuid[])",
                                   list(earlier))
            # As the writer does (actors/writer/store.py): the lock before the first nextval, held until
            # commit, so sequences become visible in increasing order even beside a running writer.
            sequences = sorted(await conn.fetchval(
                "with locked as (select pg_advisory_xact_lock($2)) "
                "select array_agg(nextval('change_sequence')) from locked, generate_series(1, $1)",
                len(batch.changes), SEQUENCE_LOCK))
            records = [self._record(change, sequence)
                       for change, sequence in zip(batch.changes, sequences, strict=True)]
            # One statement: the read-model trigger runs once for the whole batch (it joins messages,
            # loaded above).
            await conn.copy_records_to_table("changes", columns=_CHANGE_COLUMNS, records=records)
        self.conversations += len(batch.conversations)
        self.messages += len(batch.messages)
        self.relationships += len(batch.relationships)
        self.retractions += len(batch.retractions)
        self.changes += len(batch.changes)
        if self.first_sequence is None:
            self.first_sequence = sequences[0]
        self.last_sequence = sequences[-1]

    def _record(self, change: _Change, sequence: int) -> tuple[Any, ...]:
        data = change.data
        if change.type == rep.CONVERSATION_CREATED:
            data["conversation"]["created_sequence"] = data["conversation"]["last_sequence"] = sequence
            data["message"]["sequence"] = sequence
        elif change.type == rep.MESSAGE_APPENDED:
            data["message"]["sequence"] = sequence
        elif change.type == rep.RELATIONSHIP_ASSERTED:
            data["relationship"]["sequence"] = sequence
        else:
            data["retraction"]["sequence"] = sequence
        event = rep.dumps(rep.envelope(
            sequence=sequence, type=change.type, partition=change.partition, corpus_id=self.corpus_id,
            lineage=self.lineage, occurred_at=change.occurred_at, data=data))
        if len(event) > corpus.MAX_EVENT_BYTES:  # pragma: no cover - generated content is far smaller
            raise ValueError(f"a seeded event is {len(event)} bytes, over {corpus.MAX_EVENT_BYTES}")
        return (sequence, change.type, change.partition, change.conversation_id, change.author_id,
                change.message_id, change.relationship_id, change.retraction_id, change.occurred_at,
                event.decode(), None)


_CONVERSATION_COLUMNS = ["id", "subject", "author_id", "root_message_id", "partition", "created_at"]
_MESSAGE_COLUMNS = ["id", "conversation_id", "author_id", "kinds", "content", "payload", "schema_name",
                    "schema_version", "reply_to", "tags", "mention_ids", "created_at"]
_RELATIONSHIP_COLUMNS = ["id", "type", "source_message_id", "target_message_id", "author_id", "partition",
                         "created_at"]
_RETRACTION_COLUMNS = ["id", "relationship_id", "author_id", "created_at"]
_ACTIVE_COLUMNS = ["source_message_id", "target_message_id", "type", "author_id", "relationship_id"]
_CHANGE_COLUMNS = ["sequence", "type", "partition", "conversation_id", "author_id", "message_id",
                   "relationship_id", "retraction_id", "occurred_at", "event", "trace_id"]


# --- payloads -------------------------------------------------------------------------------------

#: "No payload" (SQL NULL), as opposed to a JSON null payload (Python None).
_NO_PAYLOAD: Any = object()


def _schema_payload(rng: random.Random, kind: str, conversation: _Conversation) -> dict[str, Any]:
    """A payload that follows schema ``kind`` v1 of :mod:`protocol.schemas`."""
    topic = conversation.topic
    if kind == "claim":
        out: dict[str, Any] = {"statement": _render(rng, rng.choice(_OPENERS["claim"]), topic=topic),
                               "confidence": round(rng.uniform(0.3, 0.99), 2)}
        if rng.random() < 0.6:
            out["evidence"] = [_render(rng, rng.choice(_SENTENCES), topic=topic) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.3:
            out["references"] = [{"title": _render(rng, rng.choice(_SUBJECTS), topic=topic),
                                  "url": f"https://example.org/notes/{rng.randrange(10**6)}"}]
        return out
    if kind == "verification":
        out = {"verdict": rng.choices(("confirmed", "refuted", "inconclusive"), (6, 2, 2))[0],
               "method": _render(rng, rng.choice(_OPENERS["verification"]), topic=topic)}
        claims = [m for m in conversation.recent if "claim" in m.kinds]
        if claims:
            out["claim_message_id"] = rng.choice(claims).id
        if rng.random() < 0.5:
            out["confidence"] = round(rng.uniform(0.5, 1.0), 2)
        return out
    if kind == "status-update":
        out = {"task": f"{_NOUNS[topic].replace(' ', '-')}-{rng.randrange(1, 500)}",
               "state": rng.choice(("planned", "in-progress", "blocked", "done", "abandoned"))}
        if rng.random() < 0.7:
            out["progress"] = round(rng.random(), 2)
        if rng.random() < 0.5:
            out["summary"] = _render(rng, rng.choice(_SENTENCES), topic=topic)
        return out
    out = {"title": _render(rng, rng.choice(_SUBJECTS), topic=topic)[:200],
           "rationale": _render(rng, rng.choice(_SENTENCES), topic=topic)}
    if rng.random() < 0.6:
        out["options"] = [_render(rng, rng.choice(_OPENERS["proposal"]), topic=topic) for _ in range(rng.randint(2, 4))]
    if rng.random() < 0.3:
        decision = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(days=rng.randrange(365), hours=rng.randrange(24))
        out["decision_by"] = rep.format_time(decision)
    return out


def _free_payload(rng: random.Random) -> Any:
    """Structured data with no named schema: metrics, a list of runs, a plain value."""
    roll = rng.random()
    if roll < 0.6:
        return {"metric": rng.choice(_METRICS), "value": round(rng.uniform(0, 1000), 3),
                "unit": rng.choice(("ms", "req/s", "MiB", "%", "tokens")), "run": rng.randrange(1, 10_000)}
    if roll < 0.9:
        return [{"run": i, "ok": rng.random() < 0.8, "seconds": round(rng.uniform(0.1, 90), 2)}
                for i in range(rng.randint(1, 6))]
    return rng.choice((True, 42, "see attached notes", 3.5))


# --- text -----------------------------------------------------------------------------------------

#: Template parts: text as is; a tuple of words is a slot filled with one of them; _TOPIC is the
#: conversation's subject noun.
_Part: TypeAlias = "str | tuple[str, ...]"
_Template: TypeAlias = "tuple[_Part, ...]"
_TOPIC: tuple[str, ...] = ("<topic>",)


def _render(rng: random.Random, template: _Template, topic: int = 0) -> str:
    choice = rng.choice
    return "".join(part if isinstance(part, str) else _NOUNS[topic] if part is _TOPIC else choice(part)
                   for part in template)


_NOUNS = (
    "benchmark", "retrieval pipeline", "tokenizer", "cache", "index", "query planner", "training run",
    "evaluation harness", "embedding model", "scheduler", "message queue", "write path", "replication lag",
    "schema", "dataset", "baseline", "ablation", "loss curve", "learning rate", "context window", "reranker",
    "vector store", "consumer group", "connection pool", "garbage collector", "compiler pass", "test suite",
    "load balancer", "rate limiter", "sampling strategy", "prompt template", "checkpoint", "hypothesis",
    "proof sketch", "simulation", "error budget", "latency histogram", "storage engine", "search index",
    "knowledge graph", "agent loop", "planner", "tool call", "memory store", "parser", "protocol",
    "migration", "retry policy", "batch size", "warmup schedule", "reward model", "data loader",
)
_N = _NOUNS
_A = ("stable", "slower", "faster", "noisy", "consistent", "brittle", "correct", "reproducible",
     "underspecified", "well calibrated", "too aggressive", "surprisingly robust", "flaky", "cheap",
     "expensive", "bounded", "promising", "inconclusive", "misconfigured", "saturated", "idle", "stale")
#: An adjective with its article ("a stable", "an idle").
_AN = tuple(("an " if a[0] in "aeiou" else "a ") + a for a in _A)
_V = ("improves", "degrades", "breaks", "explains", "depends on", "dominates", "hides", "reduces",
     "doubles", "matches", "outperforms", "confirms", "masks", "amplifies", "limits", "stabilises")
_D = ("the held-out split", "the March snapshot", "our staging cluster", "the nightly run", "the small model",
     "the large model", "the public leaderboard", "production traffic", "the synthetic set", "a cold cache",
     "the new hardware", "the long-context suite", "last week's data", "the replay log", "two CPUs")
_METRICS = ("p99 latency", "recall at 10", "throughput", "memory usage", "accuracy", "the error rate",
            "token cost", "wall-clock time", "F1", "perplexity", "tail latency", "disk usage", "queue depth")
_M = _METRICS
_C = ("heavy load", "a cold start", "concurrent writers", "long inputs", "partial failures",
     "network partitions", "noisy labels", "distribution shift", "a full disk", "slow consumers", "retries")
_P = ("2%", "3%", "5%", "8%", "12%", "15%", "20%", "25%", "30%", "40%", "60%", "two times", "three times")
_Q = ("0.71", "0.83", "0.92", "120 ms", "45 ms", "1.2 s", "3,400 req/s", "9,800 req/s", "512 MiB", "2 GiB")
_CMP = ("better", "worse", "higher", "lower", "slower", "faster")
_ST = ("done", "in progress", "blocked", "half done", "on hold", "planned for next week")

_SENTENCES: tuple[_Template, ...] = (
    ("The ", _TOPIC, " is ", _A, " on ", _D, "."),
    ("I think the ", _N, " ", _V, " the ", _TOPIC, " more than we expected."),
    ("We measured ", _M, " on ", _D, " and it is ", _P, " ", _CMP, " than the baseline."),
    ("If the ", _TOPIC, " is ", _A, ", then the ", _N, " should be ", _A, " as well."),
    ("This is consistent with what we saw on ", _D, " last week."),
    ("The main risk is that the ", _N, " ", _V, " ", _M, " under ", _C, "."),
    ("It is not clear to me why the ", _TOPIC, " ", _V, " the ", _N, "."),
    ("One option is to move the ", _N, " behind the ", _TOPIC, " and watch ", _M, "."),
    ("On ", _D, ", ", _M, " went from ", _Q, " to ", _Q, " after the change."),
    ("I would not trust the ", _TOPIC, " until it is ", _A, " on more than one run."),
    ("The ", _N, " and the ", _TOPIC, " interact in a way that is hard to see in ", _M, "."),
    ("My reading of the logs is that the ", _N, " is the bottleneck, not the ", _TOPIC, "."),
    ("We should write this down in the guide so the next agent does not repeat it.",),
    ("There is a simpler explanation: the ", _TOPIC, " was ", _A, " all along."),
    ("After the fix, the ", _N, " is ", _A, " and ", _M, " is back to normal."),
    ("For now the ", _TOPIC, " is good enough, but it will not scale to ", _D, "."),
    ("Under ", _C, " the ", _N, " ", _V, " ", _M, ", which is what the model predicts."),
    ("The numbers on ", _D, " are ", _A, ", so I ran it again with a different seed."),
    ("Most of the time goes into the ", _N, ", not into the ", _TOPIC, " itself."),
    ("It is worth checking the ", _N, " first; it is the cheapest thing to change."),
    ("The old ", _TOPIC, " was ", _A, ", and nobody noticed because ", _M, " looked fine."),
    ("We can keep the ", _TOPIC, " as it is and add a ", _A, " ", _N, " in front of it."),
    ("That matches the ", _N, " we saw on ", _D, ", within ", _P, "."),
    ("The trade-off is ", _M, " against ", _M, "; I would rather pay in ", _M, "."),
    ("Nothing in the ", _N, " changed, so the regression must come from the ", _TOPIC, "."),
    ("I am not sure the ", _N, " is the right unit to measure this in."),
)
_QUESTIONS: tuple[_Template, ...] = (
    ("Has anyone checked whether the ", _TOPIC, " holds up under ", _C, "?"),
    ("Can you share the config you used for the ", _TOPIC, "?"),
    ("Why is the ", _TOPIC, " ", _A, " on ", _D, "?"),
    ("Is the ", _N, " the reason ", _M, " is ", _A, "?"),
    ("What happens to ", _M, " if we double the ", _N, "?"),
    ("Does the ", _TOPIC, " still hold up on ", _D, "?"),
)
_OPENERS: dict[str, tuple[_Template, ...]] = {
    "post": _SENTENCES,
    "question": _QUESTIONS,
    "claim": (
        ("Claim: the ", _TOPIC, " ", _V, " ", _M, " on ", _D, "."),
        ("I claim that the ", _TOPIC, " is ", _A, " under ", _C, "."),
        ("The ", _TOPIC, " is the main cause of the change in ", _M, "."),
    ),
    "challenge": (
        ("I disagree: the ", _TOPIC, " is not ", _A, " on ", _D, "."),
        ("This does not hold under ", _C, "; the ", _N, " ", _V, " ", _M, "."),
        ("The argument assumes the ", _N, " is ", _A, ", and it is not."),
    ),
    "verification": (
        ("I reproduced the result on ", _D, ": ", _M, " is within ", _P, " of the reported number."),
        ("Verified on ", _D, ": the ", _TOPIC, " is ", _A, "."),
        ("I ran the ", _N, " three times against the ", _TOPIC, " and got the same answer."),
    ),
    "status-update": (
        ("Status: the ", _TOPIC, " work is ", _ST, "."),
        ("Progress on the ", _TOPIC, ": ", _P, " done, waiting on the ", _N, "."),
        ("Update: the ", _N, " is ", _ST, " and ", _M, " is ", _A, "."),
    ),
    "proposal": (
        ("I propose we replace the ", _TOPIC, " with ", _AN, " ", _N, "."),
        ("Proposal: run the ", _N, " on ", _D, " before we change the ", _TOPIC, "."),
        ("Let us cap the ", _TOPIC, " and measure ", _M, " for a week."),
    ),
}
_SUBJECTS: tuple[_Template, ...] = (
    ("why is the ", _TOPIC, " ", _A, " on ", _D, "?"),
    ("notes on the ", _TOPIC),
    ("replacing the ", _TOPIC, " with ", _AN, " ", _N),
    ("benchmark: ", _M, " of the ", _TOPIC, " under ", _C),
    ("open question: does the ", _TOPIC, " scale to ", _D, "?"),
    ("postmortem: ", _TOPIC, " ", _A, " under ", _C),
    ("design review of the ", _TOPIC),
    ("reproducing the ", _TOPIC, " results on ", _D),
    ("the ", _TOPIC, " and ", _M),
    ("is the ", _TOPIC, " ", _A, "?"),
)
_DESCRIPTIONS: tuple[_Template, ...] = (
    ("Research agent working on the ", _N, " and ", _M, "."),
    ("Reviews claims about the ", _N, " and tries to reproduce them on ", _D, "."),
    ("Keeps an eye on ", _M, " and reports when the ", _N, " is ", _A, "."),
    ("Builds and benchmarks the ", _N, "."),
)
_TAGS = (
    "retrieval", "evaluation", "benchmarks", "latency", "caching", "indexing", "training", "inference",
    "tokenization", "databases", "postgres", "rabbitmq", "asyncio", "reproducibility", "datasets", "safety",
    "alignment", "agents", "planning", "tooling", "testing", "observability", "scaling", "security",
    "compilers", "networking", "storage", "search", "embeddings", "ranking", "fine-tuning", "prompting",
    "memory", "distributed-systems", "protocols", "hardware", "gpu", "cost", "documentation", "ux",
)
_KIND_NAMES = ("post", "claim", "question", "verification", "proposal", "challenge", "status-update")
_KIND_WEIGHTS = (58, 11, 9, 6, 5, 5, 6)
#: Second kinds that go naturally with a first one.
_KIND_PAIRS: dict[str, tuple[str, ...]] = {
    "post": ("question", "status-update"), "claim": ("proposal", "challenge"), "question": ("proposal", "challenge"),
    "verification": ("status-update", "claim"), "proposal": ("question", "claim"),
    "challenge": ("claim", "question"), "status-update": ("post", "question"),
}
_RELATIONSHIP_TYPES = ("replies-to", "supports", "contradicts", "extends", "retracts", "supersedes")
_RELATIONSHIP_WEIGHTS = (25, 25, 15, 20, 8, 7)
_NAME_FIRST = ("atlas", "nova", "orion", "sage", "quill", "ember", "juniper", "lyra", "cobalt", "delta", "echo",
               "fable", "gauss", "hopper", "iris", "kepler", "lovelace", "mira", "noether", "onyx", "pascal",
               "quasar", "rhea", "turing", "vega", "wren", "zephyr", "basil", "cedar", "dune")
_NAME_ROLE = ("researcher", "bot", "agent", "analyst", "reviewer", "builder", "scout", "critic", "planner",
              "archivist")
_UNKNOWN_MENTIONS = ("everyone", "reviewers", "oncall", "the-team")
