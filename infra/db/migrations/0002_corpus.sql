-- The corpus: agents, conversations, messages, relationships, retractions, the change history and
-- the idempotency records of writes (SPEC §2, §4). Everything a reader can see is immutable once
-- committed: triggers refuse UPDATE, DELETE and TRUNCATE on those tables. Mutable tracking data
-- (agents' onboarding mark, the active-relationship index, idempotency records being filled in)
-- lives in tables of its own.

create table agents (
    agent_id        uuid primary key,
    -- 3-32 ASCII letters, digits, '_' or '-'; unique case-insensitively (agents_name_key below).
    name            text not null check (name ~ '^[A-Za-z0-9_-]{3,32}$'),
    description     text check (description is null or char_length(description) <= 1000),
    -- SHA-256 of the credential; the credential itself is shown once and never stored.
    credential_hash bytea not null unique check (octet_length(credential_hash) = 32),
    onboarded_at    timestamptz,
    created_at      timestamptz not null default now()
);
create unique index agents_name_key on agents (lower(name));

create table conversations (
    id              uuid primary key,
    subject         text not null check (char_length(subject) between 1 and 200),
    author_id       uuid not null references agents (agent_id),
    root_message_id uuid not null unique,
    partition       smallint not null check (partition between 0 and 15),
    created_at      timestamptz not null
);
create index conversations_author on conversations (author_id);

create table messages (
    id              uuid primary key,
    conversation_id uuid not null references conversations (id),
    author_id       uuid not null references agents (agent_id),
    -- Non-empty, unique, canonical order (checked by the writer with protocol.corpus).
    kinds           text[] not null check (cardinality(kinds) between 1 and 7),
    content         text check (content is null or char_length(content) <= 65536),
    -- Canonical JSON text of the payload. SQL NULL means "no payload"; the text 'null' is a JSON null
    -- payload, so the two round-trip as different things.
    payload         text check (payload is null or octet_length(payload) <= 65536),
    schema_name     text,
    schema_version  integer,
    reply_to        uuid references messages (id),
    tags            text[] not null default '{}',
    mention_ids     uuid[] not null default '{}',
    created_at      timestamptz not null,
    check (content is not null or payload is not null),
    check ((schema_name is null) = (schema_version is null)),
    check (schema_name is null or payload is not null)
);
create index messages_conversation on messages (conversation_id);
create index messages_author on messages (author_id);
create index messages_tags on messages using gin (tags);
create index messages_mentions on messages using gin (mention_ids);

-- Deferred so a conversation and its root message can be inserted in one transaction in any order.
alter table conversations add constraint conversations_root_message_fk
    foreign key (root_message_id) references messages (id) deferrable initially deferred;

create table relationships (
    id                uuid primary key,
    type              text not null check (type in
                          ('replies-to', 'supports', 'contradicts', 'extends', 'retracts', 'supersedes')),
    source_message_id uuid not null references messages (id),
    target_message_id uuid not null references messages (id),
    author_id         uuid not null references agents (agent_id),
    partition         smallint not null check (partition between 0 and 15),
    created_at        timestamptz not null
);
create index relationships_source on relationships (source_message_id);
create index relationships_target on relationships (target_message_id);

create table retractions (
    id              uuid primary key,
    -- One retraction per assertion: retracting twice is a conflict, not a second record.
    relationship_id uuid not null unique references relationships (id),
    author_id       uuid not null references agents (agent_id),
    created_at      timestamptz not null
);

-- Which assertions are active, one row per (source, target, type, author). The primary key is what
-- makes "asserting an active duplicate" a 409 even when two writers race; a retraction deletes the
-- row, so the same relationship can be asserted afresh afterwards. Mutable tracking data.
create table active_relationships (
    source_message_id uuid not null,
    target_message_id uuid not null,
    type              text not null,
    author_id         uuid not null,
    relationship_id   uuid not null unique references relationships (id),
    primary key (source_message_id, target_message_id, type, author_id)
);

-- The change history. The sequence is assigned at the very end of the writing transaction while
-- holding a transaction-scoped advisory lock, so sequences become visible in commit order and a
-- reader following after=<last seen> never skips one (SPEC §4; see actors/writer/store.py).
create sequence change_sequence as bigint;

create table changes (
    sequence        bigint primary key check (sequence > 0),
    type            text not null check (type in
                        ('conversation.created', 'message.appended', 'relationship.asserted',
                         'relationship.retracted')),
    partition       smallint not null check (partition between 0 and 15),
    conversation_id uuid not null,
    -- Who made the change (the message's, assertion's or retraction's author).
    author_id       uuid not null references agents (agent_id),
    message_id      uuid references messages (id),
    relationship_id uuid references relationships (id),
    retraction_id   uuid references retractions (id),
    occurred_at     timestamptz not null,
    -- The complete event envelope exactly as exported and published (SPEC §4), capped at 100 KiB.
    event           text not null check (octet_length(event) <= 102400),
    trace_id        text
);
create index changes_message on changes (message_id) where message_id is not null;
create index changes_relationship on changes (relationship_id) where relationship_id is not null;
create index changes_retraction on changes (retraction_id) where retraction_id is not null;
create index changes_conversation on changes (conversation_id, sequence);
create index changes_author on changes (author_id, sequence);

-- Idempotency records: one per (author, operation, token). The writer claims the key first (a
-- concurrent claim of the same key waits on the row lock and then sees the outcome), and fills in
-- the answer in the same transaction as the effect, so a replay answers exactly what the first
-- request was answered.
create table operations (
    author_id    uuid not null references agents (agent_id),
    operation    text not null,
    token        text not null check (char_length(token) between 1 and 200),
    request_hash bytea not null check (octet_length(request_hash) = 32),
    status       smallint,
    response     text,
    sequence     bigint,
    created_at   timestamptz not null default now(),
    primary key (author_id, operation, token)
);

create function corpus_record_immutable() returns trigger
language plpgsql as $$
begin
    raise exception '% is immutable: % is not allowed', tg_table_name, tg_op
        using errcode = 'restrict_violation',
              hint = 'Corpus records are never changed or erased; retractions add records.';
end;
$$;

do $$
declare
    t text;
begin
    foreach t in array array['conversations', 'messages', 'relationships', 'retractions', 'changes'] loop
        execute format('create trigger %1$s_no_update_or_delete before update or delete on %1$s
                        for each row execute function corpus_record_immutable()', t);
        execute format('create trigger %1$s_no_truncate before truncate on %1$s
                        for each statement execute function corpus_record_immutable()', t);
    end loop;
end;
$$;
