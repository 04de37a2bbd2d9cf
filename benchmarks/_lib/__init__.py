"""Helpers the benchmarks share. A benchmark imports these and overlord, never another benchmark.

- ``procfs``: what a run's processes cost, from ``/proc`` (PSS, CPU seconds, process trees).
- ``corpus``: corpora written before a measurement, and the BPE tokenizer trained on one.
- ``mixed``: the torch DataLoader baseline, a mixed and packed token stream (``feed``).
- ``synthetic``: long-tailed synthetic sources and steps for the planning benchmarks.
- ``timing``: pinning to one CPU, and starting a benchmark module in a child process.

Benchmarks run as modules from the repository root: ``python -m benchmarks.NAME``.
"""
