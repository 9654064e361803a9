"""Model architectures, their configuration and weight loading."""
