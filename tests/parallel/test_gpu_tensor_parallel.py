"""Tensor + sequence parallelism on CUDA + NCCL (run on the GPU machine; skipped cleanly without 2 GPUs).

Tiny dense Qwen3 and Qwen3-MoE through the Trainer, tp=2 (x dp_shard=2 with 4 GPUs), 20 steps with accumulation,
float32 with TF32 off: per-step losses within 1e-4 of single-GPU whole-batch training (the same bound as the FSDP GPU
test: other reduction orders; the CPU parity tests hold 2e-5). Then async TP on a compiled model: it must train
(finite, falling loss); its numerics are the compiled kernels', not compared bitwise.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "loop"))  # the Trainer workload of the loop tests
from loop_workload import SEQ, VOCAB, build_tiny, build_tiny_trainer, reference_losses

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.testing import gpu_world_size, run_on_ranks
from d9d.models import materialize_
from d9d.models.qwen3 import parallelize_qwen3_dense
from d9d.models.roles import Role
from d9d.parallel import ByRole, FsdpConfig, select_modules
from d9d.parallel.tensor import TensorParallelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:Slicing a flattened dim:UserWarning"),
]


def _world() -> int:
    world = gpu_world_size()
    if world < 2:
        pytest.skip(f"needs 2 GPUs; {world} visible")
    return world


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_nccl_tp_trainer_matches_single_process_whole_batch(family):
    world = _world()

    def body():
        os.environ["D9D_DEVICE"] = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        ctx = DistributedContext.build(MeshDegrees(dp_shard=world // 2, tp=2), device="cuda")
        trainer = build_tiny_trainer(ctx, family=family, parallel="fsdp", total_steps=20, microbatch_rows=1)
        losses = trainer.train().losses
        ctx.close()
        return [losses[step] for step in range(1, 21)]

    def reference_body():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return reference_losses(family, total_steps=20, device="cuda")

    losses = run_on_ranks(world, body, init_process_group=False, timeout_seconds=300)[0]
    reference = run_on_ranks(1, reference_body, init_process_group=False, timeout_seconds=300)[0]
    worst = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    print(f"{family} tp2 x dp_shard{world // 2} on {world} GPUs: max |loss - single-GPU loss| = {worst:.2e}")
    assert worst <= 1e-4, (losses, reference)


def test_async_tp_trains_a_compiled_model_on_nccl():
    _world()

    def body():
        ctx = DistributedContext.build(MeshDegrees(tp=2), device="cuda")
        model = build_tiny("dense")
        parallelize_qwen3_dense(model, ctx, FsdpConfig(), tensor_parallel=TensorParallelConfig(async_tp=True))
        for _, layer in select_modules(model, [ByRole(str(Role.DECODER_LAYER))]):
            layer.compile()
        torch.manual_seed(0)
        materialize_(model, ctx.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, VOCAB, (2, SEQ), device=ctx.device)  # same on both tp ranks: same seed
        losses = []
        for _ in range(8):
            optimizer.zero_grad()
            loss = model(ids, labels=ids).losses.mean()
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
        ctx.close()
        return losses

    losses = run_on_ranks(2, body, init_process_group=False, timeout_seconds=600)[0]
    print(f"async TP, compiled, 8 steps on one batch: {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
