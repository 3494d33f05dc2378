-- Whether the active archiver's object store answers, as the archiver last saw it: one row,
-- written by the archiver when that changes (a failure, a different failure, a recovery), read by
-- every node's /readyz (detail, not status) and by `toastmachine archive status`. A store that
-- refuses the archiver's credentials or has vanished shows here, on any node, not only in the
-- archiver's log. `error` is the archiver's own message (the store's description and the failure's
-- cause in fixed words: never a credential, never the server's answer).
create table archiver_store_state (
    singleton      boolean primary key default true check (singleton),
    error          text,
    failing_since  timestamptz,
    node_id        text,
    updated_at     timestamptz not null default now(),
    check ((error is null) = (failing_since is null))
);
insert into archiver_store_state default values;
