"""Data out: a run's sessions as a Parquet or JSONL dataset (`export_dataset`; docs/export.md).

pyarrow (the `export` extra) is imported only when a Parquet file is written.
"""

from sessions.export.dataset import ExportSummary, export_dataset, parse_steps
from sessions.export.writers import ExportError

__all__ = ["ExportError", "ExportSummary", "export_dataset", "parse_steps"]
