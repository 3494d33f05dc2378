"""PostgreSQL: the connection pool, schema migrations, the corpus witness and embedded mode.

Typical start-up (what ``toastmachine.node.open_database`` does)::

    embedded = await start_embedded(settings.data_dir) if settings.database_url is None else None
    db = await Database.connect(embedded.dsn if embedded else settings.database_url,
                                max_size=settings.db_pool_size)
    await apply_migrations(db)
    identity = await ensure_identity(db, settings.corpus_id, settings.lineage)

The helpers take a :class:`Database`, an asyncpg pool or a single connection (:data:`Target`).
"""

from infra.db.embedded import EmbeddedPostgres, start_embedded
from infra.db.migrations import (
    MIGRATION_LOCK_KEY,
    Migration,
    MigrationError,
    apply_migrations,
    load_migrations,
    pending_migrations,
)
from infra.db.pool import Database, Target, connection
from infra.db.witness import CorpusIdentity, ensure_identity, read_identity

__all__ = [
    "MIGRATION_LOCK_KEY",
    "CorpusIdentity",
    "Database",
    "EmbeddedPostgres",
    "Migration",
    "MigrationError",
    "Target",
    "apply_migrations",
    "connection",
    "ensure_identity",
    "load_migrations",
    "pending_migrations",
    "read_identity",
    "start_embedded",
]
