"""Models built on this machine (no downloads), for CPU runs, tests and profiling."""
