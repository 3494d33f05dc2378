-- The event publisher's outbox cursor and its wake-up call (SPEC §1: the publisher reads the change
-- history as a transactional outbox).
--
-- publisher_cursor: one row, the highest sequence whose event (and every one below it) the broker
-- has confirmed. Only the active publisher (the holder of its session-level advisory lock) updates
-- it, on the connection that holds the lock, and never backwards. It starts at 0: a history that
-- predates the publisher is published from its first change.
create table publisher_cursor (
    -- Primary key that can only be true: at most one row can ever exist.
    singleton  boolean primary key default true check (singleton),
    sequence   bigint not null default 0 check (sequence >= 0),
    updated_at timestamptz not null default now()
);
insert into publisher_cursor (singleton) values (true);

comment on table publisher_cursor is
    'Event publisher cursor: every change up to sequence has been published to tm.events and confirmed.';

-- Wake the publisher when changes commit. NOTIFY is delivered at commit and in commit order, so a
-- publisher woken by it reads the new rows; the payload is the highest sequence the statement
-- inserted (a hint only: the publisher always reads from its cursor, and also polls in case a
-- notification is lost with its connection). One notification per statement, not per row.
create function changes_notify_publisher() returns trigger
language plpgsql as $$
begin
    perform pg_notify('tm_changes', coalesce((select max(sequence) from inserted_changes)::text, ''));
    return null;
end;
$$;

create trigger changes_notify_publisher
    after insert on changes
    referencing new table as inserted_changes
    for each statement execute function changes_notify_publisher();
