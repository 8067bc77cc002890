"""Queues the projector feeds: the sink protocol and the in-process queue (`sinks`), and the
durable queue table's consumer (`consumer`, needs torch for its batches)."""
