"""The log: event envelopes, the append path (group commit, its SQL, SQLite's writer thread, the
futures an append resolves) and the stream reads. Import from the modules below."""
