"""The Trainer on CUDA + NCCL (run on the GPU machine; skipped cleanly without a GPU).

Tiny dense Qwen3 and Qwen3-MoE, FSDP over 2 (or 4) GPUs, 20 steps with accumulation, float32 with TF32 off:
the per-step losses match single-GPU whole-batch training (same CUDA-drawn initial weights) within 1e-4 (different
reduction orders across ranks and micro-batches; the CPU parity tests hold 2e-5).
"""

import os

import pytest
import torch
from loop_workload import build_tiny_trainer, reference_losses

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.testing import gpu_world_size, run_on_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*:UserWarning")]


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_nccl_trainer_matches_single_process_whole_batch(family):
    world = gpu_world_size()
    if world < 2:
        pytest.skip(f"needs 2 GPUs; {world} visible")

    def body():
        os.environ["D9D_DEVICE"] = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        ctx = DistributedContext.build(MeshDegrees(dp_shard=world), device="cuda")
        trainer = build_tiny_trainer(ctx, family=family, parallel="fsdp", total_steps=20, microbatch_rows=1)
        losses = trainer.train().losses
        ctx.close()
        return [losses[step] for step in range(1, 21)]

    def reference_body():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return reference_losses(family, total_steps=20, device="cuda")

    losses = run_on_ranks(world, body, init_process_group=False, timeout_seconds=300)[0]
    # The reference runs in a forked child too: a backward in this process would break later tests' forked ranks.
    reference = run_on_ranks(1, reference_body, init_process_group=False, timeout_seconds=300)[0]
    worst = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    print(f"{family} FSDP on {world} GPUs: max |loss - single-GPU loss| = {worst:.2e}")
    assert worst <= 1e-4, (losses, reference)
