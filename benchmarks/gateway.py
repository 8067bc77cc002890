"""What the gateway adds to a model call, and whether its memory stays flat (issue 42).

    python -m benchmarks.gateway                              # 256 sessions x 8 calls, 3 rounds
    python -m benchmarks.gateway --sessions 1 --calls 300     # latency without queueing
    python -m benchmarks --only gateway                       # in the suite (sizes by preset)

The stand-in inference server (`sessions.gateway.standin`) and the `gateway` verb (SQLite) each
run in a process of their own; this process drives `--sessions` concurrent agent sessions of
`--calls` chat calls each, every round twice: straight to the server (with the token options the
gateway adds, so the server does the same work) and through the gateway, in alternating order
so a load that comes and goes shifts both alike. A session's conversation grows call by call as
an agent's does. Per round: each path's latency per call at p50 and p99 and their difference
(what the gateway adds: the second hop, the intent and the record appended, the answer
re-encoded), the gateway process's CPU per call (a figure that does not move with the wait for
a core) and its resident memory after the round. The figures are medians of the rounds with
their min and max; the load average is printed.

Every call is checked against the log afterwards: each session's recorded calls, in order, have
the texts its agent received and the prompt lengths the stand-in's template gives the messages
sent; a mismatch is an error, not a figure.

`--baseline-source DIR` runs a second gateway from another checkout of this repository (its
`sessions` package) in the same rounds, so a change is measured beside the code it replaces on
the same machine at the same time. `--gateway-wrapper "CMD ..."` starts the gateway under a
command (e.g. `python -m cProfile -o out.prof`). `--callgrind DIR` runs every gateway under
callgrind, instrumented only while calls go through it: instructions per call, a figure the
machine's load does not move (the latencies of such a run mean nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import Config, Report, load_average, log, median

WORKLOAD = "gateway"
ROOT = Path(__file__).resolve().parent.parent
#: The issue's targets: what the gateway may add to a call, SQLite, on this machine.
TARGET_P50_MS, TARGET_P99_MS = 2.0, 10.0
#: How long a process may take to start listening (imports included, on a loaded machine).
START_TIMEOUT_S = 120.0
#: Per preset: (sessions, calls, rounds) shapes; the first is the issue's, the second latency.
SHAPES: dict[str, list[tuple[int, int, int]]] = {
    "tiny": [(4, 2, 2)],
    "quick": [(32, 8, 3), (1, 100, 3)],
    "full": [(256, 8, 3), (1, 300, 3)],
}
_STANDIN_MAIN = """
import asyncio, sys, uvicorn
from sessions.gateway.standin import StandIn
server = uvicorn.Server(uvicorn.Config(StandIn().app, host="127.0.0.1", port=int(sys.argv[1]),
                                       log_level="warning", lifespan="off", access_log=False))
asyncio.run(server.serve())
"""
_SERVING = re.compile(r"serving on (\S+) .* key (\S+)$")


@dataclass
class Series:
    """One way of sending the calls (straight, or through a gateway) and what it measured."""

    name: str
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)
    cpu_ms_per_call: list[float] = field(default_factory=list)
    loop_cpu_ms_per_call: list[float] = field(default_factory=list)


@dataclass
class GatewayProcess:
    """A `gateway` verb in a process of its own, serving one SQLite ledger."""

    label: str
    process: asyncio.subprocess.Process
    db: str
    base: str
    admin: str
    rss_mib: list[float] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)
    #: per session: (text received, prompt length sent) of each call, in order
    transcripts: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    #: under callgrind: the instructions it ran per call while calls went through it
    instructions_per_call: float | None = None


@dataclass
class Result:
    """One shape's figures: the paths' per-round latencies, the gateways' memory and checks."""

    sessions: int
    calls: int
    rounds: int
    paths: dict[str, Series]
    gateways: list[GatewayProcess]
    recorded: dict[str, int]
    load: tuple[list[float] | None, list[float] | None]

    def added(self, gateway: str, quantile: str) -> Any:
        """The gateway's latency minus the straight path's, round by round (a `Sampled`)."""
        mine, straight = self.paths[gateway], self.paths["direct"]
        series = mine.p50_ms if quantile == "p50" else mine.p99_ms
        base = straight.p50_ms if quantile == "p50" else straight.p99_ms
        return median([a - b for a, b in zip(series, base)])


# ---------------------------------------------------------------------------- processes
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _proc_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {key}: is the process still running?")


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU time so far (nanosecond-resolution `schedstat`) of a process's event-loop thread (its
    main thread) and of all its threads: the rest is the database's writer threads. A thread
    that ended between two readings takes its time with it; the gateway's threads live as long
    as its ledger."""
    tasks = Path(f"/proc/{pid}/task")
    loop = total = 0.0
    for task in tasks.iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            seconds = int((task / "schedstat").read_text().split()[0]) / 1e9
            total += seconds
            if task.name == str(pid):
                loop = seconds
    return loop, total


async def _wait_listening(url: str, process: asyncio.subprocess.Process) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    async with httpx.AsyncClient(trust_env=False) as http:
        while True:
            try:
                await http.get(url + "/")  # any answer (a 404) means it listens
                return
            except httpx.TransportError:
                if process.returncode is not None:
                    raise RuntimeError(f"{url}: the server exited {process.returncode}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{url} did not listen within {START_TIMEOUT_S:g}s"
                    ) from None
                await asyncio.sleep(0.05)


async def _start_gateway(
    label: str,
    source: Path,
    folder: Path,
    upstream: str,
    interpreter: list[str],
    env: dict[str, str],
) -> GatewayProcess:
    """`python -m sessions.cli gateway` run from `source` (a checkout) on a fresh ledger;
    `interpreter`: the command that stands for `python` (with a profiler's options, say)."""
    db = str(folder / f"{label}.db")
    migrate = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "sessions.cli", "migrate", "--db", db),
        cwd=source,
        stdout=asyncio.subprocess.DEVNULL,
    )
    if await migrate.wait() != 0:
        raise RuntimeError(f"{label}: migrate --db exited {migrate.returncode}")
    process = await asyncio.create_subprocess_exec(
        *interpreter,
        *("-m", "sessions.cli", "gateway", "--db", db, "--upstream", upstream),
        *("--port", "0", "--key-file", str(folder / f"{label}.key")),
        cwd=source,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
    )
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)).decode().strip()
    match = _SERVING.search(line)
    if match is None:
        raise RuntimeError(f"{label}: the gateway did not say where it serves: {line!r}")
    base, admin = match.groups()
    return GatewayProcess(label, process, db, base, admin)


#: callgrind, its instrumentation off until calls go through (start-up runs uninstrumented)
_CALLGRIND = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]


async def _callgrind_control(pid: int, *args: str) -> None:
    done = await asyncio.create_subprocess_exec(
        "callgrind_control", *args, str(pid), stdout=asyncio.subprocess.DEVNULL
    )
    if await done.wait() != 0:
        raise RuntimeError(f"callgrind_control {' '.join(args)} {pid} exited {done.returncode}")


def _callgrind_total(folder: Path, gateway: GatewayProcess) -> int:
    """The instructions (Ir) callgrind counted in the gateway process, over all its dumps."""
    total = 0
    for dump in folder.glob(f"{gateway.label}.{gateway.process.pid}*"):
        for line in dump.read_text(errors="replace").splitlines():
            if line.startswith("totals:"):
                total += int(line.split()[1])
    if total == 0:
        raise RuntimeError(f"{gateway.label}: callgrind wrote no counts into {folder}")
    return total


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 60)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()


@contextlib.asynccontextmanager
async def _standin() -> AsyncIterator[str]:
    port = _free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _STANDIN_MAIN, str(port), cwd=ROOT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_listening(url, process)
        yield url
    finally:
        await _stop(process)


# ------------------------------------------------------------------------------- driving
def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _drive(
    http: Any,
    targets: list[tuple[str, str]],
    calls: int,
    direct: bool,
    transcripts: dict[str, list[tuple[str, int]]] | None,
) -> list[float]:
    """Every session's calls, the sessions concurrent; each call's latency in seconds."""
    from sessions.gateway.standin import chat_prompt

    latencies: list[float] = []

    async def session(url: str, key: str, n: int) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"session {n}"}]
        said: list[tuple[str, int]] = []
        for _ in range(calls):
            body: dict[str, Any] = {"model": "m", "messages": messages}
            if direct:  # what the gateway adds, so the server does the same work
                body.update(return_token_ids=True, logprobs=True, return_tokens_as_token_ids=True)
            started = time.perf_counter()
            answer = await http.post(
                url + "/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
            latencies.append(time.perf_counter() - started)
            if answer.status_code != 200:
                raise RuntimeError(f"{url}: call answered {answer.status_code}: {answer.text}")
            text = answer.json()["choices"][0]["message"]["content"]
            said.append((text, len(chat_prompt(messages))))
            messages = [*messages, {"role": "assistant", "content": text}]
            messages.append({"role": "user", "content": "go on"})
        if transcripts is not None:
            transcripts[url] = said

    await asyncio.gather(*(session(url, key, n) for n, (url, key) in enumerate(targets)))
    return latencies


async def _sessions(
    http: Any, gateway: GatewayProcess, round_: int, n: int
) -> list[tuple[str, str]]:
    """Create `n` sessions of one step on `gateway`: their base URLs and keys."""
    targets = []
    for index in range(n):
        name = f"r{round_}-s{index}"
        made = await http.post(
            gateway.base + "/sessions",
            json={
                "session_id": name,
                "uid": f"u{index}",
                "session_index": 0,
                "group_size": 1,
                "partition": "train",
                "global_step": round_,
            },
            headers={"authorization": f"Bearer {gateway.admin}"},
        )
        made.raise_for_status()
        gateway.sessions.append(name)
        targets.append((made.json()["base_url"], made.json()["api_key"]))
    return targets


async def _end(http: Any, gateway: GatewayProcess, names: list[str]) -> None:
    for name in names:
        ended = await http.post(
            gateway.base + f"/sessions/{name}/end",
            json={},
            headers={"authorization": f"Bearer {gateway.admin}"},
        )
        ended.raise_for_status()


def _record(path: Series, latencies: list[float], cpu_s: tuple[float, float] | None) -> None:
    path.p50_ms.append(_quantile(latencies, 0.5) * 1e3)
    path.p99_ms.append(_quantile(latencies, 0.99) * 1e3)
    if cpu_s is not None:
        path.loop_cpu_ms_per_call.append(cpu_s[0] * 1e3 / len(latencies))
        path.cpu_ms_per_call.append(cpu_s[1] * 1e3 / len(latencies))


async def measure(
    sessions: int,
    calls: int,
    rounds: int,
    *,
    workdir: str | None = None,
    baseline_source: Path | None = None,
    wrapper: list[str] | None = None,
    env: dict[str, str] | None = None,
    callgrind: Path | None = None,
) -> Result:
    """Run the shape `rounds` times: straight and through each gateway, in rotating order.
    `callgrind`: a folder; every gateway runs under callgrind, instrumented only while calls go
    through it after the first round (a warm-up: lazy imports, pools filling), and its
    instructions per call are counted (its latencies then mean nothing)."""
    import httpx

    load_before = load_average()
    sources = [("gateway", ROOT)]
    if baseline_source is not None:
        sources.append(("baseline gateway", baseline_source))
    with tempfile.TemporaryDirectory(prefix="bench-gateway-", dir=workdir) as tmp:
        folder = Path(tmp)
        async with _standin() as upstream:
            gateways: list[GatewayProcess] = []
            try:
                for label, source in sources:
                    interpreter = (
                        (wrapper or [sys.executable]) if source == ROOT else [sys.executable]
                    )
                    if callgrind is not None:
                        out = callgrind / f"{label.replace(' ', '-')}.%p"
                        interpreter = [*_CALLGRIND, f"--callgrind-out-file={out}", *interpreter]
                    gateways.append(
                        await _start_gateway(
                            label.replace(" ", "-"),
                            source,
                            folder,
                            upstream,
                            interpreter,
                            (env or {}) if source == ROOT else {},
                        )
                    )
                for gateway in gateways:
                    await _wait_listening(gateway.base, gateway.process)
                    gateway.rss_mib.append(_proc_kib(gateway.process.pid, "VmRSS") / 1024)
                paths = {"direct": Series("direct")}
                paths.update({label: Series(label) for label, _ in sources})
                limits = httpx.Limits(
                    max_connections=sessions,
                    max_keepalive_connections=sessions,
                    keepalive_expiry=2.0,  # before a server's uvicorn closes an idle one (5 s)
                )
                async with httpx.AsyncClient(limits=limits, timeout=600, trust_env=False) as http:
                    for round_ in range(rounds):
                        order: list[GatewayProcess | None] = [None, *gateways]
                        shift = round_ % len(order)
                        for which in order[shift:] + order[:shift]:
                            if which is None:
                                direct = [(upstream + "/v1", "x")] * sessions
                                latencies = await _drive(http, direct, calls, True, None)
                                _record(paths["direct"], latencies, None)
                                continue
                            label = sources[gateways.index(which)][0]
                            targets = await _sessions(http, which, round_, sessions)
                            said: dict[str, list[tuple[str, int]]] = {}
                            counted = callgrind is not None and round_ > 0  # 0: warm-up
                            if counted:
                                await _callgrind_control(which.process.pid, "-i", "on")
                            before = _cpu_seconds(which.process.pid)
                            latencies = await _drive(http, targets, calls, False, said)
                            after = _cpu_seconds(which.process.pid)
                            if counted:
                                await _callgrind_control(which.process.pid, "-i", "off")
                            cpu = (after[0] - before[0], after[1] - before[1])
                            _record(paths[label], latencies, cpu)
                            names = which.sessions[-sessions:]
                            for name, (url, _key) in zip(names, targets):
                                which.transcripts[name] = said[url]
                            await _end(http, which, names)
                            which.rss_mib.append(_proc_kib(which.process.pid, "VmRSS") / 1024)
                        log(
                            f"  {sessions}x{calls} round {round_ + 1}/{rounds}: "
                            + ", ".join(
                                f"{p.name} p50 {p.p50_ms[-1]:.2f} p99 {p.p99_ms[-1]:.2f} ms"
                                for p in paths.values()
                            )
                        )
            finally:
                for gateway in gateways:
                    await _stop(gateway.process)
        recorded = {g.label: await _check_log(g) for g in gateways}
        if callgrind is not None:
            for gateway in gateways:
                total = _callgrind_total(callgrind, gateway)
                gateway.instructions_per_call = total / (sessions * calls * (rounds - 1))
    return Result(sessions, calls, rounds, paths, gateways, recorded, (load_before, load_average()))


async def _check_log(gateway: GatewayProcess) -> int:
    """The calls the log holds for the gateway's sessions, each checked against what its agent
    received; raises naming the first call that differs."""
    from sessions.ledger import Ledger

    recorded = 0
    async with Ledger.open(gateway.db) as ledger:
        for name in gateway.sessions:
            calls = (await ledger.load_session(name)).view.recorded_calls()
            said = gateway.transcripts[name]
            got = [(call.text, call.prompt_shared + call.prompt_len) for call in calls]
            if got != said:
                raise RuntimeError(
                    f"{gateway.label}: session {name}'s log holds calls {got[:3]}... where its "
                    f"agent received {said[:3]}...: the gateway recorded something else"
                )
            recorded += len(calls)
    return recorded


# ------------------------------------------------------------------------------ reporting
def lines(result: Result) -> list[str]:
    """A Markdown table of the shape's figures (medians of the rounds, [min-max])."""

    def cell(values: list[float]) -> str:
        m = median(values)
        return f"{m:.2f} [{min(values):.2f}-{max(values):.2f}]"

    shape = f"{result.sessions} x {result.calls}"
    out = [
        f"{shape}, {result.rounds} rounds; load average {result.load[0]} -> {result.load[1]}",
        "| path | p50 ms | p99 ms | added p50 ms | added p99 ms | gateway CPU ms/call "
        "| of which its event loop | recorded | RSS MiB start, after each round |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    direct = result.paths["direct"]
    out.append(f"| direct | {cell(direct.p50_ms)} | {cell(direct.p99_ms)} | | | | | | |")
    for gateway in result.gateways:
        label = gateway.label.replace("-", " ")
        path = result.paths[label]
        added = [result.added(label, q) for q in ("p50", "p99")]
        added_cells = [f"{float(a):.2f} [{min(a.samples):.2f}-{max(a.samples):.2f}]" for a in added]
        total = result.sessions * result.calls * result.rounds
        rss = ", ".join(f"{m:.1f}" for m in gateway.rss_mib)
        if gateway.instructions_per_call is not None:
            rss += f" (callgrind: {gateway.instructions_per_call / 1e6:.2f} M instructions/call)"
        out.append(
            f"| {label} | {cell(path.p50_ms)} | {cell(path.p99_ms)} | {added_cells[0]} "
            f"| {added_cells[1]} | {cell(path.cpu_ms_per_call)} | {cell(path.loop_cpu_ms_per_call)} "
            f"| {result.recorded[gateway.label]} / {total} | {rss} |"
        )
    return out


def add_figures(report: Report, result: Result) -> None:
    """The shape's figures in the suite's report (targets on the issue's shape only)."""
    shape = f"{result.sessions}x{result.calls}"
    for gateway in result.gateways:
        label = gateway.label.replace("-", " ")
        path = result.paths[label]
        report.add(WORKLOAD, f"{shape} {label} p50 (ms)", median(path.p50_ms), "ms")
        report.add(WORKLOAD, f"{shape} {label} p99 (ms)", median(path.p99_ms), "ms")
        for quantile, target in (("p50", TARGET_P50_MS), ("p99", TARGET_P99_MS)):
            report.add(
                WORKLOAD,
                f"{shape} added by the {label} at {quantile} (ms)",
                result.added(label, quantile),
                "ms",
                target=f"<= {target:g} ms",
                goal=("<=", target),
            )
        report.add(
            WORKLOAD, f"{shape} {label} CPU per call (ms)", median(path.cpu_ms_per_call), "ms"
        )
        report.add(
            WORKLOAD,
            f"{shape} {label} event-loop thread CPU per call (ms)",
            median(path.loop_cpu_ms_per_call),
            "ms",
        )
        growth = gateway.rss_mib[-1] - gateway.rss_mib[1] if len(gateway.rss_mib) > 2 else 0.0
        report.add(
            WORKLOAD,
            f"{shape} {label} RSS growth after round 1 (MiB)",
            max(growth, 0.0),
            "MiB",
            kind="memory",
        )
        total = result.sessions * result.calls * result.rounds
        report.add(
            WORKLOAD,
            f"{shape} {label} calls recorded / sent",
            result.recorded[gateway.label] / total,
            "x",
        )
    direct = result.paths["direct"]
    report.add(WORKLOAD, f"{shape} direct p50 (ms)", median(direct.p50_ms), "ms")
    report.add(WORKLOAD, f"{shape} direct p99 (ms)", median(direct.p99_ms), "ms")


def run(cfg: Config, report: Report) -> None:
    """The suite's workload: the preset's shapes, the gateway alone (no baseline checkout)."""
    import importlib.util

    missing = [m for m in ("starlette", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        report.note(
            WORKLOAD, f"skipped: the gateway extra is not installed (no {', '.join(missing)})"
        )
        return
    rounds_override = None if cfg.mode == "tiny" else max(cfg.reps, 3)
    for sessions, calls, rounds in SHAPES[cfg.mode]:
        result = asyncio.run(
            measure(sessions, calls, rounds_override or rounds, workdir=cfg.workdir)
        )
        for line in lines(result):
            log(f"  {line}")
        add_figures(report, result)
        report.note(
            WORKLOAD, f"{sessions}x{calls}: load average {result.load[0]} -> {result.load[1]}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sessions", type=int, default=256, help="concurrent agent sessions")
    parser.add_argument("--calls", type=int, default=8, help="chat calls per session")
    parser.add_argument(
        "--rounds", type=int, default=3, help="steps of sessions, one after another"
    )
    parser.add_argument("--workdir", help="folder for the scratch ledgers (default: temp)")
    parser.add_argument(
        "--baseline-source",
        type=Path,
        help="another checkout whose gateway runs beside this one in the same rounds",
    )
    parser.add_argument(
        "--gateway-wrapper",
        default="",
        help="a command the gateway is started under, e.g. 'python -m cProfile -o OUT'",
    )
    parser.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for this checkout's gateway only (repeatable)",
    )
    parser.add_argument(
        "--callgrind",
        type=Path,
        metavar="DIR",
        help="run every gateway under callgrind (output in DIR) and count its instructions per call",
    )
    parser.add_argument("--json", dest="json_out", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    for name in ("sessions", "calls", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.callgrind is not None and args.rounds < 2:
        parser.error(
            "--callgrind counts the rounds after the first (a warm-up): give --rounds 2 or more"
        )
    if args.baseline_source is not None and not (args.baseline_source / "sessions").is_dir():
        parser.error(f"--baseline-source {args.baseline_source}: no sessions package in it")
    bad = [pair for pair in args.gateway_env if "=" not in pair]
    if bad:
        parser.error(f"--gateway-env takes NAME=VALUE, got {bad[0]!r}")
    env = dict(pair.split("=", 1) for pair in args.gateway_env)
    wrapper = shlex.split(args.gateway_wrapper)
    if not wrapper:
        wrapper = [sys.executable]
    elif wrapper[0] == "python":  # the interpreter itself with options (cProfile): this one
        wrapper[0] = sys.executable
    else:  # another program (valgrind) that runs the interpreter
        wrapper.append(sys.executable)
    result = asyncio.run(
        measure(
            args.sessions,
            args.calls,
            args.rounds,
            workdir=args.workdir,
            baseline_source=args.baseline_source,
            wrapper=wrapper,
            env=env,
            callgrind=args.callgrind,
        )
    )
    for line in lines(result):
        print(line)
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "command": "python -m benchmarks.gateway "
                    + " ".join(sys.argv[1:] if argv is None else argv),
                    "sessions": result.sessions,
                    "calls": result.calls,
                    "rounds": result.rounds,
                    "load_average": result.load,
                    "paths": {k: vars(v) for k, v in result.paths.items()},
                    "rss_mib": {g.label: g.rss_mib for g in result.gateways},
                    "recorded": result.recorded,
                    "instructions_per_call": {
                        g.label: g.instructions_per_call for g in result.gateways
                    },
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
