"""Datasets out: Parquet and JSONL."""
