"""verl 0.9.1's own classes with the ledger behind them."""
