"""Expert dispatch on CUDA + NCCL: all-to-all and DeepEP (when installed) against the local computation.

Run on the GPU machine (skipped cleanly without 2 GPUs; DeepEP cases skip without `deep_ep`, see
bench/build_deepep.sh). Tokens are bfloat16 (DeepEP's normal mode sends only bf16); every expert scales its rows by
its index + 1 and the result is compared with the same weighted sum done locally in float32. bf16 rounding of the
rows and of the weighted sum bounds the difference: rtol 2e-2, atol 2e-2 on values of order 10 (outputs and token
gradients); routing-weight gradients are sums of 256 bf16 products and get a bound relative to those products.
"""

import importlib.util
import os

import pytest
import torch

from d9d.core.testing import gpu_world_size, run_on_ranks

pytestmark = pytest.mark.gpu

NUM_EXPERTS, TOP_K, HIDDEN, TOKENS = 16, 4, 256, 96


@pytest.mark.parametrize("backend", ["all_to_all", "deep_ep"])
def test_dispatch_then_combine_on_gpus_matches_the_local_computation(backend):
    world = gpu_world_size()
    if world < 2:
        pytest.skip(f"expert dispatch on GPUs needs 2 of them; {world} visible")
    if backend == "deep_ep" and importlib.util.find_spec("deep_ep") is None:
        pytest.skip("deep_ep is not installed (bash bench/build_deepep.sh)")

    def body():
        os.environ["D9D_DEVICE"] = "cuda"
        from d9d.core.dist import DistributedContext, MeshDegrees
        from d9d.kernels.expert_dispatch import AllToAllDispatchConfig, DeepEpDispatchConfig, build_token_dispatcher

        ctx = DistributedContext.build(MeshDegrees(dp_shard=world, ep=world))
        config = AllToAllDispatchConfig() if backend == "all_to_all" else DeepEpDispatchConfig()
        group = ctx.mesh_for("expert")["ep"].get_group()
        dispatcher = build_token_dispatcher(config, group=group, num_experts=NUM_EXPERTS)
        assert dispatcher.name == backend
        generator = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
        scores = torch.rand(TOKENS, NUM_EXPERTS, device=ctx.device, generator=generator)
        indices = torch.topk(scores, TOP_K, dim=-1).indices
        weights = torch.softmax(torch.rand(TOKENS, TOP_K, device=ctx.device, generator=generator), dim=-1)
        x = torch.randn(TOKENS, HIDDEN, device=ctx.device, generator=generator).bfloat16().requires_grad_(True)
        weights.requires_grad_(True)
        dispatched = dispatcher.dispatch(x, indices, weights)
        first = torch.distributed.get_rank(group) * dispatcher.num_local_experts
        local_expert = torch.repeat_interleave(
            torch.arange(dispatcher.num_local_experts, device=ctx.device), dispatched.group_sizes.long()
        )
        scale = (local_expert + first + 1).to(dispatched.rows.dtype)[:, None]
        out = dispatcher.combine(dispatched.rows * scale, dispatched)
        expected = (x.float()[:, None, :] * (indices + 1).float()[..., None] * weights[..., None]).sum(dim=1)
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
        upstream = torch.randn(out.shape, device=ctx.device, generator=generator)
        grad_x, grad_w = torch.autograd.grad((out.float() * upstream).sum(), (x, weights))
        ref_x, ref_w = torch.autograd.grad((expected * upstream).sum(), (x, weights))
        torch.testing.assert_close(grad_x.float(), ref_x.float(), rtol=2e-2, atol=2e-2)
        # A routing weight's gradient is a sum over HIDDEN products taken in bf16 (the rows stay bf16 through
        # combine), so its error scales with the sum of the products' magnitudes, not with the (often cancelling)
        # result: bound it by 4 bf16 epsilons (2**-8 each) of that sum.
        products = x.float().abs()[:, None, :] * (indices + 1).float()[..., None] * upstream.abs()[:, None, :]
        magnitude = products.sum(-1)
        excess = (grad_w.float() - ref_w.float()).abs() - 4 * 2**-8 * magnitude.detach()
        assert excess.max().item() <= 0, f"routing-weight gradient beyond the bf16 bound by {excess.max().item():.3g}"
        ctx.close()

    run_on_ranks(world, body, init_process_group=False, timeout_seconds=300)
