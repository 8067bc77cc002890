"""verl's step metrics computed from a step's rows, and the ledger's own under a prefix of theirs.

docs/design.md §7: a figure that carries verl's name must be the one verl computes on the same batch. verl
0.9.1 reports validation through `process_validation_metrics` + `RayPPOTrainer._val_metrics_update`
and training through `compute_data_metrics`; the functions here take the step's batch rows as
plain sequences (data source, uid, score, lengths, turns) and give the same flat dict, under the
same names, so a verl job logs them with `Tracking.log(data=..., step=...)` without running verl's
validation loop. numpy only: nothing here imports verl, torch or the database, which is why it
sits in `projection/` beside the ledger's own metrics and not in the verl adapter:
`Ledger.metrics_dict` uses it, and the ledger imports no adapter.

Written from verl's algorithm, checked key for key against verl's own code in
tests/projection/test_verl_metrics.py:

* validation: the rows grouped by (data source, uid); per uid with k rows `mean@k`, `std@k`
  (k > 1) and, for each n of 2, 4, 8, ... below k and k itself, bootstrapped `best@n` / `worst@n`
  (mean and std of the max / min over 1000 resamples of n of the uid's scores, the resample drawn
  as `np.random.seed(42)` then `np.random.choice(k, (1000, n))` would draw it); each metric name is
  then averaged over the uids that have it. `val-core` holds the `mean` and `best` figures at the
  data source's largest k (verl's headline), `val-aux` the rest. A uid with fewer rows than the
  largest k is left out of the headline, exactly as in verl.
* scores are rounded to float32 first: the batch holds them in `rm_scores` (float32), and verl
  reads `rm_scores.sum(-1)` (`as_float32=False` keeps them as given).
* training: the figures of `compute_data_metrics` that depend on scores and lengths alone, in
  float32 as verl's tensors give them (the float64 value rounded once).

The ledger's own figures (`sessions.projection.metrics`) go under `ledger/...`, so one dict holds
both and no name of verl's is ever given a value verl would not compute.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from sessions import vocabulary
from sessions.errors import InvalidArgument
from sessions.vocabulary import ALL_SOURCES

__all__ = [
    "LEDGER_PREFIX",
    "data_metrics",
    "ledger_metrics",
    "metrics_dict",
    "off_policy_metrics",
    "validation_metrics",
]

#: The prefix of the ledger's own figures in a tracker's dict.
LEDGER_PREFIX = "ledger"
#: verl's bootstrap: resamples per (uid, n) and the seed it draws them with.
N_BOOTSTRAP, SEED = 1000, 42
#: Elements of one vectorised bootstrap block (uids x resamples x n): bounds memory, not results.
_BLOCK = 1 << 22


def validation_metrics(
    data_sources: Sequence[Any],
    uids: Sequence[Any],
    scores: Sequence[float],
    num_turns: Sequence[int] | None = None,
    *,
    seed: int = SEED,
    n_bootstrap: int = N_BOOTSTRAP,
    as_float32: bool = True,
) -> dict[str, float]:
    """verl's `_val_metrics_update(process_validation_metrics(...))` for the variable `reward`.

    One entry per batch row in each sequence (a placeholder is a row with score 0; cancelled and
    dropped sessions have none). `num_turns` adds `val-aux/num_turns/min|max|mean` (verl reads
    them from `__num_turns__`). A data source is spelt as verl spells it, `f"{data_source}"`.
    """
    _same_length(
        data_sources=data_sources,
        uids=uids,
        scores=scores,
        **({} if num_turns is None else {"num_turns": num_turns}),
    )
    values = _scores(scores, as_float32)
    out: dict[str, float] = {}
    by_source: dict[Any, dict[Any, list[float]]] = {}
    for source, uid, value in zip(data_sources, uids, values.tolist()):
        by_source.setdefault(source, {}).setdefault(uid, []).append(value)
    for source, by_uid in by_source.items():
        per_metric = _per_uid_metrics(list(by_uid.values()), seed, n_bootstrap)
        n_max = max(int(name.split("@")[-1].split("/")[0]) for name in per_metric)
        for name, uid_values in per_metric.items():
            core = (
                name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
            )  # verl's test, verbatim in effect
            out[f"{'val-core' if core else 'val-aux'}/{source}/reward/{name}"] = float(
                np.mean(uid_values)
            )
    if num_turns is not None and len(num_turns):
        turns = np.asarray(num_turns)
        out["val-aux/num_turns/min"] = float(turns.min())
        out["val-aux/num_turns/max"] = float(turns.max())
        out["val-aux/num_turns/mean"] = float(turns.mean())
    return out


def data_metrics(
    scores: Sequence[float],
    prompt_lengths: Sequence[float],
    response_lengths: Sequence[float],
    num_turns: Sequence[int] | None = None,
    *,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
) -> dict[str, float]:
    """The batch-only figures of verl's `compute_data_metrics`: `critic/score/*` over the rows with
    a response (verl calls the others aborted), `response_length/*`, `response_length_non_aborted/*`,
    `response/aborted_ratio`, `prompt_length/*` and, given `num_turns`, `num_turns/*`.

    `max_*_length` are the batch's padded widths (its `prompts` / `responses` columns), which the
    clip ratios compare with; by default the longest row, as a batch padded to its own rows has.
    `critic/rewards/*`, advantages, returns and values depend on the trainer, not on the rows.
    """
    _same_length(
        scores=scores,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        **({} if num_turns is None else {"num_turns": num_turns}),
    )
    if not len(scores):
        return {}
    score = _scores(scores, True)
    prompt = np.asarray(prompt_lengths, dtype=np.float32).astype(np.float64)
    response = np.asarray(response_lengths, dtype=np.float32).astype(np.float64)
    p_width = prompt.max() if max_prompt_length is None else float(max_prompt_length)
    r_width = response.max() if max_response_length is None else float(max_response_length)
    aborted = response == 0
    kept = ~aborted
    out: dict[str, float] = {}
    out.update(_stats("critic/score", score[kept]))
    out.update(_stats("response_length", response))
    out["response_length/clip_ratio"] = _f32(np.mean(response == r_width))
    out.update(_stats("response_length_non_aborted", response[kept]))
    out["response_length_non_aborted/clip_ratio"] = (
        _f32(np.mean(response[kept] == r_width)) if kept.any() else float("nan")
    )
    out["response/aborted_ratio"] = _f32(np.mean(aborted))
    out.update(_stats("prompt_length", prompt))
    out["prompt_length/clip_ratio"] = _f32(np.mean(prompt == p_width))
    if num_turns is not None:
        turns = np.asarray(num_turns)
        out["num_turns/min"], out["num_turns/max"], out["num_turns/mean"] = (
            float(turns.min()),
            float(turns.max()),
            float(turns.mean()),
        )
    return out


def ledger_metrics(
    rows: Iterable[Any], *, prefix: str = LEDGER_PREFIX, all_sources: str = ALL_SOURCES
) -> dict[str, float]:
    """The ledger's metric rows (`sessions.projection.metrics.MetricRow`, as `Ledger.metrics`
    returns them) of one step as `{prefix}/{partition}/{data_source or all_sources}/{metric}`.

    Refuses rows of several runs or steps (their keys would collide in one tracker step) and a data
    source spelt like the all-sources label: by default the vocabulary's reserved `all` (refused
    when a session is created, so only a log recorded before that holds one: pass another label
    to read it), else the label given."""
    out: dict[str, float] = {}
    steps: set[tuple[str, Any]] = set()
    for row in rows:
        steps.add((row.run, row.global_step))
        if row.data_source is not None:
            vocabulary.check_label(row.data_source, "data_source")
            if row.data_source == all_sources:
                vocabulary.check_data_source(row.data_source)  # `all`: the vocabulary's refusal
                raise InvalidArgument(
                    f"a data source is named {all_sources!r}, the all_sources= label given; "
                    "pass another label",
                    argument="all_sources",
                )
        source = all_sources if row.data_source is None else row.data_source
        out[f"{prefix}/{row.partition}/{source}/{row.metric}"] = float(row.value)
    if len(steps) > 1:
        raise InvalidArgument(
            f"metric rows of {len(steps)} (run, global_step) pairs {sorted(steps, key=repr)}: "
            "pass the rows of one step (Ledger.metrics(partition, step, run=...))"
        )
    return out


def metrics_dict(
    partition: str,
    queue_rows: Iterable[Mapping[str, Any]],
    metric_rows: Iterable[Any],
    *,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
) -> dict[str, float]:
    """One tracker dict for a step: verl's figures from its queue rows (`val`: validation metrics,
    `train`: `data_metrics`, the widths passed on) and the ledger's own under `ledger/`. Queue rows
    are the read model's (`store.read_models.queue_rows_for`); only those of kind `row` are batch
    rows."""
    vocabulary.check_partition(partition)
    rows = [q for q in queue_rows if q.get("kind", "row") == "row"]
    if partition == "val":
        verl = validation_metrics(
            [q["data_source"] for q in rows],
            [q["uid"] for q in rows],
            [q["reward"] for q in rows],
            [q["num_turns"] for q in rows],
        )
    else:
        verl = data_metrics(
            [q["reward"] for q in rows],
            [q["prompt_len"] for q in rows],
            [q["response_len"] for q in rows],
            [q["num_turns"] for q in rows],
            max_prompt_length=max_prompt_length,
            max_response_length=max_response_length,
        )
    out = {**verl, **ledger_metrics(metric_rows)}
    step = rows[0].get("global_step") if rows else None
    if partition == "train" and step is not None:
        out.update(
            off_policy_metrics(
                int(step),
                [q.get("min_global_steps") for q in rows],
                [q.get("max_global_steps") for q in rows],
            )
        )
    return out


def off_policy_metrics(
    global_step: int,
    min_versions: Sequence[int | None],
    max_versions: Sequence[int | None],
) -> dict[str, float]:
    """verl V1's staleness figures (`training/off_policy/...`, from `PPOTrainer._compute_metrics`)
    over the rows whose weights versions are known, and the ledger's count of them and of those
    that spanned a weight update (`ledger/train/all/off_policy/...`). Placeholders and rows
    recorded without versions have none and are left out, where verl would have no such row.
    `global_step` is the step the batch trains (verl's `global_steps`: weights version
    `global_step - 1` is the current policy). Empty when no row has versions."""
    known = [
        (int(low), int(high))
        for low, high in zip(min_versions, max_versions)
        if low is not None and high is not None
    ]
    if not known:
        return {}
    low = np.array([k[0] for k in known], dtype=int)
    high = np.array([k[1] for k in known], dtype=int)
    spans = high - low + 1
    figures = {
        "trajectory_spans": spans,
        "trajectory_staleness": (global_step - 1) - high,
        "trajectory_staleness_worst": (global_step - 1) - low,
    }
    out: dict[str, float] = {}
    for name, values in figures.items():
        for stat in ("mean", "max", "min"):
            out[f"training/off_policy/{name}/{stat}"] = float(getattr(values, stat)())
    prefix = f"{LEDGER_PREFIX}/train/{ALL_SOURCES}/off_policy"
    out[f"{prefix}/rows_with_versions"] = float(len(known))
    out[f"{prefix}/rows_spanning_updates"] = float(int((spans > 1).sum()))
    return out


# ------------------------------------------------------------------ validation internals
def _per_uid_metrics(
    groups: list[list[float]], seed: int, n_bootstrap: int
) -> dict[str, list[float]]:
    """metric name -> its value for each uid that has it, uids in order of first appearance
    (verl's order, so its averages sum in the same order)."""
    per_uid: list[dict[str, float]] = [{} for _ in groups]
    by_k: dict[int, list[int]] = {}
    for i, values in enumerate(groups):
        by_k.setdefault(len(values), []).append(i)
    for k, members in by_k.items():
        block = np.array([groups[i] for i in members], dtype=np.float64)  # [uids, k]
        for j, i in enumerate(members):
            per_uid[i][f"mean@{k}"] = float(np.mean(block[j]))
            if k > 1:
                per_uid[i][f"std@{k}"] = float(np.std(block[j]))
        for n in _gen_ns(k):
            best, worst = _bootstrap(block, n, seed, n_bootstrap)
            for j, i in enumerate(members):
                per_uid[i][f"best@{n}/mean"], per_uid[i][f"best@{n}/std"] = best[j]
                per_uid[i][f"worst@{n}/mean"], per_uid[i][f"worst@{n}/std"] = worst[j]
    out: dict[str, list[float]] = {}
    for metrics in per_uid:
        for name, value in metrics.items():
            out.setdefault(name, []).append(value)
    return out


def _gen_ns(k: int) -> list[int]:
    """The subset sizes verl bootstraps for a uid of k rows: 2, 4, 8, ... below k, then k."""
    if k <= 1:
        return []
    ns, n = [], 2
    while n < k:
        ns.append(n)
        n *= 2
    return [*ns, k]


_INDEX_CACHE: dict[tuple[int, int, int, int], np.ndarray] = {}


def _indices(k: int, n: int, seed: int, n_bootstrap: int) -> np.ndarray:
    """The resample verl draws after `np.random.seed(seed)`: the legacy generator's stream, from a
    `RandomState` of our own so the caller's global numpy state is left alone."""
    key = (k, n, seed, n_bootstrap)
    cached = _INDEX_CACHE.get(key)
    if cached is None:
        if len(_INDEX_CACHE) > 256:
            _INDEX_CACHE.clear()
        cached = _INDEX_CACHE[key] = np.random.RandomState(seed).choice(
            k, size=(n_bootstrap, n), replace=True
        )
    return cached


def _bootstrap(
    block: np.ndarray, n: int, seed: int, n_bootstrap: int
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(mean, std) of the best and of the worst of n resampled scores, per uid of the block; every
    uid of a block has the same k, so all share verl's one resample of indices."""
    idx = _indices(block.shape[1], n, seed, n_bootstrap)
    step = max(1, _BLOCK // (n_bootstrap * n))
    best: list[tuple[float, float]] = []
    worst: list[tuple[float, float]] = []
    for start in range(0, block.shape[0], step):
        sample = block[start : start + step][:, idx]  # [uids, n_bootstrap, n]
        top, bottom = sample.max(axis=2), sample.min(axis=2)
        # mean and std row by row: numpy's std along an axis of a 2-D array rounds differently
        # from its std of a 1-D array (verl's), by a few ulps
        best += [(float(np.mean(row)), float(np.std(row))) for row in top]
        worst += [(float(np.mean(row)), float(np.std(row))) for row in bottom]
    return best, worst


# ------------------------------------------------------------------ shared
def _scores(scores: Sequence[float], as_float32: bool) -> np.ndarray:
    values = np.asarray(scores, dtype=np.float64)
    if as_float32:
        with np.errstate(over="ignore"):  # a reward past float32's range is +-inf in rm_scores too
            values = values.astype(np.float32).astype(np.float64)
    return values


def _stats(prefix: str, values: np.ndarray) -> dict[str, float]:
    if not values.size:
        return {
            f"{prefix}/mean": float("nan"),
            f"{prefix}/max": float("nan"),
            f"{prefix}/min": float("nan"),
        }
    return {
        f"{prefix}/mean": _f32(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def _f32(value: Any) -> float:
    """A float64 figure as verl's float32 tensors report it."""
    return float(np.float32(value))


def _same_length(**columns: Sequence[Any]) -> None:
    lengths = {name: len(values) for name, values in columns.items()}
    if len(set(lengths.values())) > 1:
        raise InvalidArgument(f"one value per batch row in every column; got lengths {lengths}")
