"""Tensor parallelism's plumbing: the collectives (shared memory within a machine, gloo across machines) and how a
model's dimensions split over the ranks. Imports nothing else of hisparse."""
