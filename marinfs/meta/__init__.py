"""Metadata: the stat, listing and negative caches, and the listings fetched ahead of a walker."""
