"""Benchmarks: one harness (``benchmarks.harness``) and one script per scenario."""
