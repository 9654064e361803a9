"""Commands that make or inspect model files: `python -m hisparse.tools.<name>`."""
