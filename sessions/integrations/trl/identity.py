"""Which ledger session each of TRL's completions is, the same on every rank.

TRL hands `rollout_func` only this rank's prompts, each repeated once per generation, with no
dataset index. Its group baseline reshapes the gathered rewards of all ranks, in rank order, into
rows of `num_generations` (`GRPOTrainer._generate_and_score_completions`), so the global row
`process_index * len(prompts) + i` and its group `row // num_generations` are TRL's own grouping,
whichever rank a row landed on. A group's uid is built from what every rank knows alike: a key of
the prompt's text, the launch's token (agreed once, rank 0's), the generation call's counter and
the group's number in the call. A uid never repeats, so a prompt seen again, at a later step or
twice in one batch, is a new group (`docs/design.md §2`).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sessions.integrations.trl.errors import TRLSetupError

__all__ = ["Slot", "launch_token", "prompt_key", "slots"]

#: Hex digits of the prompt key and of the launch token (48 bits each).
_KEY_HEX = 12


def prompt_key(prompt: Any) -> str:
    """A short, stable digest of a prompt (text or chat messages), equal on every process.

    Values JSON cannot spell (an image) count by their type only: the key labels a group and
    checks the layout, the group's number in the call keeps two such prompts apart."""
    text = json.dumps(
        prompt, sort_keys=True, ensure_ascii=False, default=lambda o: type(o).__name__
    )
    return hashlib.blake2b(text.encode("utf-8"), digest_size=_KEY_HEX // 2).hexdigest()


def launch_token(trainer: Any) -> str:
    """A token for this launch of the trainer, the same on every rank (rank 0's, broadcast), so
    that a resumed run's groups never collide with the ones a crashed launch left behind."""
    token = uuid.uuid4().hex[:_KEY_HEX]
    if getattr(trainer.accelerator, "num_processes", 1) > 1:
        from accelerate.utils import broadcast_object_list

        box = [token]
        broadcast_object_list(box, from_process=0)
        token = box[0]
    return token


@dataclass(frozen=True)
class Slot:
    """One completion's session: its id, group and index within the group."""

    session_id: str
    uid: str
    session_index: int
    key: str
    #: the completion's row in the generation call, all ranks in rank order (TRL's own order)
    row: int


def slots(
    prompts: Sequence[Any], *, process_index: int, group_size: int, token: str, call: int
) -> list[Slot]:
    """The sessions of this rank's `prompts` in one generation call.

    Raises `TRLSetupError` when two rows TRL will put in one group carry different prompts: the
    trainer's sampler is not TRL's `RepeatSampler`, so TRL's baseline would mix prompts."""
    if group_size < 1:
        raise TRLSetupError(f"num_generations must be >= 1, got {group_size}")
    first = process_index * len(prompts)
    keys = [prompt_key(p) for p in prompts]
    out = []
    for i, key in enumerate(keys):
        row = first + i
        group, index = divmod(row, group_size)
        start = max(0, group * group_size - first)  # the group's first row on this rank
        if keys[start] != key:
            raise TRLSetupError(
                f"rows {first + start} and {row} fall in one GRPO group of {group_size} but carry different "
                "prompts: TRL's RepeatSampler repeats each prompt num_generations times in a row; keep "
                "GRPOTrainer's own sampler and dataloader"
            )
        uid = f"{key}-{token}-{call}-{group}"
        out.append(Slot(f"trl-{uid}-{index}", uid, index, key, row))
    return out
