"""Warm the pytest parent before it forks ranks: constructing a torch optimizer imports torch._dynamo (~6 s),
which every forked rank would otherwise pay again, four at a time on two cores."""

import torch._dynamo  # noqa: F401
