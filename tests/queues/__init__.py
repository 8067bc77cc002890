"""Queues: the durable queue's consumers."""
