"""Which key positions each query may attend to: causal order, and documents packed into one sequence."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

import torch

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class AttentionMask:
    """Causal masking and, for packed sequences, document masking.

    `document_ids` is `(batch, seq)`: a query attends only to keys of the same row with the same id (and, when
    `causal`, not after itself). Documents must be contiguous runs in a row. `None` means one document per row.
    Built once per forward pass and shared by every layer; derived forms (a dense boolean mask, varlen offsets)
    are computed on first use and cached here.

    The cache is eager-only state. Inside a `torch.compile`d layer Dynamo would guard on the cache's keys: the
    first layer of a forward would trace the build (and the insertion), every later layer another graph reading the
    cached value, and an activation-checkpoint recomputation of the first layer (cache full by then) would run the
    second graph, whose saved tensors differ, which `torch.utils.checkpoint` rejects. So compiled code never sees
    the cache: `dense` builds the mask in the graph (a pure function of `causal` and `document_ids`, which Inductor
    fuses into the masked softmax), and `varlen_offsets` / `derived`, whose builds sync or communicate, run as one
    eager call (a graph break, the same graph for every layer and every recomputation).
    """

    causal: bool = True
    document_ids: torch.Tensor | None = None
    _cache: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def is_plain_causal(self) -> bool:
        """Nothing but causal masking: backends can use their built-in causal mode and no mask tensor."""
        return self.causal and self.document_ids is None

    def derived(self, key: str, build: Callable[[], T]) -> T:
        """`build()` once per mask, cached under `key`: forms of the mask every layer shares (e.g. the document ids
        of a whole context-parallel sequence, gathered once per forward pass instead of once per layer)."""
        if torch.compiler.is_compiling():
            return cast(T, _eager_derived(self, key, build))
        cache_key = f"derived:{key}"
        if cache_key not in self._cache:
            self._cache[cache_key] = build()
        value: T = self._cache[cache_key]  # type: ignore[assignment]  # stored by this method under this key
        return value

    def dense(self, seq_len: int, device: torch.device) -> torch.Tensor | None:
        """A boolean mask broadcastable to `(batch, heads, seq, seq)`, `True` where attention is allowed.

        `None` when nothing is masked (no documents, not causal). Under `torch.compile` built in the graph, uncached
        (see the class docstring).
        """
        if torch.compiler.is_compiling():
            return self._build_dense(seq_len, device)
        key = f"dense:{seq_len}:{device}"
        if key not in self._cache:
            self._cache[key] = self._build_dense(seq_len, device)
        cached = self._cache[key]
        assert cached is None or isinstance(cached, torch.Tensor)
        return cached

    def _build_dense(self, seq_len: int, device: torch.device) -> torch.Tensor | None:
        mask: torch.Tensor | None = None
        if self.causal:
            mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None, None]
        if self.document_ids is not None:
            ids = self.document_ids.to(device)
            if ids.shape[-1] != seq_len:
                raise ValueError(
                    f"document_ids has sequence length {ids.shape[-1]} but attention runs over {seq_len} positions"
                )
            same = (ids[:, :, None] == ids[:, None, :])[:, None]
            mask = same if mask is None else mask & same
        return mask

    def varlen_offsets(self) -> tuple[torch.Tensor, int]:
        """Cumulative document lengths over the flattened `(batch * seq)` tokens (int32) and the longest document.

        This is the `cu_seqlens` / `max_seqlen` pair of variable-length attention kernels.
        """
        if torch.compiler.is_compiling():
            return _eager_varlen_offsets(self)
        if "varlen" not in self._cache:
            self._cache["varlen"] = self._build_varlen()
        cached = self._cache["varlen"]
        assert isinstance(cached, tuple)
        return cached

    def _build_varlen(self) -> tuple[torch.Tensor, int]:
        if self.document_ids is None:
            raise ValueError("varlen offsets need document_ids")
        ids = self.document_ids
        batch, seq = ids.shape
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        positions = starts.reshape(-1).nonzero().squeeze(-1)
        total = torch.tensor([batch * seq], device=ids.device, dtype=positions.dtype)
        offsets = torch.cat([positions, total]).to(torch.int32)
        longest = int((offsets[1:] - offsets[:-1]).max().item())
        return offsets, longest


# The cached lookups compiled code calls eagerly (see `AttentionMask`): Dynamo neither traces nor guards on the cache.
_eager_derived: Callable[[AttentionMask, str, Callable[[], object]], object] = torch.compiler.disable(  # type: ignore[no-untyped-call]  # untyped in torch
    AttentionMask.derived
)
_eager_varlen_offsets: Callable[[AttentionMask], tuple[torch.Tensor, int]] = torch.compiler.disable(  # type: ignore[no-untyped-call]  # untyped in torch
    AttentionMask.varlen_offsets
)
