"""A static-shape key/value cache, attached to a model's attention layers for the length of a generation.

Layout: one `(batch, kv_heads, max_len, head_dim)` key and value tensor per attention layer, allocated at the
first (prefill) call from the shapes that layer actually sees (so a tensor-parallel layer caches its local heads).
Prompts are left-aligned into slots by the caller: row `b` holds padding in slots `[0, start[b])`, its prompt up to
slot `prompt_len`, and generated tokens after it, so every row writes the same slot at each decode step and all
shapes stay constant from step to step (what `torch.compile` and CUDA graphs need).

Nothing in the model changes: `attach_kv_cache` swaps each attention layer's `backend` (the seam the attention
block exposes for kernels) for a `CachedAttention` that writes the new keys/values into its slots, then attends
over the whole cache under the mask in `DecodeState`, and puts the original backends back on exit.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional

from d9d.kernels.attention import AttentionBackend, AttentionMask
from d9d.models.blocks.attention import GroupedQueryAttention


@dataclass
class DecodeState:
    """What the current forward writes and may read, shared by every layer's `CachedAttention`.

    `slots`: `(seq,)` cache slots of this forward's tokens. `allowed`: `(batch, 1, seq, max_len)` boolean, whether
    a token may attend to a slot (same-row, not padding, not in its future).
    """

    max_len: int
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    allowed: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.bool))
    # The decode step's `slots` / `allowed`, updated in place from step to step (and generation to generation).
    step_slots: torch.Tensor | None = None
    step_allowed: torch.Tensor | None = None


def allowed_slots(start: torch.Tensor, query_slots: torch.Tensor, max_len: int) -> torch.Tensor:
    """`(batch, 1, seq, max_len)`: query at slot `s` of row `b` sees slots `start[b] <= k <= s`. A padding query
    (`s < start[b]`) sees only itself, so its softmax stays finite; nothing reads its output."""
    keys = torch.arange(max_len, device=start.device)
    causal = keys[None, :] <= query_slots[:, None]  # (seq, max_len)
    in_row = keys[None, None, :] >= start[:, None, None]  # (batch, 1, max_len)
    itself = keys[None, :] == query_slots[:, None]
    return ((causal[None] & in_row) | itself[None])[:, None]


class CachedAttention:
    """An attention backend over a growing key/value cache (plain PyTorch SDPA, any device)."""

    name = "kv_cache"

    def __init__(self, state: DecodeState, batch: int) -> None:
        self.state = state
        self.batch = batch
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    def _allocate(self, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, kv_heads, head_dim = key.shape
        shape = (self.batch, kv_heads, self.state.max_len, head_dim)
        stale = self.key is not None and (
            self.key.shape != shape or self.key.dtype != key.dtype or self.key.device != key.device
        )
        if self.key is None or self.value is None or stale:  # first use, or the model moved or changed dtype
            self.key = torch.zeros(shape, dtype=key.dtype, device=key.device)
            self.value = torch.zeros(shape, dtype=key.dtype, device=key.device)
        return self.key, self.value

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mask: AttentionMask, scale: float
    ) -> torch.Tensor:
        del mask  # the cache's own mask (padding and slots) replaces the model's plain causal one
        batch, seq, heads, head_dim = query.shape
        if batch != self.batch:
            raise ValueError(f"the cache was built for batch {self.batch}, the forward has batch {batch}")
        cache_key, cache_value = self._allocate(key)
        kv_heads = cache_key.shape[1]
        cache_key.index_copy_(2, self.state.slots, key.transpose(1, 2))
        cache_value.index_copy_(2, self.state.slots, value.transpose(1, 2))
        # Grouped heads without copying the cache: the `groups` query heads sharing a key/value head become extra
        # query rows of that head, and the mask repeats over them.
        groups = heads // kv_heads
        q = query.transpose(1, 2).reshape(batch, kv_heads, groups * seq, head_dim)
        allowed = self.state.allowed.repeat(1, 1, groups, 1)
        out = functional.scaled_dot_product_attention(q, cache_key, cache_value, attn_mask=allowed, scale=scale)
        return out.reshape(batch, heads, seq, head_dim).transpose(1, 2).to(query.dtype)


def attention_layers(model: nn.Module) -> list[GroupedQueryAttention]:
    """Every attention block of `model`, in module order."""
    return [module for module in model.modules() if isinstance(module, GroupedQueryAttention)]


# The caches of the last generation per model and shape, reused by the next one of the same shape: the compiled
# decode step then meets the same backend objects and cache tensors and is not recompiled. Stale slots are never
# read (a query only sees slots this generation wrote).
_REUSABLE: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, int], DecodeState, list[CachedAttention]]] = (
    weakref.WeakKeyDictionary()
)


@contextlib.contextmanager
def attach_kv_cache(model: nn.Module, *, batch: int, max_len: int) -> Iterator[DecodeState]:
    """Give each attention layer of `model` a cache for `batch` rows of `max_len` slots until exit."""
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no GroupedQueryAttention layers to cache")
    reusable = _REUSABLE.get(model)
    if reusable is not None and reusable[0] == (batch, max_len) and len(reusable[2]) == len(layers):
        _, state, backends = reusable
    else:
        state = DecodeState(max_len=max_len)
        backends = [CachedAttention(state, batch) for _ in layers]
        _REUSABLE[model] = ((batch, max_len), state, backends)
    originals: list[AttentionBackend] = [layer.backend for layer in layers]
    try:
        for layer, backend in zip(layers, backends, strict=True):
            layer.backend = backend
        yield state
    finally:
        for layer, original in zip(layers, originals, strict=True):
            layer.backend = original
