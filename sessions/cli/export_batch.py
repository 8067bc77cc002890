"""`rollout-ledger export`: one projected batch written with `torch.save` as a plain dict.

Loadable with `torch.load(FILE, weights_only=True)` (docs/design.md §11). The file is written
beside its target and swapped in whole; the target may not be a ledger, nor an existing file this
verb did not write unless `--force` (`sessions.export.outputs`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from sessions.cli.arguments import number, step, text
from sessions.errors import ConfigError
from sessions.vocabulary import PARTITIONS


def register(verbs: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    export = verbs.add_parser(
        "export", parents=[common], help="write one projected batch with torch.save"
    )
    export.add_argument("--run", type=text("a run name"), default=None)
    export.add_argument("--partition", choices=PARTITIONS, required=True)
    export.add_argument("--step", type=step, required=True)
    export.add_argument("--out", type=text("a file path"), required=True)
    export.add_argument(
        "--force", action="store_true", help="replace an existing file this verb did not write"
    )
    export.add_argument("--jagged", action="store_true")
    export.add_argument(
        "--timeout",
        type=number(0.0, 86_400.0, "seconds"),
        default=0.0,
        help="seconds to wait for unsettled groups (default: none)",
    )


def check(args: argparse.Namespace) -> None:
    """Refuse an --out that cannot or must not be written, before the database is opened."""
    from sessions.export.outputs import check_target

    out = args.out
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise ConfigError(
            f"--out {out} is a directory: pass a file path such as {os.path.join(out, 'batch.pt')}"
        )
    if not os.path.isdir(folder):
        raise ConfigError(
            f"--out {out}: folder {os.path.dirname(out) or folder} does not exist; create it first "
            "(mkdir -p) or pass another path"
        )
    check_target(out, flag="--out", databases=[args.db], force=args.force, made_here=_is_batch_file)


def _is_batch_file(path: Path) -> bool:
    """Whether `path` is an earlier `export` (a plain dict of a batch's columns), which `export`
    may replace without --force."""
    import zipfile

    if not zipfile.is_zipfile(path):
        return False
    import torch

    try:
        loaded = torch.load(path, weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - anything torch cannot read back is not our export
        return False
    return isinstance(loaded, dict) and {"responses", "is_placeholder"} <= set(loaded)


async def run(args: argparse.Namespace) -> int:
    import torch

    from sessions.batches import to_plain_dict
    from sessions.cli.main import _resolve_run
    from sessions.export.outputs import partial_file
    from sessions.ledger import Ledger

    async with Ledger.open(args.db, migrate=False) as ledger:
        run_name = await _resolve_run(ledger.engine, args.run)
        batch = await ledger.batch(
            args.partition, args.step, run=run_name, timeout=args.timeout, jagged=args.jagged
        )
    # open() names the file in an OSError; torch.save would not
    with partial_file(Path(args.out)) as partial, open(partial, "wb") as out:
        torch.save(to_plain_dict(batch), out)
    placeholders = int(batch["is_placeholder"].sum())
    print(
        f"wrote {batch.batch_size[0]} rows ({placeholders} placeholders) of run {run_name!r} "
        f"{args.partition} step {args.step} to {args.out}"
    )
    return 0
