"""TRL's GRPOTrainer with the ledger behind its rollouts."""
