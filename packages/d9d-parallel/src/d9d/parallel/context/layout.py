"""The load-balanced causal layout: a sequence cut into `2 x cp` chunks, rank `i` holding chunks `i` and `2cp-1-i`.

Under a causal mask the first chunks attend to little and the last to much; pairing chunk `i` with chunk
`2cp-1-i` gives every rank the same number of (query, key) pairs. A rank's local sequence is its two chunks in
global order (head chunk, then tail chunk), so the local order is increasing in global position.
"""

from __future__ import annotations

import torch


def check_divisible(seq_len: int, cp: int) -> None:
    """Raises ValueError unless `seq_len` splits into `2 x cp` equal chunks."""
    if cp < 1:
        raise ValueError(f"cp must be at least 1, got cp={cp}")
    if seq_len % (2 * cp) != 0:
        valid = 2 * cp
        below, above = seq_len - seq_len % valid, seq_len - seq_len % valid + valid
        raise ValueError(
            f"sequence length {seq_len} cannot be split over cp={cp} ranks: the load-balanced layout needs a "
            f"multiple of 2*cp={valid} (e.g. {below or valid} or {above})"
        )


def chunk_indices(rank: int, cp: int) -> tuple[int, int]:
    """The global chunks (head, tail) that `rank` of `cp` holds."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside [0, {cp})")
    return rank, 2 * cp - 1 - rank


def global_positions(rank: int, cp: int, local_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Global sequence index of each of `rank`'s `local_len` local positions (1-D, int64)."""
    if local_len % 2 != 0:
        raise ValueError(f"a local shard holds two equal chunks; its length {local_len} is odd")
    chunk = local_len // 2
    head, tail = chunk_indices(rank, cp)
    return torch.cat(
        [
            torch.arange(head * chunk, (head + 1) * chunk, device=device),
            torch.arange(tail * chunk, (tail + 1) * chunk, device=device),
        ]
    )


def shard_sequence(tensor: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """`rank`'s part of `tensor` along `dim` (head chunk then tail chunk); the identity for `cp=1`."""
    if cp == 1:
        return tensor
    check_divisible(tensor.shape[dim], cp)
    chunks = tensor.chunk(2 * cp, dim=dim)
    head, tail = chunk_indices(rank, cp)
    return torch.cat([chunks[head], chunks[tail]], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (`shards[i]` from cp rank `i`): inverse of `shard_sequence`."""
    cp = len(shards)
    if cp == 1:
        return shards[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        head, tail = chunk_indices(rank, cp)
        chunks[head], chunks[tail] = shard.chunk(2, dim=dim)
    return torch.cat([chunk for chunk in chunks if chunk is not None], dim=dim)
