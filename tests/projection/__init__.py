"""Projection: the rules, the projector, held rows, settled steps, metrics."""
