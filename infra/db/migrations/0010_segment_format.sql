-- The archive format version of each segment (issue #11): version 2 frames hold the stored envelope
-- text verbatim where version 1 held its canonical re-encoding, so a leaf recomputed from the change
-- history (the inclusion-proof route) must know which rule its segment follows. A lineage begun
-- under version 1 keeps its version-1 segments; the archiver writes version 2 from now on.
alter table archive_segments add column format_version smallint
    check (format_version in (1, 2));
-- Segments already written are version 1 (the only version before this migration). A segment only
-- sealed is not in the store yet: the archiver encodes it with the current version.
update archive_segments set format_version = case when state = 'sealed' then 2 else 1 end;
alter table archive_segments alter column format_version set default 2;
alter table archive_segments alter column format_version set not null;
