"""`LedgerGRPOTrainer`: TRL's `GRPOTrainer` whose row-mean loss types average over trainable rows.

Imports TRL (load it through `sessions.integrations.trl.LedgerGRPOTrainer`, which defers it).
`loss_types.py` says which loss types need it and why the factor is exact. Every other loss
type, and evaluation aside, runs TRL's code unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOTrainer

from sessions.integrations.trl.loss_types import ROW_MEAN_LOSS_TYPES, step_scale

__all__ = ["LedgerGRPOTrainer"]

#: The per-row column (1.0: the row has a loss token) carried through TRL's shuffle and split.
_TRAINABLE = "ledger_trainable"


class LedgerGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
    """`GRPOTrainer` with `grpo`, `sapo`, `luspo` and `dr_grpo` losses over trainable rows only:
    a failed session's placeholder no longer shrinks the step's loss and gradient by R/G."""

    #: read by `LedgerRollout`, which warns when a row-mean loss type runs on a trainer without it
    averages_trainable_rows = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check = getattr(getattr(self, "rollout_func", None), "check_trainer", None)
        if callable(check):  # a LedgerRollout: a wrong setup is one error now, before any rollout
            check(self)
        self._ledger_buffer: Any = None
        self._ledger_counts: list[list[float]] = []
        self._ledger_start = 0  # TRL's `_step` at the current optimizer step's first micro-batch
        self._ledger_done = 0  # micro-batches of the current optimizer step begun so far

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            mask = mask * output["tool_mask"]
        output[_TRAINABLE] = (mask.sum(-1) > 0).to(torch.float32)
        return output

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        if self._ledger_done == 0:
            self._ledger_start = self._step
        self._ledger_done += 1
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            if self._ledger_done >= self.current_gradient_accumulation_steps:
                self._ledger_done = 0

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        inputs = super()._prepare_inputs(generation_batch)
        buffer = self._buffered_inputs
        if self.model.training and buffer is not None and buffer is not self._ledger_buffer:
            local = [[float(b[_TRAINABLE].sum()), float(len(b[_TRAINABLE]))] for b in buffer]
            counts = torch.tensor(local, device=self.accelerator.device)
            self._ledger_counts = self.accelerator.reduce(counts, reduction="sum").tolist()
            self._ledger_buffer = (
                buffer  # every rank generates at the same micro-batch: one reduce each
            )
        return inputs

    def _row_scale(self, inputs: dict[str, Any]) -> float:
        """G/R for this micro-batch's optimizer step (training), or of the batch itself (evaluation)."""
        if _TRAINABLE not in inputs:
            return 1.0
        if not self.model.training:
            trainable = float(inputs[_TRAINABLE].sum())
            return float(len(inputs[_TRAINABLE])) / trainable if trainable > 0 else 1.0
        window = range(
            self._ledger_start, self._ledger_start + self.current_gradient_accumulation_steps
        )
        return step_scale(
            self._ledger_counts,
            window,
            steps_per_generation=self.args.steps_per_generation,
            generate_every=self.args.steps_per_generation * self.num_iterations,
        )

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        if self.loss_type not in ROW_MEAN_LOSS_TYPES:
            return super()._compute_loss(model, inputs)
        scale = self._row_scale(inputs)
        if scale == 1.0:
            return super()._compute_loss(model, inputs)
        beta = self.beta
        self.beta = beta * scale  # the KL term shares the policy term's denominator
        try:
            return super()._compute_loss(
                model, {**inputs, "advantages": inputs["advantages"] * scale}
            )
        finally:
            self.beta = beta
