"""The gateway's added latency and memory (issue 42's benchmark; a measurement, not a test).

`python -m tests.gateway.bench_gateway [--sessions 256] [--calls 8] [--rounds 1] [--db PATH]`: the stand-in
server and `rollout-ledger gateway` each in a process of their own; this process drives
`--sessions` concurrent agent sessions of `--calls` chat calls each, first straight to the
server and then through the gateway (the same requests, token options included), and prints
each path's latency per call at p50 / p99, their difference (what the gateway adds: forward,
record, answer), that every call was recorded, and the gateway process's resident memory at its
start and after each round (`--rounds`: that many steps of sessions, one after another).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

STANDIN_MAIN = """
import asyncio, sys, uvicorn
from sessions.gateway.standin import StandIn
server = uvicorn.Server(uvicorn.Config(StandIn().app, host="127.0.0.1", port=int(sys.argv[1]),
                                       log_level="warning", lifespan="off", access_log=False))
asyncio.run(server.serve())
"""


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def wait_listening(url: str) -> None:
    async with httpx.AsyncClient() as http:
        deadline = time.monotonic() + 60
        while True:
            try:
                await http.get(url + "/")  # any answer (a 404) means it listens
                return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def drive(
    http: httpx.AsyncClient, targets: list[tuple[str, str]], calls: int, direct: bool
) -> list[float]:
    """Every session's calls, the sessions concurrent; each call's latency in seconds."""
    latencies: list[float] = []

    async def session(url: str, key: str, n: int) -> None:
        messages = [{"role": "user", "content": f"session {n}"}]
        for _ in range(calls):
            body: dict[str, Any] = {"model": "m", "messages": messages}
            if direct:  # what the gateway would add, so the server does the same work
                body.update(return_token_ids=True, logprobs=True, return_tokens_as_token_ids=True)
            started = time.perf_counter()
            answer = await http.post(
                url + "/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
            latencies.append(time.perf_counter() - started)
            answer.raise_for_status()
            text = answer.json()["choices"][0]["message"]["content"]
            messages = [*messages, {"role": "assistant", "content": text}]
            messages.append({"role": "user", "content": "go on"})

    await asyncio.gather(*(session(url, key, n) for n, (url, key) in enumerate(targets)))
    return latencies


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="steps of --sessions sessions")
    parser.add_argument("--db", default=None)
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    db = args.db or str(folder / "bench.db")
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    standin = await asyncio.create_subprocess_exec(sys.executable, "-c", STANDIN_MAIN, str(port))
    from sessions.ledger import Ledger

    async with Ledger.open(db):
        pass
    gateway = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "sessions.cli", "gateway", "--db", db, "--upstream", upstream),
        *("--port", "0", "--key-file", str(folder / "gateway.key")),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert gateway.stdout is not None
        line = (await gateway.stdout.readline()).decode()
        match = re.search(r"serving on (\S+) .* key (\S+)$", line.strip())
        assert match, line
        base, admin = match.groups()
        await wait_listening(upstream)
        memory = [rss_kib(gateway.pid)]
        limits = httpx.Limits(
            max_connections=args.sessions,
            max_keepalive_connections=args.sessions,
            keepalive_expiry=2.0,  # before the stand-in's uvicorn closes an idle one (5 s)
        )
        admin_auth = {"authorization": f"Bearer {admin}"}
        direct: list[float] = []
        through: list[float] = []
        names: list[str] = []
        async with httpx.AsyncClient(limits=limits, timeout=120, trust_env=False) as http:
            for round_ in range(args.rounds):
                targets = []
                for n in range(args.sessions):
                    name = f"b{round_}-{n}"
                    made = await http.post(
                        base + "/sessions",
                        json={
                            "session_id": name,
                            "uid": f"u{n}",
                            "session_index": 0,
                            "group_size": 1,
                            "partition": "train",
                            "global_step": round_,
                        },
                        headers=admin_auth,
                    )
                    made.raise_for_status()
                    names.append(name)
                    targets.append((made.json()["base_url"], made.json()["api_key"]))
                direct += await drive(
                    http, [(upstream + "/v1", "x")] * args.sessions, args.calls, direct=True
                )
                through += await drive(http, targets, args.calls, direct=False)
                for name in names[-args.sessions :]:
                    ended = await http.post(
                        base + f"/sessions/{name}/end", json={}, headers=admin_auth
                    )
                    ended.raise_for_status()
                memory.append(rss_kib(gateway.pid))
    finally:
        gateway.send_signal(signal.SIGTERM)
        await gateway.wait()
        standin.send_signal(signal.SIGTERM)
        await standin.wait()
    async with Ledger.open(db) as ledger:
        recorded = 0
        for name in names:
            recorded += len((await ledger.load_session(name)).view.recorded_calls())
    figures = {
        "sessions": args.sessions,
        "calls": len(through),
        "recorded": recorded,
        "direct_p50_ms": percentile(direct, 0.5) * 1e3,
        "direct_p99_ms": percentile(direct, 0.99) * 1e3,
        "gateway_p50_ms": percentile(through, 0.5) * 1e3,
        "gateway_p99_ms": percentile(through, 0.99) * 1e3,
        "gateway_rss_mib_at_start_and_after_each_round": [round(m / 1024, 1) for m in memory],
        "cpus": os.cpu_count(),
    }
    figures["added_p50_ms"] = figures["gateway_p50_ms"] - figures["direct_p50_ms"]
    figures["added_p99_ms"] = figures["gateway_p99_ms"] - figures["direct_p99_ms"]
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
