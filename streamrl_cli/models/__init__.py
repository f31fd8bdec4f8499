"""Models: built on this machine (no downloads) for CPU runs, tests and profiling; their architecture
as a model directory states it; their vocabulary as a fingerprint."""
