"""Batches: rows to verl-convention torch batches, the GRPO reference advantage."""
