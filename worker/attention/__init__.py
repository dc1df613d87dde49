"""Attention over the paged KV cache."""
