"""Bus fixtures (filled in by the bus work)."""
