"""Reads for one caller each: the dataset export, the report, the trackers' failure samples and
the `sql` verb's read-only console. Import from the modules below."""
