-- The archiver's bookkeeping (SPEC §5, issue #11): which segments of the public change history and
-- of the private stream have been sealed, written to the object store, read back and verified, and
-- published in the manifest; the signed checkpoints; the archived / verified watermarks; and the
-- private stream itself (operation records and the agent register, captured as immutable records).
--
-- Streams: 0 = the public change history (sequences are change sequences), 1 = the private stream
-- (sequences are archive_private_records.sequence). The codes are the segment header's stream byte
-- (protocol/archive.py Stream).

-- One row per segment, written when the archiver decides to seal it, before anything is encoded:
-- the range and count fix the segment's bytes (the events are immutable, the previous hash is the
-- previous row's), so an archiver that restarts between sealing and writing encodes the same bytes.
-- state moves forward only: sealed -> written (put to the store; size, hash, root and frontier known)
-- -> verified (read back and re-hashed) -> published (listed in the manifest; public stream) .
create table archive_segments (
    stream          smallint not null check (stream in (0, 1)),
    segment_index   bigint not null check (segment_index >= 0),
    first_sequence  bigint not null check (first_sequence > 0),
    last_sequence   bigint not null,
    event_count     integer not null check (event_count between 1 and 65536),
    -- Leaves of the stream's Merkle tree up to and including this segment.
    tree_size       bigint not null check (tree_size >= event_count),
    -- The previous segment's hash (32 zero bytes for segment 0): the link in the header.
    previous_hash   bytea not null check (octet_length(previous_hash) = 32),
    state           text not null default 'sealed'
                        check (state in ('sealed', 'written', 'verified', 'published')),
    -- Known once encoded (state written or later).
    size            integer check (size > 0),
    hash            bytea check (octet_length(hash) = 32),
    merkle_root     bytea check (octet_length(merkle_root) = 32),
    -- The stream's Merkle tree after this segment as its right-edge frontier (one 32-byte hash per
    -- set bit of tree_size, largest subtree first), so the next segment and checkpoint need no
    -- earlier segment.
    frontier        bytea check (octet_length(frontier) % 32 = 0),
    sealed_at       timestamptz not null default now(),
    written_at      timestamptz,
    verified_at     timestamptz,
    published_at    timestamptz,
    primary key (stream, segment_index),
    unique (stream, first_sequence),
    check (first_sequence <= last_sequence),
    check (event_count <= last_sequence - first_sequence + 1),
    check ((segment_index = 0) = (previous_hash = '\x0000000000000000000000000000000000000000000000000000000000000000'::bytea)),
    check (state = 'sealed' or (size is not null and hash is not null and merkle_root is not null
                                and frontier is not null and written_at is not null)),
    check (state not in ('verified', 'published') or verified_at is not null),
    check (state <> 'published' or published_at is not null)
);

comment on table archive_segments is
    'Archive segments of the public (0) and private (1) streams: sealed range first, then written, verified, published.';

-- Every signed checkpoint the archiver produced, kept for ever (the store keeps checkpoints/<size>).
create table archive_checkpoints (
    stream     smallint not null check (stream in (0, 1)),
    tree_size  bigint not null check (tree_size > 0),
    root       bytea not null check (octet_length(root) = 32),
    -- The signed note's complete text (C2SP signed note).
    note       text not null,
    created_at timestamptz not null default now(),
    primary key (stream, tree_size)
);

-- Per stream: the highest sequence in a written segment, in a verified one, and in a published one
-- (0 = none). Derived from archive_segments and kept beside it so GET /corpus reads one row.
create table archive_watermarks (
    stream             smallint primary key check (stream in (0, 1)),
    archived_through   bigint not null default 0,
    verified_through   bigint not null default 0,
    published_through  bigint not null default 0,
    updated_at         timestamptz not null default now(),
    check (verified_through <= archived_through and published_through <= verified_through)
);
insert into archive_watermarks (stream) values (0), (1);

-- The private stream. Agents (onboarding) and operation records (filled in by the writer) change
-- after they are first written, so the stream holds immutable snapshots of them: each change marks
-- the record pending (the triggers below), and the active archiver captures pending records as new
-- archive_private_records rows with the next private sequence. The archiver alone assigns private
-- sequences (under its lock), so they become visible in order, like change sequences.
--
-- A pending row is upserted (not merely inserted) by the trigger so that the marking transaction
-- holds its row lock until it commits: the archiver deletes pending rows in one statement (waiting
-- for such locks) and reads the records' current state in a later statement of the same
-- transaction, so it never captures a state older than the one that marked the row.
create table archive_private_pending (
    kind       text not null check (kind in ('agent', 'operation')),
    agent_id   uuid not null,
    -- '' for agents.
    operation  text not null default '',
    token      text not null default '',
    touched_at timestamptz not null default now(),
    primary key (kind, agent_id, operation, token)
);

create table archive_private_records (
    sequence    bigint primary key check (sequence > 0),
    kind        text not null check (kind in ('agent', 'operation')),
    agent_id    uuid not null,
    operation   text not null default '',
    token       text not null default '',
    -- The record's bytes exactly as archived (protocol/archive_private.py: canonical JSON).
    body        bytea not null check (octet_length(body) <= 1048576),
    captured_at timestamptz not null default now()
);
create index archive_private_records_key on archive_private_records (kind, agent_id, operation, token, sequence);

create trigger archive_private_records_no_update_or_delete before update or delete on archive_private_records
    for each row execute function corpus_record_immutable();
create trigger archive_private_records_no_truncate before truncate on archive_private_records
    for each statement execute function corpus_record_immutable();

create function archive_mark_agents() returns trigger
language plpgsql as $$
begin
    insert into archive_private_pending (kind, agent_id)
        select distinct 'agent', agent_id from changed_agents
    on conflict (kind, agent_id, operation, token) do update set touched_at = now();
    return null;
end;
$$;

create function archive_mark_operations() returns trigger
language plpgsql as $$
begin
    -- Only answered operations: a claim is filled in within its own transaction (actors/writer/store.py).
    insert into archive_private_pending (kind, agent_id, operation, token)
        select distinct 'operation', author_id, operation, token from changed_operations where status is not null
    on conflict (kind, agent_id, operation, token) do update set touched_at = now();
    return null;
end;
$$;

-- Transition tables allow one event per trigger, hence two triggers per table.
create trigger agents_archive_insert after insert on agents
    referencing new table as changed_agents for each statement execute function archive_mark_agents();
create trigger agents_archive_update after update on agents
    referencing new table as changed_agents for each statement execute function archive_mark_agents();
create trigger operations_archive_insert after insert on operations
    referencing new table as changed_operations for each statement execute function archive_mark_operations();
create trigger operations_archive_update after update on operations
    referencing new table as changed_operations for each statement execute function archive_mark_operations();

-- A database that already holds agents and operations archives them from the start.
insert into archive_private_pending (kind, agent_id) select 'agent', agent_id from agents;
insert into archive_private_pending (kind, agent_id, operation, token)
    select 'operation', author_id, operation, token from operations where status is not null;
