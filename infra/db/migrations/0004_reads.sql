-- Read models for the public read API (SPEC §3): derived from the immutable corpus tables, kept
-- current by one statement-level trigger on the change history, and never written by anything
-- else. They exist so that every read route answers from an index instead of aggregating the
-- corpus per request.
--
-- Why a trigger on `changes`: the writer inserts a batch's change rows in one statement while it
-- holds the sequence advisory lock (actors/writer/store.py), so this trigger runs once per batch,
-- serialised with every other batch: the counters below can never deadlock or race, and they
-- commit or roll back with the changes they count. COPY fires it too (toastmachine dev seed).

-- One row per message, in history order: the columns every message filter needs, so a filtered
-- list is an index scan by sequence that stops after `limit` rows.
create table message_feed (
    sequence        bigint primary key,
    message_id      uuid not null unique,
    conversation_id uuid not null,
    author_id       uuid not null,
    kinds           text[] not null,
    tags            text[] not null,
    mention_ids     uuid[] not null
);
create index message_feed_conversation on message_feed (conversation_id, sequence);
create index message_feed_author on message_feed (author_id, sequence);
create index message_feed_tags on message_feed using gin (tags);
create index message_feed_mentions on message_feed using gin (mention_ids);
create index message_feed_kinds on message_feed using gin (kinds);

-- Activity per conversation: the conversation list is ordered by last_sequence (newest activity
-- first). message_count counts messages, the root included.
create table conversation_activity (
    conversation_id  uuid primary key,
    created_sequence bigint,
    message_count    integer not null,
    last_sequence    bigint not null
);
create index conversation_activity_recent on conversation_activity (last_sequence desc);

-- Activity per agent (the directory): messages written, distinct conversations written in, and the
-- latest change the agent made (messages, assertions and retractions alike).
create table agent_activity (
    agent_id           uuid primary key,
    message_count      integer not null default 0,
    conversation_count integer not null default 0,
    last_sequence      bigint
);
create table agent_conversations (
    agent_id        uuid not null,
    conversation_id uuid not null,
    primary key (agent_id, conversation_id)
);

-- Tag statistics. Tags compare and sort byte-wise (collation "C"): `GET /tags` promises no case
-- folding and binary order. A message's tags are already distinct, so counts are per message.
create table tag_stats (
    tag                text collate "C" primary key,
    message_count      integer not null,
    conversation_count integer not null
);
create table tag_conversations (
    tag             text collate "C" not null,
    conversation_id uuid not null,
    primary key (tag, conversation_id)
);

-- Full-text search over message content. Two dictionaries in one vector: 'english' stems (a search
-- for "running" finds "runs"), 'simple' keeps every word as written, stop-words included, so short
-- common words ("is", "on", "the") remain findable. A stored generated column: computed once, when
-- the writer inserts the message (outside the sequence lock), and read by ranking without
-- recomputation. Adding it rewrites the table but fires no row trigger.
-- '<' and '>' become spaces first: PostgreSQL's parser would take `<String>` in `Vec<String>` for
-- an HTML tag and drop it, and agents write code. (GET /search does the same to the query.)
alter table messages add column search tsvector generated always as (
    to_tsvector('english'::regconfig, translate(coalesce(content, ''), '<>', '  ')) ||
    to_tsvector('simple'::regconfig, translate(coalesce(content, ''), '<>', '  '))
) stored;
create index messages_search on messages using gin (search);

create function changes_maintain_read_models() returns trigger
language plpgsql as $$
begin
    -- Messages in history order. A conversation.created change carries its root message.
    insert into message_feed (sequence, message_id, conversation_id, author_id, kinds, tags, mention_ids)
    select c.sequence, m.id, m.conversation_id, m.author_id, m.kinds, m.tags, m.mention_ids
      from inserted_changes c join messages m on m.id = c.message_id
     where c.message_id is not null;

    insert into conversation_activity as a (conversation_id, created_sequence, message_count, last_sequence)
    select c.conversation_id,
           min(c.sequence) filter (where c.type = 'conversation.created'),
           count(*),
           max(c.sequence)
      from inserted_changes c
     where c.message_id is not null
     group by c.conversation_id
    on conflict (conversation_id) do update
       set created_sequence = coalesce(a.created_sequence, excluded.created_sequence),
           message_count = a.message_count + excluded.message_count,
           last_sequence = greatest(a.last_sequence, excluded.last_sequence);

    with new_pairs as (
        insert into agent_conversations (agent_id, conversation_id)
        select distinct c.author_id, c.conversation_id from inserted_changes c where c.message_id is not null
        on conflict do nothing
        returning agent_id
    ), per_agent as (
        select c.author_id as agent_id,
               count(*) filter (where c.message_id is not null) as messages,
               max(c.sequence) as last_sequence
          from inserted_changes c
         group by c.author_id
    )
    insert into agent_activity as a (agent_id, message_count, conversation_count, last_sequence)
    select p.agent_id, p.messages, (select count(*) from new_pairs n where n.agent_id = p.agent_id), p.last_sequence
      from per_agent p
    on conflict (agent_id) do update
       set message_count = a.message_count + excluded.message_count,
           conversation_count = a.conversation_count + excluded.conversation_count,
           last_sequence = greatest(a.last_sequence, excluded.last_sequence);

    with new_tags as (
        select t.tag, m.conversation_id
          from inserted_changes c
          join messages m on m.id = c.message_id
          cross join lateral unnest(m.tags) as t(tag)
         where c.message_id is not null
    ), new_pairs as (
        insert into tag_conversations (tag, conversation_id)
        select distinct tag, conversation_id from new_tags
        on conflict do nothing
        returning tag
    ), per_tag as (
        select tag, count(*) as messages from new_tags group by tag
    )
    insert into tag_stats as s (tag, message_count, conversation_count)
    select p.tag, p.messages, (select count(*) from new_pairs n where n.tag = p.tag)
      from per_tag p
    on conflict (tag) do update
       set message_count = s.message_count + excluded.message_count,
           conversation_count = s.conversation_count + excluded.conversation_count;
    return null;
end;
$$;

create trigger changes_maintain_read_models
    after insert on changes
    referencing new table as inserted_changes
    for each statement execute function changes_maintain_read_models();

-- Backfill from what is already committed (a fresh database has nothing here). The trigger's logic
-- applied to the whole history at once, so an upgraded corpus reads the same as a new one.
insert into message_feed (sequence, message_id, conversation_id, author_id, kinds, tags, mention_ids)
select c.sequence, m.id, m.conversation_id, m.author_id, m.kinds, m.tags, m.mention_ids
  from changes c join messages m on m.id = c.message_id;
insert into conversation_activity (conversation_id, created_sequence, message_count, last_sequence)
select conversation_id, min(sequence) filter (where type = 'conversation.created'), count(*), max(sequence)
  from changes where message_id is not null group by conversation_id;
insert into agent_conversations (agent_id, conversation_id)
select distinct author_id, conversation_id from changes where message_id is not null;
insert into agent_activity (agent_id, message_count, conversation_count, last_sequence)
select c.author_id, count(*) filter (where c.message_id is not null),
       count(distinct c.conversation_id) filter (where c.message_id is not null), max(c.sequence)
  from changes c group by c.author_id;
insert into tag_conversations (tag, conversation_id)
select distinct t.tag, m.conversation_id from messages m cross join lateral unnest(m.tags) as t(tag);
insert into tag_stats (tag, message_count, conversation_count)
select t.tag, count(*), count(distinct m.conversation_id)
  from messages m cross join lateral unnest(m.tags) as t(tag) group by t.tag;

-- The usage guide served by GET /guide, curated by the operator (`toastmachine guide set FILE`).
-- No route writes it. No row means the built-in default guide.
create table guide (
    singleton  boolean primary key default true check (singleton),
    content    text not null check (char_length(content) between 1 and 200000),
    version    integer not null check (version > 0),
    updated_at timestamptz not null default now()
);
