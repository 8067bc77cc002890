"""TRL's setup fails loudly when it is built, never as a failed session per row (docs/trl.md).

A runner that cannot be called as `runner(prompt, context)`, a ledger that is not an open
`SyncLedger`: each is one `TRLSetupError` from `LedgerRollout(...)` itself, before a trainer
exists. (A trainer without the companion reward is refused by `LedgerGRPOTrainer` when it is
built: `test_trl.py`.) None of this needs TRL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sessions import Ledger, SyncLedger
from sessions.integrations.trl import LedgerRollout, TRLSetupError


def good(prompt: Any, context: Any) -> dict[str, Any]:
    return {"prompt_ids": [1], "completion_ids": [2], "reward": 1.0}


async def good_async(prompt: Any, context: Any, *, extra: int = 0) -> dict[str, Any]:
    return good(prompt, context)


def only_prompt(prompt: Any) -> dict[str, Any]:
    return good(prompt, None)


def needs_three(prompt: Any, context: Any, tools: Any) -> dict[str, Any]:
    return good(prompt, context)


@pytest.fixture
def ledger(tmp_path: Path) -> Any:
    with SyncLedger.open(str(tmp_path / "trl.db")) as opened:
        yield opened


@pytest.mark.parametrize("runner", [only_prompt, needs_three, lambda: None])
def test_a_runner_that_cannot_take_prompt_and_context_is_refused_when_built(
    ledger: SyncLedger, runner: Any
) -> None:
    with pytest.raises(TRLSetupError, match=r"cannot be called as runner\(prompt, context\)"):
        LedgerRollout(runner, ledger)


def test_runners_of_every_callable_kind_are_accepted(ledger: SyncLedger) -> None:
    class Agent:
        def __call__(self, prompt: Any, context: Any) -> dict[str, Any]:
            return good(prompt, context)

    for runner in (good, good_async, Agent(), print):  # print: no signature to check
        LedgerRollout(runner, ledger).close()


async def test_a_ledger_that_is_not_an_open_sync_ledger_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "trl.db")
    with pytest.raises(TRLSetupError, match="needs a SyncLedger, got str"):
        LedgerRollout(good, url)  # type: ignore[arg-type]
    async with Ledger.open(url) as ledger:
        with pytest.raises(TRLSetupError, match="needs a SyncLedger, got Ledger"):
            LedgerRollout(good, ledger)  # type: ignore[arg-type]
    closed = SyncLedger.open(url)
    closed.close()
    with pytest.raises(TRLSetupError, match="is closed"):
        LedgerRollout(good, closed)


def test_the_setup_block_of_docs_trl_runs_as_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/trl.md's setup block, run as printed, with the user's five objects the tiny ones of
    examples/trl_grpo.py: it trains a step into `rollouts.db` and leaves the ledger closed."""
    import re

    from tests import REPO
    from tests.integrations.trl.test_trl import Plan, load_example, require_trl

    require_trl()
    example = load_example()
    text = (REPO / "docs" / "trl.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- setup:[^\n]*-->\n```python\n(.*?)```", text, re.S)
    assert block is not None
    tokenizer = example.tiny_tokenizer()
    yours = {
        "my_agent": Plan(tokenizer, {}).runner,
        "model": example.tiny_model(0),
        "tokenizer": tokenizer,
        "dataset": example.prompt_dataset(8),
        "args": example.grpo_config(str(tmp_path / "out"), 1, per_device_train_batch_size=32),
    }
    monkeypatch.chdir(tmp_path)
    namespace = dict(yours)
    exec(compile(block.group(1), "docs/trl.md", "exec"), namespace)  # noqa: S102 - the doc's code
    assert namespace["ledger"].closed
    with SyncLedger.open(str(tmp_path / "rollouts.db"), run="grpo-1") as ledger:
        figures = {r.metric: r.value for r in ledger.metrics("train", 0) if r.data_source is None}
    assert figures["sessions/succeeded"] == 8 * 4
