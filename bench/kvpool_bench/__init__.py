"""Benchmarks for kvpool, including optional third-party baselines."""
