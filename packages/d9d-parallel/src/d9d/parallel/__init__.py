"""Horizontal parallelism for d9d: replicate, FSDP, HSDP, tensor, sequence, context and expert parallel."""
