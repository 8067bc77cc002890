"""The `rollout-ledger` command, verb by verb, as a user runs it."""
