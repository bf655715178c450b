"""Paged KV cache: layout, block pool, prefix hashes and the cache manager."""
