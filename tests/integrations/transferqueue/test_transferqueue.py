"""TransferQueue adapter against a real TransferQueue (Ray + controller + one storage unit).

One module-scoped fixture starts TransferQueue once (tens of seconds, ~1.5 GiB of Ray processes)
and checks on teardown that no Ray process of ours is left. A demo run is recorded and projected
with a `TransferQueueSink`; every row is read back with `kv_batch_get`, densified, and compared
with `Ledger.batch` from the durable queue.

Without the `transferqueue` extra the module is skipped on a developer machine and fails in CI
(CI=true): CI must never pass by skipping it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from sessions.integrations.transferqueue import set_tq_num_threads
from tests import REPO

set_tq_num_threads()  # before transfer_queue is imported: it reads TQ_NUM_THREADS once, at import

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
if IN_CI:
    try:
        import transfer_queue  # noqa: F401
    except ImportError as error:  # pragma: no cover - only on a misconfigured CI
        pytest.fail(
            f"CI must run the TransferQueue tests, but transfer_queue does not import ({error}); "
            "install the extra: pip install -e '.[test,transferqueue]'",
            pytrace=False,
        )
else:
    pytest.importorskip("transfer_queue")

import torch  # noqa: E402

from sessions import Ledger  # noqa: E402
from sessions.batches import non_tensor  # noqa: E402
from sessions.batches.columns import UNKNOWN_TURNS  # noqa: E402
from sessions.cli.demo import DemoConfig, run_demo  # noqa: E402
from sessions.integrations.transferqueue import (  # noqa: E402
    RAY_LOOPBACK_ENV,
    TransferQueueHandle,
    TransferQueueSink,
    TransferQueueSinkError,
    TransferQueueStartError,
    TransferQueueTimeout,
    aread_rows,
    import_transfer_queue,
    list_partition,
    read_rows,
    row_keys,
    start_transferqueue,
)
from sessions.queues.sinks import QueueItem  # noqa: E402
from store import read_models as rm  # noqa: E402

PARTITIONS = ("train", "val")
DEMO = DemoConfig(steps=1, prompts=4, group_size=2, fail_rate=0.3, cancel_rate=0.0, seed=5)
COMPARED = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rm_scores",
    "rollout_log_probs",
    "prompt_length",
    "response_length",
    "is_placeholder",
    "num_turns",
)
ROW_TAGS = (
    "status",
    "global_steps",
    "prompt_len",
    "response_len",
    "seq_len",
    "uid",
    "materialization_reason",
    "is_placeholder",
)


def test_our_tests_package_is_the_one_imported() -> None:
    """The TransferQueue wheel installs a top-level `tests`; ours (with __init__.py) must win."""
    import tests

    assert tests.__file__ is not None, "a namespace package `tests` (TransferQueue's) shadows ours"
    assert Path(tests.__file__).resolve() == (REPO / "tests" / "__init__.py").resolve()


def test_start_refuses_more_storage_units_than_cpus_before_starting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init must not run"))
    env_before = {name: os.environ.get(name) for name in RAY_LOOPBACK_ENV}
    with pytest.raises(ValueError, match="2 storage unit.*3 CPUs, Ray has 2"):
        start_transferqueue(num_cpus=2, storage_units=2)
    assert {name: os.environ.get(name) for name in RAY_LOOPBACK_ENV} == env_before


# ------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------


def _our_ray_processes() -> list[str]:
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            line = " ".join(child.cmdline()) or child.name()
        except psutil.Error:
            continue
        if "/ray/" in line or line.startswith("ray::"):
            found.append(f"{child.pid}: {line[:100]}")
    return found


@pytest.fixture(scope="module")
def tq() -> Iterator[TransferQueueHandle]:
    started = time.monotonic()
    handle = start_transferqueue(timeout_s=150)
    print(
        f"\nTransferQueue up in {time.monotonic() - started:.1f}s ({handle.ray_cpus} Ray CPUs, {handle.storage_units} storage unit)"
    )
    try:
        yield handle
    finally:
        handle.close()
        deadline = time.monotonic() + 15
        while _our_ray_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _our_ray_processes(), f"Ray processes left running: {_our_ray_processes()}"


class RecordingSink:
    """Forwards to the TransferQueue sink and keeps every item it was given, in order."""

    def __init__(self, inner: TransferQueueSink) -> None:
        self.inner = inner
        self.items: list[QueueItem] = []

    async def put(self, items: Sequence[QueueItem]) -> None:
        await self.inner.put(items)
        self.items.extend(items)


class CallLog:
    """A pass-through to the real `transfer_queue` module that logs (and can fail or stall) puts."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls: list[tuple[str, list[str], bool]] = []
        self.fail_with: BaseException | None = None
        self.stall_s: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    async def async_kv_batch_put(
        self, *, keys: list[str], partition_id: str, fields: Any = None, tags: Any = None
    ) -> Any:
        if self.fail_with is not None:
            raise self.fail_with
        if self.stall_s is not None:
            await asyncio.sleep(self.stall_s)
        self.calls.append((partition_id, list(keys), fields is not None))
        return await self.real.async_kv_batch_put(
            keys=keys, partition_id=partition_id, fields=fields, tags=tags
        )


@dataclasses.dataclass
class Projected:
    url: str
    run: str
    uid_prefix: str
    sink: TransferQueueSink
    calls: CallLog
    items: list[QueueItem]
    batches: dict[str, Any]
    num_turns: dict[str, int]  # durable queue's num_turns by row key
    threads_before: int


def _uids(prefix: str, partition: str, config: DemoConfig) -> list[str]:
    return [
        f"{prefix}-{partition}{step}-p{p}"
        for step in range(config.steps)
        for p in range(config.prompts)
    ]


@pytest.fixture(scope="module")
def projected(tq: TransferQueueHandle, tmp_path_factory: pytest.TempPathFactory) -> Projected:
    """The demo log recorded, pre-registered in TQ like verl's replay buffer does, then projected."""
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('tq') / 'ledger.db'}"
    run = "tqdemo"
    tqm = import_transfer_queue()
    for partition in PARTITIONS:  # the trainer registers prompts before rollouts start
        uids = _uids(run, partition, DEMO)
        tqm.kv_batch_put(
            keys=uids,
            partition_id=partition,
            tags=[
                {
                    "is_prompt": True,
                    "status": "pending",
                    "global_steps": 0,
                    "registered_by": "trainer",
                }
                for _ in uids
            ],
        )
    sink = TransferQueueSink(timeout_s=30)
    calls = CallLog(sink._tq)
    sink._tq = calls
    recording = RecordingSink(sink)
    threads_before = torch.get_num_threads()

    async def main() -> tuple[dict[str, Any], dict[str, int]]:
        async with Ledger.open(url, run=run, sinks=[recording]) as ledger:
            await run_demo(ledger, DEMO)
            await ledger.project()
            batches = {
                partition: await ledger.batch(partition, 0, timeout=30) for partition in PARTITIONS
            }
            async with ledger.engine.connect() as conn:
                queued = [q for p in PARTITIONS for q in await rm.queue_rows_for(conn, run, p, 0)]
            return batches, {q["key"]: q["num_turns"] for q in queued}

    batches, num_turns = asyncio.run(main())
    return Projected(
        url, run, run, sink, calls, recording.items, batches, num_turns, threads_before
    )


def _our_listing(partition: str, prefix: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in list_partition(partition).items() if k.startswith(prefix + "-")}


# ------------------------------------------------------------------------------------------
# the projected demo, read back
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("partition", PARTITIONS)
def test_rows_read_back_equal_the_durable_batch(projected: Projected, partition: str) -> None:
    batch = projected.batches[partition]
    keys = non_tensor(batch, "key")
    assert keys, "the demo projected no rows"
    listing = _our_listing(partition, projected.uid_prefix)
    assert sorted(row_keys(listing)) == sorted(keys), "TransferQueue holds exactly the batch's rows"

    got = read_rows(partition, keys)  # kv_batch_get, densified
    assert got.batch_size == batch.batch_size
    assert non_tensor(got, "key") == keys
    for name in COMPARED:
        expected, actual = batch.get(name), got.get(name)
        assert actual.dtype == expected.dtype, name
        assert torch.equal(actual, expected), name
    assert got.get("loss_mask").dtype == torch.int64
    assert torch.equal(got.get("loss_mask"), batch.get("response_mask"))
    for name in (
        "session_id",
        "session_index",
        "data_source",
        "run",
        "partition",
        "global_step",
        "failure_reason",
        "materialization_reason",
        "__num_turns__",
        "multi_modal_inputs",
    ):
        assert non_tensor(got, name) == non_tensor(batch, name), name
    assert non_tensor(got, "global_steps") == [0] * len(keys)
    # uid: the prompt's in group_uid; in uid too, but a train placeholder's own ({uid}-ph{index}),
    # so verl V1's stock GRPO (grouping by this field) keeps it out of its siblings' baseline
    uids, placeholders = non_tensor(batch, "uid"), batch.get("is_placeholder").tolist()
    assert non_tensor(got, "group_uid") == uids
    isolate = partition == "train"
    assert non_tensor(got, "uid") == [
        f"{u}-ph{i}" if isolate and p else u
        for u, i, p in zip(uids, non_tensor(batch, "session_index"), placeholders)
    ]
    if isolate:
        assert any(placeholders), (
            "the demo projected no train placeholder: the isolation check checked nothing"
        )


async def test_async_read_in_any_key_order(projected: Projected) -> None:
    batch = projected.batches["val"]
    keys = non_tensor(batch, "key")[::-1]
    got = await aread_rows("val", keys)
    assert non_tensor(got, "key") == keys
    order = torch.arange(len(keys) - 1, -1, -1)
    for name in ("input_ids", "rm_scores", "response_mask"):
        assert torch.equal(got.get(name), batch.get(name)[order]), name


def test_failed_sessions_arrive_as_placeholders(projected: Projected) -> None:
    seen = 0
    for partition in PARTITIONS:
        batch = projected.batches[partition]
        keys = non_tensor(batch, "key")
        got = read_rows(partition, keys)
        raw = import_transfer_queue().kv_batch_get(keys=keys, partition_id=partition)
        listing = _our_listing(partition, projected.uid_prefix)
        for i, key in enumerate(keys):
            if not bool(got.get("is_placeholder")[i]):
                continue
            seen += 1
            assert key.endswith("_0")
            assert int(got.get("prompt_length")[i]) == 1 and int(got.get("response_length")[i]) == 1
            assert raw.get("responses")[i].tolist() == [raw.get("prompts")[i].item()]
            assert raw.get("response_mask")[i].tolist() == [0]
            assert raw.get("attention_mask")[i].tolist() == [1, 1]
            assert raw.get("rm_scores")[i].tolist() == [0.0]
            assert raw.get("rollout_log_probs")[i].tolist() == [0.0]
            assert int(raw.get("num_turns")[i]) == 0
            assert int(got.get("response_mask")[i].sum()) == 0
            assert non_tensor(got, "materialization_reason")[i] == "session_failed"
            assert non_tensor(got, "failure_reason")[i] is not None
            tags = listing[key]
            assert (
                tags["is_placeholder"] is True
                and tags["materialization_reason"] == "session_failed"
            )
            assert (tags["prompt_len"], tags["response_len"], tags["seq_len"]) == (1, 1, 2)
    assert seen > 0, "the demo seed produced no failed session; pick another seed"


def test_row_tags_and_raw_row_layout(projected: Projected) -> None:
    for partition in PARTITIONS:
        batch = projected.batches[partition]
        keys = non_tensor(batch, "key")
        listing = _our_listing(partition, projected.uid_prefix)
        raw = import_transfer_queue().kv_batch_get(keys=keys, partition_id=partition)
        for name in (
            "prompts",
            "responses",
            "input_ids",
            "attention_mask",
            "position_ids",
            "response_mask",
            "loss_mask",
        ):
            value = raw.get(name)
            assert (
                value.is_nested and value.layout == torch.jagged and value.dtype == torch.int64
            ), name
        for name in ("rm_scores", "rollout_log_probs"):
            assert raw.get(name).dtype == torch.float32, name
        assert (
            raw.get("num_turns").shape == (len(keys),) and raw.get("num_turns").dtype == torch.int64
        )
        assert (
            "__num_turns__" not in raw.keys() and "multi_modal_inputs" not in raw.keys()
        )  # read_rows adds them
        for i, key in enumerate(keys):
            uid, session_index, index = key.rsplit("_", 2)
            assert (
                non_tensor(batch, "uid")[i] == uid
                and int(session_index) == non_tensor(batch, "session_index")[i]
            )
            tags = listing[key]
            assert set(ROW_TAGS) <= set(tags), tags
            p, r = int(batch.get("prompt_length")[i]), int(batch.get("response_length")[i])
            assert tags["status"] == "finished" and tags["uid"] == uid
            assert tags["global_steps"] == tags["min_global_steps"] == tags["max_global_steps"] == 0
            assert (tags["prompt_len"], tags["response_len"], tags["seq_len"]) == (p, r, p + r)
            assert tags["is_placeholder"] == bool(batch.get("is_placeholder")[i])
            assert raw.get("rm_scores")[i][-1].item() == batch.get("rm_scores")[i].sum().item()
            assert raw.get("position_ids")[i].tolist() == list(range(p + r))
            # every queue row carries its num_turns (a placeholder's is 0), so TransferQueue holds
            # the durable queue's own, never the "unknown" marker
            assert projected.num_turns[key] != UNKNOWN_TURNS
            assert int(raw.get("num_turns")[i]) == projected.num_turns[key], key


def test_group_tags_merge_into_the_registered_prompt_keys(projected: Projected) -> None:
    for partition in PARTITIONS:
        batch = projected.batches[partition]
        real = {
            uid
            for uid, ph in zip(non_tensor(batch, "uid"), batch.get("is_placeholder").tolist())
            if not ph
        }
        listing = _our_listing(partition, projected.uid_prefix)
        for uid in _uids(projected.run, partition, DEMO):
            tags = listing[uid]
            assert tags["status"] == ("finished" if uid in real else "failure"), (uid, tags)
            assert tags["is_prompt"] is True and tags["global_steps"] == 0
            assert tags["registered_by"] == "trainer", (
                "TransferQueue must merge tags, not replace them"
            )


def test_each_group_tag_is_put_after_its_rows(projected: Projected) -> None:
    row_call: dict[tuple[str, str], int] = {}
    for n, (partition, keys, has_fields) in enumerate(projected.calls.calls):
        for key in keys:
            if has_fields:
                row_call[(partition, key.rsplit("_", 2)[0])] = n
            else:
                assert row_call[(partition, key)] < n, f"group tag {key} put before its rows"
    tag_items = [i for i, item in enumerate(projected.items) if item.is_tag]
    assert len(tag_items) == DEMO.prompts * DEMO.steps * len(PARTITIONS)


def test_puts_leave_torch_threads_alone(projected: Projected) -> None:
    read_rows("train", non_tensor(projected.batches["train"], "key"))
    assert torch.get_num_threads() == projected.threads_before


async def test_re_put_replaces_and_never_duplicates(projected: Projected) -> None:
    before = {p: _our_listing(p, projected.uid_prefix) for p in PARTITIONS}
    first = {p: read_rows(p, non_tensor(projected.batches[p], "key")) for p in PARTITIONS}

    await projected.sink.put(projected.items)  # the whole projection again, as after a crash
    for partition in PARTITIONS:
        assert _our_listing(partition, projected.uid_prefix) == before[partition]
        again = read_rows(partition, non_tensor(projected.batches[partition], "key"))
        for name in COMPARED:
            assert torch.equal(again.get(name), first[partition].get(name)), name

    item = next(i for i in projected.items if not i.is_tag and not i.row.is_placeholder)
    changed = dataclasses.replace(item, row=dataclasses.replace(item.row, reward=0.25))
    await projected.sink.put([changed])
    try:
        assert (
            _our_listing(item.partition, projected.uid_prefix).keys()
            == before[item.partition].keys()
        )
        got = read_rows(item.partition, [item.key])
        r = int(got.get("response_length")[0])
        assert got.get("rm_scores")[0, r - 1].item() == 0.25
    finally:
        await projected.sink.put([item])


# ------------------------------------------------------------------------------------------
# failures keep the checkpoint
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["error", "timeout"])
async def test_a_failing_put_keeps_the_checkpoint_and_a_retry_succeeds(
    tq: TransferQueueHandle, tmp_path: Path, failure: str
) -> None:
    run = f"tqfail{failure}"
    sink = TransferQueueSink(timeout_s=0.5)
    calls = CallLog(sink._tq)
    sink._tq = calls
    if failure == "error":
        calls.fail_with = ConnectionError("storage unit unreachable")
    else:
        calls.stall_s = 5.0
    config = DemoConfig(steps=1, prompts=2, group_size=2, fail_rate=0.0, cancel_rate=0.0, seed=3)
    async with Ledger.open(
        f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}", run=run, sinks=[sink]
    ) as ledger:
        await run_demo(ledger, config)
        async with ledger.engine.connect() as conn:
            checkpoint = await rm.get_checkpoint(conn)
        expected = TransferQueueTimeout if failure == "timeout" else TransferQueueSinkError
        with pytest.raises(expected) as raised:
            await ledger.project()
        if failure == "timeout":
            assert isinstance(raised.value, TimeoutError)
        else:
            assert isinstance(raised.value.__cause__, ConnectionError)
        async with ledger.engine.connect() as conn:
            assert await rm.get_checkpoint(conn) == checkpoint
            assert await rm.queue_rows_for(conn, run, "train", 0) == []
        assert not _our_listing("train", run), "nothing reached TransferQueue"

        calls.fail_with, calls.stall_s = None, None  # TransferQueue is back
        # The 0.5 s bound was for the stalled put above; the retry is a real put, which on a
        # loaded machine (xdist workers beside Ray) can take longer than that.
        sink.timeout_s = 60.0
        assert await ledger.project() > 0
        async with ledger.engine.connect() as conn:
            assert await rm.get_checkpoint(conn) > checkpoint
        for partition in PARTITIONS:
            batch = await ledger.batch(partition, 0, timeout=10)
            keys = non_tensor(batch, "key")
            assert len(keys) == config.prompts * config.group_size
            assert sorted(row_keys(_our_listing(partition, run))) == sorted(keys)
            got = await aread_rows(partition, keys)
            for name in COMPARED:
                assert torch.equal(got.get(name), batch.get(name)), name


def test_start_refuses_a_second_transferqueue_in_the_same_cluster(projected: Projected) -> None:
    with pytest.raises(TransferQueueStartError, match="already runs"):
        start_transferqueue()
    keys = non_tensor(projected.batches["val"], "key")
    assert read_rows("val", keys).batch_size[0] == len(keys), (
        "the running TransferQueue is untouched"
    )
