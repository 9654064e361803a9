"""The KV memory hierarchy: host pool, per-request device hot buffer, page tables, eviction policies."""
