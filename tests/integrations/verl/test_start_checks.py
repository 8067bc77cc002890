"""The verl rollout side fails loudly at its first line, never silently per row (docs/verl.md).

On verl 0.9.1's own ``AgentLoopWorker`` (the LLM server the one stand-in, as in
``test_agent_loop.py``):

* a placeholder carries every reward key a success would, whether or not a success came first:
  with a loop that scores itself and no reward worker from verl, the keys come from
  ``+ledger.reward_keys``; without it the first failure is one ``ConfigError`` saying what to
  declare (never verl's ``KeyError`` at a later row, never keys dropped at row 0); a success
  whose keys differ from the declaration is refused too;
* the inner loop's class path is resolved, and the loop built, when the wrapper is built: a
  typo, an import error or a constructor that raises is one error naming the path, before any
  session is recorded;
* the trainer side's entry point checks the ledger's URL, driver and database before Ray starts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from sessions import Ledger
from sessions.errors import ConfigError
from tests.conftest import require_verl
from tests.integrations.verl import llm_server as llm

pytestmark = [pytest.mark.verl_env, pytest.mark.usefixtures("verl_installed")]

N = 4
PROMPTS = ["what is 1 + 1 ?", "what is 2 + 0 ?", "say 2", "two?"]
RUN = "agent-loop-test"
USER_LOOPS = "tests.integrations.verl.user_loops"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_verl()
    return llm.build_model_folder(tmp_path_factory.mktemp("tiny-policy"))


@pytest.fixture(autouse=True)
def fresh_process_state() -> Any:
    """A fresh worker process: no reward keys remembered, verl's own registry, no gate."""
    require_verl()
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    from sessions.integrations.verl.agent_loop import loop
    from tests.integrations.verl import user_loops

    loop._REWARD_KEYS.clear()
    registry = dict(_agent_loop_registry)
    yield
    _agent_loop_registry.clear()
    _agent_loop_registry.update(registry)
    user_loops.SUCCESS_GATE = None


def agent_loops(folder: Path, inner_agent: str) -> Path:
    """The user's agent-loop YAML: the shipped entries, and ``user_agent`` wrapping ``inner_agent``."""
    from sessions.integrations.verl.agent_loop import AGENT_LOOP_CONFIG

    path = folder / "agent_loops.yaml"
    path.write_text(
        Path(AGENT_LOOP_CONFIG).read_text()
        + "- name: user_agent\n"
        + "  _target_: sessions.integrations.verl.agent_loop.LedgerAgentLoop\n"
        + f"  inner_agent: {inner_agent}\n"
    )
    return path


def config(model: Path, url: str, yaml: Path, *overrides: str) -> Any:
    return llm.verl_config(
        model,
        [
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={yaml}",
            f"+ledger.url={url}",
            "+ledger.timeout=60",
            *overrides,
        ],
    )


async def generate(cfg: Any, model: Path, faults: dict[int, str], *, step: int) -> Any:
    """verl's ``generate_sequences`` with ``user_agent`` on every row, and no reward worker (the
    loop scores itself, or verl would score on the trainer)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    server = llm.TinyPolicyServer(model, faults, global_step=step)
    client = llm.llm_client(cfg, llm.InProcessHandle(server))
    worker = AgentLoopWorker(cfg, client, reward_loop_worker_handles=None)
    batch = llm.prompt_batch(PROMPTS, N, step=step, agent="user_agent")
    return await worker.generate_sequences(batch)


def placeholders(out: Any) -> list[int]:
    return [i for i, flag in enumerate(out.non_tensor_batch["is_placeholder"]) if flag is True]


async def sessions_recorded(url: str, step: int) -> float:
    from sessions.integrations.verl.agent_loop import close_process_ledgers

    await close_process_ledgers()
    async with Ledger.open(url, run=RUN) as ledger:
        await ledger.project()
        rows = {r.metric: r.value for r in await ledger.metrics("train", step)}
    return rows.get("sessions/total", 0)


def hold_successes_until_placeholders(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Every success waits until ``count`` placeholders are built (an injected hook in the
    wrapper, no clock): the failures come before any success, whatever the machine's load."""
    from sessions.integrations.verl.agent_loop import loop
    from tests.integrations.verl import user_loops

    gate = user_loops.SUCCESS_GATE = asyncio.Event()
    built = loop.placeholder_output
    made: list[Any] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(built(*args, **kwargs))
        if len(made) >= count:
            gate.set()
        return made[-1]

    monkeypatch.setattr(loop, "placeholder_output", counted)


# ------------------------------------------------------------------------- placeholder keys
async def test_declared_keys_reach_placeholders_at_row_0_and_later_before_any_success(
    model: Path, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    yaml = agent_loops(tmp_path, f"{USER_LOOPS}.SelfScoringLoop")
    cfg = config(model, db_url, yaml, "+ledger.reward_keys={acc: 0.0, pred: ''}")
    hold_successes_until_placeholders(monkeypatch, 2)
    out = await generate(cfg, model, {0: "crash", 6: "crash"}, step=1)
    assert placeholders(out) == [0, 6]
    assert out.meta_info["reward_extra_keys"] == ["acc", "pred"]  # from row 0, a placeholder
    for i in range(len(out)):
        acc, pred = out.non_tensor_batch["acc"][i], out.non_tensor_batch["pred"][i]
        if i in (0, 6):
            assert (acc, pred) == (0.0, "")
        else:
            assert acc in (0.0, 1.0) and isinstance(pred, str)
    assert out.batch["rm_scores"][[0, 6]].sum() == 0


async def test_every_row_failing_still_has_the_declared_keys(
    model: Path, sqlite_url: str, tmp_path: Path
) -> None:
    yaml = agent_loops(tmp_path, f"{USER_LOOPS}.SelfScoringLoop")
    cfg = config(model, sqlite_url, yaml, "+ledger.reward_keys={acc: 0.0, pred: ''}")
    out = await generate(cfg, model, dict.fromkeys(range(16), "crash"), step=2)
    assert placeholders(out) == list(range(16))
    assert out.meta_info["reward_extra_keys"] == ["acc", "pred"]
    assert list(out.non_tensor_batch["acc"]) == [0.0] * 16


async def test_undeclared_keys_of_a_self_scoring_loop_fail_loudly_at_the_first_failure(
    model: Path, sqlite_url: str, tmp_path: Path
) -> None:
    """Nothing can tell a failure before the first success which keys the loop's reward has:
    one error naming what to declare, instead of a batch without the keys (row 0) or verl's
    KeyError (a later row)."""
    yaml = agent_loops(tmp_path, f"{USER_LOOPS}.SelfScoringLoop")
    cfg = config(model, sqlite_url, yaml)
    with pytest.raises(ConfigError, match=r"\+ledger\.reward_keys=") as raised:
        await generate(cfg, model, dict.fromkeys(range(16), "crash"), step=3)
    assert "failed before any run of this worker" in str(raised.value)


async def test_verls_own_loop_without_a_reward_worker_needs_no_declaration(
    model: Path, sqlite_url: str, tmp_path: Path
) -> None:
    """verl's single-turn loop never scores itself: without a reward worker its rows are scored
    on the trainer, so a placeholder before any success rightly carries no reward keys."""
    yaml = agent_loops(
        tmp_path, "verl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop"
    )
    cfg = config(model, sqlite_url, yaml)
    out = await generate(cfg, model, {0: "crash", 6: "crash"}, step=4)
    assert placeholders(out) == [0, 6]
    assert "rm_scores" not in out.batch.keys()
    assert "acc" not in out.non_tensor_batch


async def test_a_success_whose_keys_differ_from_the_declaration_is_refused(
    model: Path, sqlite_url: str, tmp_path: Path
) -> None:
    yaml = agent_loops(tmp_path, f"{USER_LOOPS}.SelfScoringLoop")
    cfg = config(model, sqlite_url, yaml, "+ledger.reward_keys={acc: 0.0}")
    with pytest.raises(ConfigError, match=r"declares \['acc'\].*returned \['acc', 'pred'\]"):
        await generate(cfg, model, {}, step=5)


def test_reward_keys_must_be_a_mapping_of_plain_values(model: Path) -> None:
    from sessions.integrations.verl.agent_loop import LedgerSettings

    def settings(value: str) -> Any:
        cfg = llm.verl_config(model, [f"+ledger.reward_keys={value}"])
        return LedgerSettings.from_config(cfg, environ={"ROLLOUT_LEDGER_DB": "x.db"})

    assert settings("{acc: 0.0, pred: ''}").placeholder_reward_keys() == {"acc": 0.0, "pred": ""}
    assert settings("{}").placeholder_reward_keys() == {}
    assert settings("[]").placeholder_reward_keys() == {}
    with pytest.raises(ConfigError, match="must map each extra key"):
        settings("[acc,pred]")
    with pytest.raises(ConfigError, match=r"reward_keys\['acc'\] must be a number"):
        settings("{acc: [1]}")


# ------------------------------------------------------------------------- the inner loop
@pytest.mark.parametrize(
    "inner_agent, said",
    [
        pytest.param(f"{USER_LOOPS}.SelfScoringLoopp", "cannot import its class", id="typo"),
        pytest.param(
            "tests.integrations.verl.no_such_module.Loop", "cannot import its class", id="import"
        ),
        pytest.param(
            f"{USER_LOOPS}.BrokenConstructorLoop",
            "raised ValueError: JUDGE_API_KEY is not set",
            id="constructor",
        ),
        pytest.param("sessions.ledger.Ledger", "is not a verl agent loop", id="not-a-loop"),
    ],
)
async def test_a_wrong_inner_loop_is_one_error_naming_it_before_any_session(
    model: Path, sqlite_url: str, tmp_path: Path, inner_agent: str, said: str
) -> None:
    cfg = config(model, sqlite_url, agent_loops(tmp_path, inner_agent))
    with pytest.raises(Exception) as raised:  # noqa: PT011 - verl's hydra wraps the ConfigError
        await generate(cfg, model, {}, step=6)
    error: BaseException | None = raised.value
    while error is not None and not isinstance(error, ConfigError):
        error = error.__cause__
    assert isinstance(error, ConfigError), repr(raised.value)
    assert inner_agent in str(error) and said in str(error)
    assert inner_agent in str(raised.value)  # verl's own error shows it too
    assert await sessions_recorded(sqlite_url, 6) == 0


# ------------------------------------------------------------------------- the trainer side
def test_main_ppo_checks_the_ledger_before_ray_starts(model: Path, tmp_path: Path) -> None:
    from sessions.integrations.verl.main_ppo import check_ledger

    missing = tmp_path / "no-such-folder" / "ledger.db"
    with pytest.raises(ConfigError, match=r"\+ledger\.url.*cannot open the ledger"):
        check_ledger(llm.verl_config(model, [f"+ledger.url={missing}"]))
    with pytest.raises(ConfigError, match=r"\+ledger\.url.*not a database URL"):
        check_ledger(llm.verl_config(model, ["+ledger.url=mysql://host/db"]))
    with pytest.raises(ConfigError, match="cannot reach|cannot open the ledger"):
        check_ledger(llm.verl_config(model, ["+ledger.url=postgresql://127.0.0.1:1/test"]))
    good = tmp_path / "ledger.db"
    settings = check_ledger(llm.verl_config(model, [f"+ledger.url={good}"]))
    assert settings.url == str(good) and good.exists()  # created and migrated before Ray


@pytest.mark.parametrize(
    "inner_agent, said",
    [
        pytest.param(f"{USER_LOOPS}.SelfScoringLoopp", "cannot import its class", id="typo"),
        pytest.param("sessions.ledger.Ledger", "is not a verl agent loop", id="not-a-loop"),
        pytest.param("my_agent", "is not a registered agent loop", id="unknown-name"),
    ],
)
def test_main_ppo_checks_the_inner_loops_before_ray_starts(
    model: Path, tmp_path: Path, inner_agent: str, said: str
) -> None:
    from sessions.integrations.verl.main_ppo import check_agent_loops

    yaml = agent_loops(tmp_path, inner_agent)
    cfg = llm.verl_config(model, [f"actor_rollout_ref.rollout.agent.agent_loop_config_path={yaml}"])
    with pytest.raises(ConfigError, match=said) as raised:
        check_agent_loops(cfg)
    assert repr(inner_agent) in str(raised.value)


def test_main_ppo_accepts_the_shipped_and_a_users_agent_loops(model: Path, tmp_path: Path) -> None:
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    from sessions.integrations.verl.main_ppo import check_agent_loops

    before = dict(_agent_loop_registry)
    yaml = agent_loops(tmp_path, f"{USER_LOOPS}.SelfScoringLoop")
    cfg = llm.verl_config(model, [f"actor_rollout_ref.rollout.agent.agent_loop_config_path={yaml}"])
    assert check_agent_loops(cfg) == 5  # the four shipped ledger entries and the user's
    assert dict(_agent_loop_registry) == before  # the driver's registry is left as it was
    missing = f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path / 'none.yaml'}"
    with pytest.raises(ConfigError, match="cannot be read"):
        check_agent_loops(llm.verl_config(model, [missing]))


def test_the_entry_point_implies_v0_and_the_ledgers_agent_loops(model: Path) -> None:
    """What cuts `trainer.use_v1=false` and `agent_loop_config_path=...` from the command."""
    from sessions.integrations.verl.agent_loop import AGENT_LOOP_CONFIG
    from sessions.integrations.verl.main_ppo import apply_ledger_defaults

    cfg = llm.verl_config(model)
    assert cfg.trainer.use_v1 is True  # verl 0.9.1's default
    apply_ledger_defaults(cfg, ["+ledger.url=x.db"])
    assert cfg.trainer.use_v1 is False
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path == AGENT_LOOP_CONFIG
    mine = "actor_rollout_ref.rollout.agent.agent_loop_config_path=/my/loops.yaml"
    cfg = llm.verl_config(model, ["trainer.use_v1=false", mine])
    apply_ledger_defaults(cfg, ["trainer.use_v1=false", mine])
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path == "/my/loops.yaml"
    cfg = llm.verl_config(model, ["trainer.use_v1=true"])
    with pytest.raises(ConfigError, match="trainer.use_v1=true"):
        apply_ledger_defaults(cfg, ["trainer.use_v1=true"])


def test_the_documented_command_stops_at_a_wrong_database_before_ray(tmp_path: Path) -> None:
    """`python -m sessions.integrations.verl.main_ppo +ledger.url=...` (docs/verl.md's command,
    nothing else): a database nobody answers at is one error naming `+ledger.url`, before Ray
    starts or verl reads its data."""
    import subprocess
    import sys

    from tests import REPO

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sessions.integrations.verl.main_ppo",
            "+ledger.url=postgresql://127.0.0.1:1/rollouts",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
        timeout=600,
    )
    assert done.returncode != 0
    assert "+ledger.url (or $ROLLOUT_LEDGER_DB): cannot open the ledger" in done.stderr, done.stderr
    assert "ConnectionRefusedError" in done.stderr
    assert "ray.init" not in done.stderr and "Started a local Ray instance" not in done.stderr


def documented_commands(folder: Path) -> list[list[str]]:
    """The commands of docs/verl.md's setup section, as a shell would run them: `$PWD` is
    `folder`, and `$(python -m sessions.integrations.verl.agent_loop)` what that command prints."""
    import re
    import shlex
    import subprocess
    import sys

    from tests import REPO

    text = (REPO / "docs" / "verl.md").read_text(encoding="utf-8")
    section = text.split("## The setup, counted", 1)[1].split("\n## ", 1)[0]
    printed = subprocess.run(
        [sys.executable, "-m", "sessions.integrations.verl.agent_loop"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout.strip()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        line = block.replace("\\\n", " ").replace("$PWD", str(folder))
        line = line.replace("$(python -m sessions.integrations.verl.agent_loop)", printed)
        commands.append(shlex.split(line))
    return commands


def test_the_setup_sections_commands_compose_and_open_their_ledger(tmp_path: Path) -> None:
    """Each command of docs/verl.md's setup, as printed: verl's own Hydra composes its overrides,
    the entry point's defaults and start checks pass, and the named SQLite ledger is created."""
    import os

    from hydra import compose, initialize_config_dir
    from verl.trainer import main_ppo as verl_main_ppo

    from sessions.integrations.verl.agent_loop import AGENT_LOOP_CONFIG, LedgerSettings
    from sessions.integrations.verl.main_ppo import (
        apply_ledger_defaults,
        check_agent_loops,
        check_ledger,
    )

    commands = documented_commands(tmp_path)
    assert [c[:3] for c in commands] == [
        ["python", "-m", "sessions.integrations.verl.main_ppo"],
        ["python", "-m", "verl.trainer.main_ppo"],
    ]
    config_dir = os.path.join(os.path.dirname(verl_main_ppo.__file__), "config")
    for command in commands:
        overrides = command[3:]
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name="ppo_trainer", overrides=overrides)
        if command[2] == "sessions.integrations.verl.main_ppo":
            apply_ledger_defaults(cfg, overrides)
            assert cfg.trainer.use_v1 is False
            assert check_agent_loops(cfg) == 4  # the shipped YAML's ledger entries
            settings = check_ledger(cfg)
        else:
            settings = LedgerSettings.from_config(cfg, environ={})
        assert cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path == AGENT_LOOP_CONFIG
        assert settings.url == str(tmp_path / "rollouts.db")
    assert (tmp_path / "rollouts.db").exists()
