"""Benchmark programs, each run from the repository root as ``python -m benchmarks.<name>``
(``--help`` lists its flags); results go to ``benchmarks/results/``."""
