"""Shared pieces of the benchmark suite: sizes, the machine, timing, memory probes, figures.

Every workload module exposes ``run(cfg: Config, report: Report) -> None``: it repeats its
subject and its baselines side by side ``cfg.reps`` times in this process, takes medians and adds
`Figure`s (absolute figures, ratios, peak memory) to the report. `run_isolated` runs one in a
fresh interpreter of its own once the machine's load has settled, so a figure measures its
workload and not the heap or the load the workloads before it left (issue 44).

Memory is measured two ways, and each figure says which:

* ``RSS growth``: the process's resident-set high-water mark during one repetition minus its
  resident set just before it (Linux ``VmHWM`` reset through ``/proc/self/clear_refs``, after a
  ``gc.collect()`` and ``malloc_trim``). Includes everything: SQLite's page cache, torch's and
  numpy's buffers, the aiosqlite thread. Where the reset is not allowed it falls back to the growth
  of ``ru_maxrss`` (which only moves when the process exceeds its previous peak; said so).
* ``tracemalloc peak``: the peak of Python-heap allocations (numpy buffers included, SQLite's
  and torch's own allocators not) during one extra, untimed repetition — tracemalloc slows
  Python code 2-3x, so it never runs inside a timed repetition.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import os
import platform
import resource
import shutil
import statistics
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

MiB = 1024 * 1024


# ----------------------------------------------------------------------------------- sizes
@dataclass
class Config:
    """Sizes of every workload; the presets below are `--tiny`, `--quick` and `--full`."""

    mode: str = "quick"
    reps: int = 3
    # 1. append
    append_sessions: int = 300
    append_concurrency: int = 1000
    # 2. projection: steps x uids x group_size terminal sessions, one padded batch per step
    projection_steps: int = 4
    projection_uids: int = 16
    # 3. replay / audit: sessions recorded once into a template log
    replay_sessions: int = 1000
    # 4. PostgreSQL append (benchmarks/pg_append.py)
    pg_writers: tuple[int, ...] = (1, 4, 8)
    pg_sessions_per_writer: int = 100
    pg_reps: int | None = None  # None: `reps`
    # 5. per-session overhead
    overhead_sessions: int = 1000
    # 7. batch ready when the step ends: sessions in the one step (benchmarks/batch_ready.py)
    batch_ready_sessions: int = 256
    # disk write speed (replay/audit MB/s against it): MiB written and fdatasync'ed
    disk_mib: int = 64
    # 6. memory
    tracemalloc: bool = True
    #: skip a traced repetition of replay/audit above this many events (RSS only): too slow traced
    traced_events_max: int | None = None
    # bandwidth bound: size of the tensor whose copy speed is measured
    copy_mib: int = 256
    # scale: the log sizes the cost curves are measured at (None: 1e4 x 10 up to
    # ROLLOUT_LEDGER_SCALE_MAX, default 1e6; benchmarks/scale.py)
    scale_sizes: tuple[int, ...] | None = None
    # shared
    group_size: int = 4
    fail_rate: float = 0.1
    seed: int = 0
    only: tuple[str, ...] = ()
    workdir: str | None = None

    def wants(self, workload: str) -> bool:
        return not self.only or workload in self.only


PRESETS: dict[str, dict[str, Any]] = {
    # a few seconds: the CI smoke run (tests/benchmarks/test_smoke.py)
    "tiny": dict(
        reps=3,
        append_sessions=24,
        append_concurrency=1000,
        projection_steps=2,
        projection_uids=2,
        replay_sessions=24,
        pg_writers=(1,),
        pg_sessions_per_writer=8,
        pg_reps=1,
        overhead_sessions=40,
        tracemalloc=False,
        copy_mib=64,
        batch_ready_sessions=32,
        disk_mib=16,
        scale_sizes=(1_000, 3_000),
    ),
    # about a minute on 2 cores: a first look (PostgreSQL: 1 repetition per writer count, since each
    # spawns its writer processes afresh and every process pays ~1.5 s CPU importing the library)
    "quick": dict(
        reps=3,
        append_sessions=200,
        append_concurrency=1000,
        projection_steps=2,
        projection_uids=16,
        replay_sessions=300,
        pg_writers=(1, 4, 8),
        pg_sessions_per_writer=25,
        pg_reps=1,
        overhead_sessions=1000,
        tracemalloc=True,
        batch_ready_sessions=256,
        disk_mib=64,
        scale_sizes=(2_000, 20_000),  # the curve's shape only: a smoke run, not the figures
    ),
    # several minutes: the figures in docs/benchmarks.md
    "full": dict(
        reps=3,
        append_sessions=10_000,
        append_concurrency=1000,
        projection_steps=16,
        projection_uids=64,
        replay_sessions=17_000,
        pg_writers=(1, 4, 8),
        pg_sessions_per_writer=250,
        overhead_sessions=1000,
        tracemalloc=True,
        traced_events_max=20_000,
        batch_ready_sessions=4096,
        disk_mib=256,
    ),
}


def preset(mode: str, **overrides: Any) -> Config:
    values = dict(PRESETS[mode])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Config(mode=mode, **values)


# --------------------------------------------------------------------------------- machine
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    import sqlite3

    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        memory_gib = round(pages * page / 1024**3, 1)
    except (ValueError, OSError, AttributeError):
        memory_gib = None
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gib": memory_gib,
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "sqlite": sqlite3.sqlite_version,
        "numpy": _version("numpy"),
        "sqlalchemy": _version("sqlalchemy"),
        "aiosqlite": _version("aiosqlite"),
        "tensordict": _version("tensordict"),
        "eventsourcing": _version("eventsourcing"),
        "asyncpg": _version("asyncpg"),
        "load_average": load_average(),
        "commit": source_commit(),
    }


def source_commit() -> str | None:
    """The checkout's commit (with `+dirty` if the work tree differs), or None outside git."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def load_average() -> list[float] | None:
    """1/5/15-minute load averages: figures taken on a busy machine are not comparable."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---------------------------------------------------------------------------------- figures
@dataclass
class Figure:
    """One number of the report. `goal` is (">=" | "<=", threshold) for targets, else None."""

    workload: str
    name: str
    value: float
    unit: str
    target: str | None = None
    goal: tuple[str, float] | None = None
    kind: str = "figure"  # figure | ratio | memory
    #: spread over the repetitions the value is the median of: min, max and how many (1: one
    #: measurement, no spread); `paired` False when two sample sets of different sizes were
    #: combined every way (the widest spread they allow, see `Sampled`)
    low: float | None = None
    high: float | None = None
    n: int = 1
    paired: bool = True

    @property
    def met(self) -> bool | None:
        if self.goal is None or not math.isfinite(self.value):
            return None
        op, threshold = self.goal
        return self.value >= threshold if op == ">=" else self.value <= threshold

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["met"] = self.met
        return out


@dataclass
class Report:
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    #: per workload run: the 1/5/15-minute load average before and after it
    loads: dict[str, tuple[list[float] | None, list[float] | None]] = field(default_factory=dict)

    def add(
        self,
        workload: str,
        name: str,
        value: float,
        unit: str,
        *,
        target: str | None = None,
        goal: tuple[str, float] | None = None,
        kind: str = "figure",
        samples: Iterable[float] | None = None,
    ) -> Figure:
        """One figure; its spread comes from `samples` or, if none are given, from the
        repetitions a `Sampled` value carries (every `median` of this module returns one)."""
        paired = True
        if samples is not None:
            spread = [float(v) for v in samples]
        elif isinstance(value, Sampled):
            spread, paired = list(value.samples), value.paired
        else:
            spread = []
        figure = Figure(workload, name, float(value), unit, target, goal, kind)
        finite = [v for v in spread if math.isfinite(v)]
        if len(finite) >= 2:
            figure.low, figure.high, figure.n, figure.paired = (
                min(finite),
                max(finite),
                len(spread),
                paired,
            )
        self.figures.append(figure)
        return figure

    def note(self, workload: str, text: str) -> None:
        self.notes.append(f"{workload}: {text}")

    def for_workload(self, workload: str) -> list[Figure]:
        return [f for f in self.figures if f.workload == workload]


def fmt_value(value: float, unit: str) -> str:
    if not math.isfinite(value):
        return str(value)
    if unit in ("x", "×"):
        return f"{value:,.3g}" if value < 10 else f"{value:,.1f}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:,.1f}"
    return f"{value:,.3g}"


TABLE_HEADER = "| workload | measure | value | min | max | reps | unit | target | status |"


def reps_label(f: Figure) -> str:
    """How many measurements the spread is over: "3"; "1" for a single one; "15*" when two
    sample sets of different sizes were combined every way (the widest spread they allow)."""
    return f"{f.n}" if f.paired else f"{f.n}*"


def table(figures: list[Figure]) -> str:
    """A GitHub-flavoured Markdown table (readable as plain text too): each figure's value (the
    median of the repetitions; a peak's max) with the min and max over them (per-repetition
    ratios for a ratio; empty: one figure, no spread)."""
    lines = [TABLE_HEADER, "| --- | --- | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    for f in figures:
        status = {True: "met", False: "**missed**", None: ""}[f.met]
        low = "" if f.low is None else fmt_value(f.low, f.unit)
        high = "" if f.high is None else fmt_value(f.high, f.unit)
        lines.append(
            f"| {f.workload} | {f.name} | {fmt_value(f.value, f.unit)} | {low} | {high} "
            f"| {reps_label(f)} | {f.unit} | {f.target or ''} | {status} |"
        )
    return "\n".join(lines)


#: The train_step figures a user reads first: the ledger's cost per session, and its share of a
#: training step (which is that cost against the policy's, at each policy size measured).
HEADLINE = ("ledger cost per session", "ledger share")


def headline(figures: list[Figure]) -> list[Figure]:
    """The user-facing figures first: the train_step workload's ledger cost per session and its
    share of a training step, per policy size."""
    return [f for f in figures if f.workload == "train_step" and f.name.startswith(HEADLINE)]


def spread_text(f: Figure) -> str:
    if f.low is None:
        return "one measurement"
    widest = "" if f.paired else ", every pairing"
    return f"min {fmt_value(f.low, f.unit)}, max {fmt_value(f.high, f.unit)} over {f.n}{widest}"


def summary(report: Report, load_start: Any, load_end: Any) -> list[str]:
    """The summary printed before the whole table: the ledger's share of a training step first
    (when train_step ran), then every target with its spread and status, then the load."""
    lines = ["Summary"]
    for f in headline(report.figures):
        lines.append(f"- {f.name}: {fmt_value(f.value, f.unit)} {f.unit} ({spread_text(f)})")
    targeted = [f for f in report.figures if f.met is not None]
    for f in targeted:
        status = "met" if f.met else "MISSED"
        lines.append(
            f"- {f.workload}: {f.name}: {fmt_value(f.value, f.unit)} {f.unit} ({spread_text(f)}); "
            f"target {f.target}: {status}"
        )
    missed = sum(f.met is False for f in targeted)
    if targeted:
        lines.append(f"{missed} of {len(targeted)} targets missed (goals, not assertions)")
    lines.append(f"load average (1/5/15 min): {load_start} at start, {load_end} at end")
    for name, (before, after) in report.loads.items():
        lines.append(f"  {name}: {before} before, {after} after")
    return lines


def machine_lines(info: dict[str, Any]) -> list[str]:
    usable = info["usable_cores"]
    cores = f"{info['cores']} logical cores" + (
        f" ({usable} usable)" if usable != info["cores"] else ""
    )
    return [
        f"CPU: {info['cpu']}, {cores}, {info['memory_gib']} GiB RAM; {info['os']}",
        f"Python {info['python']}, torch {info['torch']} ({info['torch_threads']} threads), SQLite {info['sqlite']}, "
        f"SQLAlchemy {info['sqlalchemy']}, aiosqlite {info['aiosqlite']}, numpy {info['numpy']}, "
        f"tensordict {info['tensordict']}, eventsourcing {info['eventsourcing'] or 'not installed'}",
        f"source: commit {info['commit']}; load average at start (1/5/15 min): {info['load_average']}",
    ]


# -------------------------------------------------------------------------------- isolation
#: `run_isolated` waits for the 1-minute load average to fall to this, per core ...
SETTLED_LOAD_PER_CORE = 0.5
#: ... for at most this many seconds (a shared machine may never settle: the load is then printed)
SETTLE_MAX_S = 90.0


def settle(
    per_core: float = SETTLED_LOAD_PER_CORE,
    max_s: float = SETTLE_MAX_S,
    poll_s: float = 5.0,
) -> tuple[list[float] | None, float]:
    """Wait until the 1-minute load average is at most `per_core` per core, or `max_s` passed;
    returns the load then and the seconds waited. What ran before (this suite's PostgreSQL
    writers, another engineer's tests) raises the load for a minute after it stopped."""
    threshold = per_core * (os.cpu_count() or 1)
    start = time.monotonic()
    while True:
        load = load_average()
        waited = time.monotonic() - start
        if load is None or load[0] <= threshold or waited >= max_s:
            return load, waited
        time.sleep(min(poll_s, max(0.0, max_s - waited)))


def _isolated_child(module: str, cfg: Config, conn: Any) -> None:
    """The child's side of `run_isolated`: run one workload, send back its report (or the error)."""
    import importlib
    import traceback

    report = Report()
    try:
        importlib.import_module(module).run(cfg, report)
    except BaseException:  # noqa: BLE001 - handed to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
    else:
        conn.send(("ok", report))
    finally:
        conn.close()


def run_isolated(module: str, cfg: Config) -> Report:
    """`module.run(cfg, report)` in a fresh interpreter (multiprocessing's spawn), its report
    returned: the workload starts on a heap of its own, not one the workloads before it grew,
    whose full collections would land in its repetitions."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_isolated_child, args=(module, cfg, send), name=module)
    child.start()
    send.close()
    try:
        status, payload = receive.recv()
    except EOFError:
        status, payload = "error", "the workload's process ended without a report"
    finally:
        child.join()
        receive.close()
    if status != "ok":
        raise RuntimeError(
            f"{module} failed in its own process (exit code {child.exitcode}):\n{payload}"
            "run it alone with --in-process to debug it"
        )
    return payload  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------------- timing
class Sampled(float):
    """A median that keeps the repetitions it is the median of, so the figure built from it can
    be printed with its spread.

    Arithmetic with a plain number applies to the median and to every sample; with another
    `Sampled` of as many samples it pairs them repetition by repetition (subject and baseline run
    side by side in each repetition, so ``median(build_s) / median(per_row_s)`` keeps the ratio of
    the medians as its value and gets the per-repetition ratios as its samples). Two `Sampled` of
    different sizes (e.g. 3 repetitions against a 5-copy speed probe) give every pairing: the
    spread is then the widest the two allow, marked ``paired=False``.
    """

    __slots__ = ("samples", "paired")

    samples: tuple[float, ...]
    paired: bool

    def __new__(cls, value: float, samples: Iterable[float], paired: bool = True) -> Sampled:
        obj = super().__new__(cls, value)
        obj.samples = tuple(float(v) for v in samples)
        obj.paired = paired
        return obj

    def _apply(self, other: Any, op: Callable[[float, float], float], swap: bool) -> Any:
        if not isinstance(other, (int, float)) or isinstance(other, bool):
            return NotImplemented
        a, b = (float(other), float(self)) if swap else (float(self), float(other))
        value = op(a, b)
        mine = self.samples
        theirs = other.samples if isinstance(other, Sampled) else (float(other),)
        paired = self.paired and (not isinstance(other, Sampled) or other.paired)
        if len(theirs) == 1 or len(mine) == len(theirs):
            pairs = list(zip(mine, theirs * len(mine) if len(theirs) == 1 else theirs))
        else:
            pairs = [(x, y) for x in mine for y in theirs]
            paired = False
        samples = []
        for x, y in pairs:
            with contextlib.suppress(ZeroDivisionError, OverflowError):
                samples.append(op(y, x) if swap else op(x, y))
        return Sampled(value, samples, paired)

    def __add__(self, other: Any) -> Any:
        return self._apply(other, lambda a, b: a + b, False)

    def __radd__(self, other: Any) -> Any:
        return self._apply(other, lambda a, b: a + b, True)

    def __sub__(self, other: Any) -> Any:
        return self._apply(other, lambda a, b: a - b, False)

    def __rsub__(self, other: Any) -> Any:
        return self._apply(other, lambda a, b: a - b, True)

    def __mul__(self, other: Any) -> Any:
        return self._apply(other, lambda a, b: a * b, False)

    def __rmul__(self, other: Any) -> Any:
        return self._apply(other, lambda a, b: a * b, True)

    def __truediv__(self, other: Any) -> Any:
        return self._apply(other, lambda a, b: a / b, False)

    def __rtruediv__(self, other: Any) -> Any:
        return self._apply(other, lambda a, b: a / b, True)

    def __neg__(self) -> Sampled:
        return Sampled(-float(self), [-v for v in self.samples], self.paired)

    def __reduce__(self) -> Any:  # pickles (and copies) as the plain number it is
        return (float, (float(self),))


def median(values: Iterable[float]) -> Sampled:
    """The median of the repetitions, carrying them (see `Sampled`) for the figure's spread."""
    values = [float(v) for v in values]
    return Sampled(statistics.median(values), values)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def scratch_dir(cfg: Config, name: str) -> Iterator[Path]:
    """A fresh directory for one workload's database files, removed afterwards (`--workdir` is
    made if it does not exist yet)."""
    import tempfile

    if cfg.workdir is not None:
        Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-", dir=cfg.workdir) as tmp:
        yield Path(tmp)


def copy_db(source: Path, target: Path) -> None:
    """Copy a SQLite file (checkpointed: no -wal/-shm beside it) to a new path."""
    shutil.copyfile(source, target)


def checkpoint_sqlite(path: Path) -> None:
    """Fold the WAL into the main file so the file alone is the whole database."""
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


def disk_write_speed(folder: Path, mib: int, reps: int = 3) -> float:
    """Bytes per second of writing `mib` MiB (8 MiB chunks of random bytes) to a new file in
    `folder` and `os.fdatasync`-ing it, median of `reps`: what the disk under the scratch files
    takes, page cache flushed, as the bound for a workload that writes its log's payloads."""
    chunk = os.urandom(8 * MiB)
    chunks = max(1, mib // 8)
    times = []
    for rep in range(reps):
        path = folder / f"disk-speed-{rep}.bin"
        try:
            start = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for _ in range(chunks):
                    os.write(fd, chunk)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            times.append(time.perf_counter() - start)
        finally:
            path.unlink(missing_ok=True)
    return chunks * 8 * MiB / median(times)


# ----------------------------------------------------------------------------------- memory
def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


_LIBC: list[Any] = []


def _trim() -> None:
    """Collect young garbage and hand freed heap back to the OS, so RSS starts from live data.

    Generations 0-1 only: a full collection walks every object torch and sympy created at
    import (~0.5 s a probe on this machine); old cyclic garbage is rare between repetitions.
    """
    gc.collect(1)
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL("libc.so.6"))
        except OSError:
            _LIBC.append(None)
    if _LIBC[0] is not None:
        with contextlib.suppress(AttributeError):
            _LIBC[0].malloc_trim(0)


class RssProbe:
    """RSS high-water growth over a block (see the module docstring). `.mib` after the block."""

    def __init__(self) -> None:
        self.mib: float = 0.0
        self.method = "VmHWM"

    def __enter__(self) -> RssProbe:
        _trim()
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            self._start = _status_kib("VmRSS")
            if self._start is None:
                raise OSError("no /proc/self/status")
        except OSError:
            self.method = "ru_maxrss"
            self._start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return self

    def __exit__(self, *exc: Any) -> None:
        end = (
            _status_kib("VmHWM")
            if self.method == "VmHWM"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        )
        self.mib = max(0, (end or 0) - self._start) / 1024


class CpuProbe:
    """Where a block's time went: CPU of the calling thread (the event loop's), CPU of the whole
    process (the rest is other threads: aiosqlite's, where SQLite runs), and the cyclic garbage
    collector's collections and time (via `gc.callbacks`), all over the block."""

    def __init__(self) -> None:
        self.loop_cpu = self.process_cpu = self.gc_seconds = 0.0
        self.gc_collections = 0
        self._gc_started = 0.0

    def _on_gc(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_collections += 1
            self.gc_seconds += time.perf_counter() - self._gc_started

    def __enter__(self) -> CpuProbe:
        gc.callbacks.append(self._on_gc)
        self._thread, self._process = time.thread_time(), time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.loop_cpu = time.thread_time() - self._thread
        self.process_cpu = time.process_time() - self._process
        gc.callbacks.remove(self._on_gc)

    @property
    def other_threads_cpu(self) -> float:
        return max(0.0, self.process_cpu - self.loop_cpu)


def rss_label(method: str) -> str:
    return "RSS growth (VmHWM)" if method == "VmHWM" else "RSS growth (ru_maxrss delta)"


def traced_peak_mib(run: Callable[[], Any]) -> float:
    """Peak traced Python-heap allocation of `run()` in MiB."""
    _trim()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        run()
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak / MiB


def add_memory(
    report: Report,
    cfg: Config,
    workload: str,
    subject: str,
    rss: list[RssProbe],
    traced: Callable[[], Any] | None,
) -> None:
    """RSS growth (max over the timed repetitions) and, if enabled, one traced repetition."""
    if rss:
        report.add(
            workload,
            f"{subject}: peak {rss_label(rss[-1].method)}",
            max(p.mib for p in rss),
            "MiB",
            kind="memory",
            samples=[p.mib for p in rss],
        )
    if cfg.tracemalloc and traced is not None:
        report.add(
            workload, f"{subject}: tracemalloc peak", traced_peak_mib(traced), "MiB", kind="memory"
        )


def timed(run: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


async def atimed(run: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = await run()
    return time.perf_counter() - start, result
