"""Bulk I/O at driver level, for replay and audit: copying the log between databases, reading
whole logs and writing whole read models. Import from the modules below."""
