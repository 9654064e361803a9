"""Attention backends: the one door through which a model's layers read and write the KV cache, and the
top-k selection of sparse attention. A backend is bound to one step's batch; the model never sees where
the rows live (a paged device pool, a host pool behind hot buffers)."""
