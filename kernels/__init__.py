"""Triton PagedAttention kernels and their plain-torch references."""
