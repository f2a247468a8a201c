"""Expert-parallel training replayed as a CUDA graph (`CudaGraphedStep`, design 0031) against the same steps eager.

Tiny Qwen3-MoE on NCCL, ep over every visible GPU (2 to 4), dense parameters replicated (bucketed float32
all-reduce), bfloat16 compute as in training (the grouped matmuls' sync-free backend takes bfloat16), the
static-capacity exchanges at capacities that cannot drop (`all_to_all_capacity` at capacity_factor = ep,
`all_to_all_tokens` at copy_capacity_factor = ep). The graphed run captures forward, backward and the gradient
all-reduce once and replays them; clipping and AdamW stay eager. Each step's batch is copied into the captured input
tensors. The eager run is the same code without the capture, the same kernels on the same data, so the two differ
only where a kernel adds in a scheduling-dependent order (attention's backward accumulates with atomics): losses and
grad norms to 1e-3 relative, a few bfloat16 roundings of the gradients; parameters after 6 AdamW steps at lr 1e-4 to
2e-4 absolute, a third of the updates' size. A capture that replayed stale inputs or lost the gradient all-reduce
fails by far more: the losses change every step, and a missing all-reduce changes the grad norm by about sqrt(ep).

Skipped cleanly without 2 GPUs.
"""

import faulthandler
import os

import pytest
import torch

from d9d.core.testing import gpu_world_size, run_on_ranks

pytestmark = pytest.mark.gpu

STEPS = 6
LR = 1e-4
TIMEOUT = 130
LOSS_RTOL, PARAM_ATOL = 1e-3, 2e-4


def _train(ctx, graphed: bool, exchange_kind: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    from ep_workload import PARAMS, VOCAB, materialize_with_spread_routers

    from d9d.core.loop import CudaGraphedStep
    from d9d.kernels.expert_dispatch import AllToAllCapacityDispatchConfig, AllToAllTokensDispatchConfig
    from d9d.models import DecoderConfig
    from d9d.models.qwen3 import Qwen3MoeForCausalLM, parallelize_qwen3_moe
    from d9d.parallel import MixedPrecisionConfig, ReplicateConfig, clip_grad_norm_

    world = ctx.world_size
    exchange = (
        AllToAllCapacityDispatchConfig(capacity_factor=float(world))
        if exchange_kind == "copies"
        else AllToAllTokensDispatchConfig(copy_capacity_factor=float(world))
    )
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(PARAMS, config=DecoderConfig(expert_dispatch=exchange))
    sync = parallelize_qwen3_moe(model, ctx, ReplicateConfig(mixed_precision=MixedPrecisionConfig()))
    materialize_with_spread_routers(model, device=ctx.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)
    ids = torch.zeros(4, 16, dtype=torch.long, device=ctx.device)
    labels = torch.zeros_like(ids)

    def forward_backward() -> torch.Tensor:
        sync.begin_step(1)
        loss = model(ids, labels=labels).losses.sum() / (ids.numel() * world)
        loss.backward()
        sync.wait()
        return loss.detach()

    run = CudaGraphedStep(forward_backward, warmup=2) if graphed else forward_backward
    losses, norms = [], []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * step + ctx.rank)
        ids.copy_(torch.randint(0, VOCAB, ids.shape, generator=generator))
        labels.copy_(torch.randint(0, VOCAB, ids.shape, generator=generator))
        loss = run().clone()
        norms.append(float(clip_grad_norm_(params, 1.0)))
        optimizer.step()
        torch.distributed.all_reduce(loss)
        losses.append(float(loss))
    full = {name: p.full_tensor().cpu() for name, p in model.named_parameters()}
    return losses, norms, full


@pytest.mark.parametrize("exchange_kind", ["copies", "tokens"])
def test_graphed_expert_parallel_steps_train_like_eager_ones(exchange_kind):
    world = gpu_world_size()
    if world < 2:
        pytest.skip(f"expert parallelism on GPUs needs 2 of them; {world} visible")

    def body():
        os.environ["D9D_DEVICE"] = "cuda"
        from d9d.core.dist import DistributedContext, MeshDegrees

        # Where each thread is, on stderr, if this hangs (NCCL or a graph replay blocks in the driver, where the
        # harness's SIGUSR1 stack dump does not get through).
        faulthandler.dump_traceback_later(TIMEOUT - 15, exit=False)
        # One process group for both runs: a second init after destroying the first can hang on NCCL.
        ctx = DistributedContext.build(MeshDegrees(dp_replicate=world, ep=world))
        eager = _train(ctx, graphed=False, exchange_kind=exchange_kind)
        graphed = _train(ctx, graphed=True, exchange_kind=exchange_kind)
        faulthandler.cancel_dump_traceback_later()
        ctx.close()
        return eager, graphed

    (eager_losses, eager_norms, eager_params), (losses, norms, params) = run_on_ranks(
        world, body, init_process_group=False, timeout_seconds=TIMEOUT
    )[0]
    assert len(set(eager_losses)) == STEPS, "every step trains on a new batch: the losses must differ"
    torch.testing.assert_close(losses, eager_losses, rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(norms, eager_norms, rtol=LOSS_RTOL, atol=0)
    for name, value in params.items():
        torch.testing.assert_close(value, eager_params[name], rtol=0, atol=PARAM_ATOL, msg=name)
