"""Projection: the rules that turn events into read models, queue rows and metrics, and the two
ways they are applied — page by page from a checkpoint (`projector`) and to a whole log at once
(`rebuild`, for replay and audit)."""
