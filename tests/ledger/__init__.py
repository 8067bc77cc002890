"""The facade: `Ledger.run_session`'s bounds, the synchronous faces."""
