"""Adapters to other projects' code: TransferQueue (verl / uni-agent) today. Each module imports
its project only when used, so the ledger installs and runs without them."""
