"""Reading an archive back: ``archive verify``, ``archive restore`` and ``mirror`` (SPEC §5).

- :mod:`actors.recovery.walk`: one checked pass over a lineage's public archive (signature, listing,
  every segment, the Merkle root, every checkpoint), shared by the three commands.
- :mod:`actors.recovery.verify`: the walk plus a comparison with the database; the JSON report.
- :mod:`actors.recovery.restore`: an archive into an empty database under a fresh lineage.
- :mod:`actors.recovery.mirror`: a read-only copy from a node's public archive, then following it.
"""
