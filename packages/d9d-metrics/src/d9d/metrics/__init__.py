"""Distributed-aware metrics and experiment trackers for d9d."""
