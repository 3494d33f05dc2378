-- Recovery (SPEC §5, issue #11): where a restored history came from, and a mirror's progress.
--
-- corpus_provenance: where a restored history came from. Written once by `toastmachine archive
-- restore`, in the transaction that loads the archive, beside the corpus witness it creates. An
-- original history has no row. GET /corpus shows it as `provenance`.
create table corpus_provenance (
    -- Primary key that can only be true: at most one row can ever exist.
    singleton        boolean primary key default true check (singleton),
    -- The lineage whose archive was restored (this database's own lineage is the witness's, fresh).
    parent_lineage   uuid not null,
    -- The signed checkpoint the restore verified against: tree size and root hash.
    checkpoint_size  bigint not null check (checkpoint_size > 0),
    checkpoint_root  bytea not null check (octet_length(checkpoint_root) = 32),
    -- The highest change sequence restored (new writes continue after it).
    restored_through bigint not null check (restored_through > 0),
    -- Private stream records applied (agent register snapshots and operation records).
    private_records  bigint not null check (private_records >= 0),
    restored_at      timestamptz not null default now()
);

comment on table corpus_provenance is
    'Provenance of a restored history: the parent lineage and the checkpoint it was verified against. Written once.';

create trigger corpus_provenance_no_update_or_delete
    before update or delete on corpus_provenance
    for each row execute function corpus_record_immutable();
create trigger corpus_provenance_no_truncate
    before truncate on corpus_provenance
    for each statement execute function corpus_record_immutable();

-- A mirror's progress (`toastmachine mirror`): this database is a read-only copy of another node's
-- public history, built from its archive and followed live. One row, updated by the mirror alone.
-- verified_* is what the signed archive proves (the Merkle tree's size and right-edge frontier, the
-- last segment read and its hash, the trusted checkpoint's size and root); applied_through is the
-- highest change applied, archived or not yet (the tail from changes.jsonl, checked against the
-- archive once it is archived).
create table corpus_mirror (
    singleton          boolean primary key default true check (singleton),
    source             text not null,
    public_key         text not null,
    tree_size          bigint not null default 0 check (tree_size >= 0),
    frontier           bytea not null default '' check (octet_length(frontier) % 32 = 0),
    segment_index      bigint not null default -1,
    segment_hash       bytea,
    verified_through   bigint not null default 0,
    checkpoint_size    bigint not null default 0,
    checkpoint_root    bytea,
    applied_through    bigint not null default 0,
    updated_at         timestamptz not null default now()
);

comment on table corpus_mirror is
    'Progress of a mirror of another node: the verified archive tree and the applied tail.';
