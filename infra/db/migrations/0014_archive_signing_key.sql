-- The public half of the key that signs this corpus's archive checkpoints: recorded by the first
-- archiver that signs (or by `toastmachine archive restore`: the key of the archive it restored,
-- which the restored corpus goes on signing with), then compared by every archiver at start and at
-- each activation, so that an archiver with another key (its own data directory's, on another
-- machine or after a restore without the key file) is refused before it signs anything, whatever
-- store or lineage it would write to. Written once.
create table archive_signing_key (
    singleton    boolean primary key default true check (singleton),
    -- The verifier key as the archive publishes it in public-key.txt (C2SP note form).
    public_key   text not null check (length(public_key) between 1 and 500),
    recorded_at  timestamptz not null default now()
);

comment on table archive_signing_key is
    'The public key every archiver of this corpus signs checkpoints with. Written once.';

create trigger archive_signing_key_no_update_or_delete
    before update or delete on archive_signing_key
    for each row execute function corpus_record_immutable();
create trigger archive_signing_key_no_truncate
    before truncate on archive_signing_key
    for each statement execute function corpus_record_immutable();
