"""How many ranks a GPU test can start: one per visible GPU."""

from __future__ import annotations

import torch


def gpu_world_size(limit: int | None = 4) -> int:
    """One rank per visible CUDA device, at most `limit` (None: all of them); 1 without CUDA, so a size check such as
    `world < 2` still reads naturally (tests marked `gpu` are skipped there anyway)."""
    if not torch.cuda.is_available():
        return 1
    count = torch.cuda.device_count()
    return count if limit is None else min(count, limit)
