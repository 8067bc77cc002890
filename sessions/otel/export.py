"""A run's settled sessions, read from the log, sent to an OpenTelemetry receiver (docs/otel.md).

The export reads as of the projector's checkpoint (as the dataset export does): the sessions of
the run (and step range) that had ended by then, page by page, each page's streams in one read
(`EventStore.read_streams`), turned into spans (`spans.py`) and handed to a span exporter: the
SDK's OTLP/HTTP exporter for a real receiver, its in-memory exporter in the tests. Ids are
derived, so a second export sends the same spans again and a viewer that keys on span ids
shows each once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sessions import events as ev
from sessions.errors import ConfigError, LedgerError, NotFound
from sessions.export.dataset import parse_steps
from sessions.otel import attributes as A
from sessions.otel.spans import build_spans, require_sdk
from sessions.report.text import visible
from store import export_reads
from store import read_models as rm

__all__ = [
    "OtelExportError",
    "OtelExportSummary",
    "export_otel",
    "otlp_exporter",
    "parse_header",
    "resource_for",
    "send_spans",
    "session_spans",
]

#: Sessions read, turned into spans and sent per request.
DEFAULT_PAGE_SIZE = 200
_TERMINAL = ("succeeded", "failed", "cancelled")
_ROW_COLUMNS = ["session_id", "uid", "state", "reward"]


class OtelExportError(LedgerError, RuntimeError):
    """The receiver refused the spans or did not answer."""


@dataclass(frozen=True)
class OtelExportSummary:
    """What one export sent: sessions by state, spans, requests, and how long it took."""

    run: str
    sessions: dict[str, int] = field(default_factory=dict)
    spans: int = 0
    requests: int = 0
    seconds: float = 0.0
    #: sessions of the selection still open at the checkpoint: not exported (they have no end)
    open: int = 0

    def lines(self) -> list[str]:
        total = sum(self.sessions.values())
        states = ", ".join(f"{n} {s}" for s, n in sorted(self.sessions.items())) or "none"
        out = [
            f"exported {total} sessions of run {visible(self.run)!r} ({states}) as {total} traces, "
            f"{self.spans} spans in {self.requests} requests, in {self.seconds:.1f}s"
        ]
        if self.open:
            out.append(
                f"left out {self.open} sessions still open at the projector's checkpoint "
                "(export again once they end, or follow the run with --follow)"
            )
        return out


def parse_header(text: str, *, flag: str = "--header") -> tuple[str, str]:
    """`K=V` as (K, V): the form of OTLP's own OTEL_EXPORTER_OTLP_HEADERS entries."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        example = "wandb.project=NAME" if flag == "--resource" else "'authorization=Bearer TOKEN'"
        raise ConfigError(f"{flag} {text!r} is not KEY=VALUE; e.g. {flag} {example}")
    return key.strip(), value.strip()


def traces_url(endpoint: str) -> str:
    """`endpoint` with OTLP's traces path when it names only a host (`http://host:6006`)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            f"--endpoint {endpoint!r} is not an http(s) URL; e.g. http://127.0.0.1:6006/v1/traces"
        )
    if parts.path in ("", "/"):
        parts = parts._replace(path="/v1/traces")
    return urlunsplit(parts)


def otlp_exporter(
    endpoint: str, headers: Mapping[str, str] | None = None, *, timeout_s: float = 30.0
) -> Any:
    """The SDK's OTLP/HTTP (protobuf) span exporter for `endpoint`, with `headers` on each
    request (an API key, a project name)."""
    require_sdk()
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as error:
        from sessions.errors import MissingDependency

        raise MissingDependency(
            f"the OTLP export needs opentelemetry-exporter-otlp-proto-http ({error}); "
            "install the otel extra: pip install -e '.[otel]'"
        ) from error
    return OTLPSpanExporter(
        endpoint=traces_url(endpoint), headers=dict(headers or {}), timeout=timeout_s
    )


def resource_for(
    run: str, project: str | None = None, extra: Mapping[str, str] | None = None
) -> Any:
    """The resource every span of a run carries: the service, the run, the Phoenix project
    (default: the run's name, so each run is a project of its own there), and `extra` (W&B
    Weave routes by `wandb.entity` and `wandb.project`)."""
    require_sdk()
    from opentelemetry.sdk.resources import Resource

    shown = visible(run)
    return Resource.create(
        {
            "service.name": A.SERVICE_NAME,
            A.RUN: shown,
            "openinference.project.name": visible(project) if project else shown,
            **{visible(k): visible(v) for k, v in (extra or {}).items()},
        }
    )


def session_spans(
    streams: Mapping[str, Sequence[Any]], rows: Sequence[Mapping[str, Any]], resource: Any
) -> list[Any]:
    """The spans of each session of `rows` (in their order), from its stored stream."""
    out: list[Any] = []
    for row in rows:
        sid = row["session_id"]
        recorded = [ev.decode(stored) for stored in streams.get(sid, ())]
        out.extend(build_spans(sid, recorded, reward=row.get("reward"), resource=resource))
    return out


async def send_spans(exporter: Any, spans: Sequence[Any]) -> None:
    """Hand `spans` to the exporter (off the event loop: OTLP's HTTP client blocks), or raise."""
    if not spans:
        return
    from opentelemetry.sdk.trace.export import SpanExportResult

    result = await asyncio.to_thread(exporter.export, list(spans))
    if result is not SpanExportResult.SUCCESS:
        raise OtelExportError(
            f"the receiver did not take {len(spans)} spans (the exporter said {result.name}); "
            "check that --endpoint is the receiver's OTLP/HTTP traces URL and that --header "
            "carries what it needs (docs/otel.md), then export again: ids repeat, nothing doubles"
        )


async def export_otel(
    ledger: Any,
    exporter: Any,
    *,
    run: str | None = None,
    steps: Any = None,
    project: str | None = None,
    resource: Mapping[str, str] | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    on_progress: Callable[[int, int], None] | None = None,
) -> OtelExportSummary:
    """Send a run's sessions that had ended by the projector's checkpoint to `exporter`, one
    trace per session; see docs/otel.md.

    `ledger`: an open `Ledger` (its engine and its store are read). `run`: default the ledger's,
    else the run of the log's latest event. `steps`: N, (A, B) or 'A:B', both ends included.
    `project` and `resource`: see `resource_for`. `on_progress(done, total)` after each page, in sessions."""
    require_sdk()
    started = time.perf_counter()
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ConfigError(f"page_size must be an integer >= 1, got {page_size!r}")
    step_min, step_max = parse_steps(steps)
    engine, store = ledger.engine, ledger.store
    sessions: dict[str, int] = {}
    spans = requests = 0
    async with engine.connect() as conn:
        checkpoint, _ = await export_reads.snapshot(conn)
        run = run or getattr(ledger, "run", None) or await rm.latest_run(conn)
        if run is None:
            raise NotFound(
                "the database has no events yet; record sessions (or run `rollout-ledger demo`) first"
            )
        if not await export_reads.run_has_events(conn, run):
            raise NotFound(
                f"run {visible(run)!r} has no sessions in this database; pass another run"
            )
        which = export_reads.SessionFilter(run, None, step_min, step_max)
        counts = await export_reads.count_sessions(conn, which, checkpoint)
        total = sum(counts.get(s, 0) for s in _TERMINAL)
        spans_resource = resource_for(run, project, resource)
        after: tuple[str, str] | None = None
        done = 0
        while True:
            page = await export_reads.session_page(
                conn,
                which,
                states=_TERMINAL,
                up_to=checkpoint,
                after=after,
                limit=page_size,
                columns=_ROW_COLUMNS,
            )
            if not page:
                break
            after = (page[-1]["uid"], page[-1]["session_id"])
            streams = await store.read_streams(
                [row["session_id"] for row in page], with_payload=False
            )
            built = session_spans(streams, page, spans_resource)
            await send_spans(exporter, built)
            spans += len(built)
            requests += 1 if built else 0
            for row in page:
                sessions[row["state"]] = sessions.get(row["state"], 0) + 1
            done += len(page)
            if on_progress is not None:
                on_progress(done, total)
    return OtelExportSummary(
        run=run,
        sessions=sessions,
        spans=spans,
        requests=requests,
        seconds=time.perf_counter() - started,
        open=counts.get("open", 0),
    )
