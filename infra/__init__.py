"""Everything that owns a connection: configuration, logging, the bus, the database, HTTP plumbing."""
