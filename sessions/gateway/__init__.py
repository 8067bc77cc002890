"""An OpenAI-compatible endpoint that records each model call of a session (issue 42; docs/gateway.md)."""
