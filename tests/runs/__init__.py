"""Runs: retention and prunes, recovery of orphaned sessions."""
