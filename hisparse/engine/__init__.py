"""Requests, scheduling, the model runner and sampling: what turns a model into a server's engine."""
