"""The benchmark suite's smoke run and its tables (figures are measured in benchmarks/, not here)."""
