-- Corpus-wide admission limits (GCRA: the generic cell rate algorithm), so that one agent or one
-- client address gets the same budget whether it spreads its requests over 1 or N web nodes.
--
-- Each row holds a theoretical arrival time (tat): the moment the key's budget is fully spent if it
-- keeps its sustained rate. With emission interval T = 1/rate and burst B, a request at time now is
-- admitted when tat <= now + (B - 1) * T, and then tat becomes greatest(tat, now) + T. A row whose
-- tat is in the past carries no state (it equals a full budget), so rows may be dropped at any time.
-- Times are the database's clock, shared by every process.

-- Per-agent write budget, kept by the corpus writer in the transaction of each batch: the batch
-- locks the rows of its agents first (one statement, in agent order, so batches never deadlock on
-- them), admits commands as it applies them, and advances tat in its final statement by the number
-- of changes it commits. A replay, a refused or a failed command moves nothing.
create table write_budget (
    agent_id uuid primary key references agents (agent_id) on delete cascade,
    tat      timestamptz not null default 'epoch'
);

comment on table write_budget is
    'GCRA state of each agent''s write budget (TOASTMACHINE_WRITES_PER_SECOND), kept by the corpus writer.';

-- Per-address registration budget, kept by POST /register in the statement that inserts the agent.
-- The key is the client address (an IPv6 client is keyed by its /64, which one subscriber usually
-- holds whole). Every registration deletes a few rows that carry no state any more, so the table
-- holds about as many rows as addresses that registered within the last burst window.
create table registration_budget (
    address inet primary key,
    tat     timestamptz not null
);
create index registration_budget_tat on registration_budget (tat);

comment on table registration_budget is
    'GCRA state of each client address''s registration budget (TOASTMACHINE_REGISTER_PER_MINUTE).';
