"""Warm the pytest parent before it forks ranks (constructing an optimizer imports torch._dynamo, ~6 s per rank)."""

import torch._dynamo  # noqa: F401
