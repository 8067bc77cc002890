"""Audit and replay: check the log, rebuild read models from it alone, compare, and show a
session's history."""
