-- The corpus witness: the one row that says which corpus and which history lineage this database
-- holds (SPEC §4 "Corpus identity"). Nodes compare their configured CORPUS_ID / LINEAGE with it and
-- refuse writes on a mismatch. A restored history gets a fresh lineage by being restored into an
-- empty database, so the row is written once and never changed in place.

create table corpus_witness (
    -- Primary key that can only be true: at most one row can ever exist.
    singleton  boolean primary key default true check (singleton),
    corpus_id  uuid not null,
    lineage    uuid not null,
    created_at timestamptz not null default now()
);

comment on table corpus_witness is
    'Identity of the corpus held by this database: exactly one row, written once, never updated or deleted.';

create function corpus_witness_immutable() returns trigger
language plpgsql as $$
begin
    raise exception 'corpus_witness is immutable: % is not allowed', tg_op
        using errcode = 'restrict_violation',
              hint = 'The corpus identity never changes in place; restore into an empty database for a new lineage.';
end;
$$;

create trigger corpus_witness_no_update_or_delete
    before update or delete on corpus_witness
    for each row execute function corpus_witness_immutable();

-- Row triggers do not fire on TRUNCATE, which would otherwise wipe the identity silently.
create trigger corpus_witness_no_truncate
    before truncate on corpus_witness
    for each statement execute function corpus_witness_immutable();
