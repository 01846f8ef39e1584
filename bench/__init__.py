"""Benchmarks of ddb-aggregator against the Lambda stream handlers users run today (see run.py)."""
