"""Reproducible throughput benchmarks against named baselines."""
