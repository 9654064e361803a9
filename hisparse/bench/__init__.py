"""Micro-benchmarks of the pieces on the decode critical path; each runs as `python -m hisparse.bench.<name>`."""

MAX_REPEATS = 1000  # timed calls per figure, at most: a median of more says nothing new; a typo cannot time for hours
