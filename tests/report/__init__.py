"""The static HTML report."""
