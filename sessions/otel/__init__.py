"""Sessions as OpenTelemetry traces (issue 45; docs/otel.md).

A trace per session, a span per attempt and per model call, sent through the OpenTelemetry SDK's
exporters: `export_otel` sends a run's ended sessions once, `follow_otel` sends sessions as they
end from a checkpoint. The SDK is the `otel` extra and loads only when spans are built.
"""

from sessions.otel.export import (
    OtelExportError,
    OtelExportSummary,
    export_otel,
    otlp_exporter,
)
from sessions.otel.follower import FollowedPage, follow_otel
from sessions.otel.spans import build_spans

__all__ = [
    "FollowedPage",
    "OtelExportError",
    "OtelExportSummary",
    "build_spans",
    "export_otel",
    "follow_otel",
    "otlp_exporter",
]
