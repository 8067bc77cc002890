"""Audit and replay: rebuilding the log, comparing read models, golden logs."""
