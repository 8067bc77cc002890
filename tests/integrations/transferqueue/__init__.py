"""A real local TransferQueue on Ray."""
