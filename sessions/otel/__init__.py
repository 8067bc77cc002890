"""Sessions as OpenTelemetry traces (issue 45; docs/otel.md)."""
