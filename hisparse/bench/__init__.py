"""Micro-benchmarks of the pieces on the decode critical path; each runs as `python -m hisparse.bench.<name>`."""
