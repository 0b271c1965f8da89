"""Benchmarks: ``python -m benchmarks`` prints ratios against same-run baselines."""
