"""Benchmarks: `python -m bench` runs every bench/bench_*.py module and writes bench/results/ (see __main__.py)."""
