"""`rollout-ledger report` (issue 17): being written."""

from __future__ import annotations

import argparse


def register(verbs: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    verbs.add_parser("report", parents=[common], help="(being written) a static HTML report")


async def run(args: argparse.Namespace) -> int:
    raise NotImplementedError("report is being written")
