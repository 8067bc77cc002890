"""`rollout-ledger export-dataset` (issue 17): being written."""

from __future__ import annotations

import argparse


def register(verbs: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    verbs.add_parser("export-dataset", parents=[common], help="(being written) sessions to Parquet or JSONL")


async def run(args: argparse.Namespace) -> int:
    raise NotImplementedError("export-dataset is being written")
