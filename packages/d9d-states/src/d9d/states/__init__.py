"""Streaming, graph-based model-state conversion over sharded safetensors."""
