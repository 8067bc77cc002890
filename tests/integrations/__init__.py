"""The integrations: verl, TRL, TransferQueue, against the real packages."""
