-- Roots of the public Merkle tree's aligned perfect subtrees of 2^height leaves (issue #11): the
-- inclusion-proof route's cache, so a proof reads at most two chunks of leaves and one row per
-- chunk below it instead of the whole history.
--
-- Chunk `chunk` of height h is the subtree over leaves [chunk * 2^h, (chunk + 1) * 2^h) of the
-- public stream's tree (leaves are the changes in sequence order, as archived). A row is written
-- only for a chunk whose leaves all lie inside a published checkpoint, so it never changes: the
-- history is append-only and the archived tree's leaves are fixed. Whoever first needs a chunk
-- computes it from the change history and inserts it; a concurrent duplicate is the same bytes.
create table archive_proof_chunks (
    height  smallint not null check (height between 1 and 30),
    chunk   bigint not null check (chunk >= 0),
    root    bytea not null check (octet_length(root) = 32),
    primary key (height, chunk)
);

comment on table archive_proof_chunks is
    'Cached roots of aligned 2^height-leaf subtrees of the public archive tree, for inclusion proofs.';
