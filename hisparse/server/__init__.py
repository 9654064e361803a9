"""The OpenAI-compatible server: CLI flags (args), wire format (protocol), the engine loop (engine_loop),
the HTTP app (api_server) and Prometheus metrics (metrics)."""
