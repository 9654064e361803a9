"""Kernels of the decode step, each fast one beside a plain-PyTorch reference with the same signature.

The package imports nothing eagerly: the Triton kernels need the optional `triton` package.
"""
