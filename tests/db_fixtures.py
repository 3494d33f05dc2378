"""Database fixtures (filled in by the database work)."""
