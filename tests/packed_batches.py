"""Packed global batches for the multi-rank parity tests: random tokens in documents of random lengths, labels
shifted within documents and a fifth of them ignored, so document masks, position resets and ignored labels all
matter. Shared by the context-parallel workloads of tests/models and tests/pipeline."""

from __future__ import annotations

import torch


def packed_global_batch(step: int, *, rows: int, seq: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Step `step`'s global batch `(rows, seq)`: `input_ids`, `labels` (-100: no loss) and `document_ids`; the
    same for the same arguments on every rank (its own generator seeded by `seed + step`)."""
    generator = torch.Generator().manual_seed(seed + step)
    tokens = torch.randint(0, vocab, (rows, seq), generator=generator)
    documents = []
    for _ in range(rows):
        lengths: list[int] = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(2, seq // 2 + 2, (1,), generator=generator)))
        documents.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq])
    document_ids = torch.stack(documents)
    labels = torch.full_like(tokens, -100)
    same = document_ids[:, 1:] == document_ids[:, :-1]
    labels[:, :-1] = torch.where(same, tokens[:, 1:], -100)
    labels[torch.rand(labels.shape, generator=generator) < 0.2] = -100
    return {"input_ids": tokens, "labels": labels, "document_ids": document_ids}
