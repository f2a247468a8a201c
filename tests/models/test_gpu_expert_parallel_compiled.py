"""Expert parallelism with compiled decoder layers (Inductor) on CUDA + NCCL against the same run eager.

Run on the GPU machine (skipped cleanly without 2 GPUs; the DeepEP case without `deep_ep`, see
bench/build_deepep.sh). ep = dp_shard = the GPUs visible (up to 4), the tiny Qwen3-MoE of the CPU parity tests
(routers spread, top-k gaps checked), 3 AdamW steps of 2 micro-batches, the Triton kernels detection picks on the
card, SDPA attention, the eager grouped matmul (float32 needs it; the experts run eagerly under EP anyway).

Both runs share the layout, kernels and initial weights; only Inductor's code for the compiled regions differs, and
each MoE layer's exchange and experts run eagerly in both (design 0025, third round). After the first step nothing
may recompile (`error_on_recompile`): the check the CPU test makes with aot_eager, here with Inductor, the Triton
custom ops in the graphs, NCCL's exchanges between them and torch as installed on the GPU machine.

- `all_to_all`, float32 with TF32 off: Inductor's fused kernels reorder the float32 sums of norms and softmax, a few
  ulps per op. Losses and grad norms within 1e-4 relative; parameters within 1e-3 absolute after 3 AdamW steps at
  lr 3e-3 (AdamW's first steps move a weight by about lr whatever its gradient's size, so a near-zero gradient whose
  sign the reordering flips moves it 2 lr the other way; a wrong gradient would move many weights that far).
- `deep_ep`, bfloat16 mixed precision (DeepEP sends bf16 only): fused kernels round bf16 intermediates at other
  points than eager ops, enough to flip a near-tied routing choice; losses within 1e-2 relative, grad norms within
  5e-2, loads and parameters not compared.
"""

import importlib.util
import os

import pytest

from d9d.core.testing import gpu_world_size, run_on_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*sequential all_gather operations.*:UserWarning"),
]

STEPS = 3
TOLERANCES = {  # loss rtol, grad-norm rtol, parameter atol (None: not compared; see the module docstring)
    "all_to_all": (1e-4, 1e-4, 1e-3),
    "deep_ep": (1e-2, 5e-2, None),
}


def _world() -> int:
    world = gpu_world_size()
    if world < 2:
        pytest.skip(f"needs 2 GPUs; {world} visible")
    return world


@pytest.mark.parametrize("backend", list(TOLERANCES))
def test_compiled_layers_under_expert_parallelism_train_like_eager_on_gpus(backend):
    world = _world()
    if backend == "deep_ep" and importlib.util.find_spec("deep_ep") is None:
        pytest.skip("deep_ep is not installed (bash bench/build_deepep.sh)")
    loss_rtol, norm_rtol, param_atol = TOLERANCES[backend]

    def body():
        os.environ["D9D_DEVICE"] = "cuda"
        import torch._dynamo
        from ep_workload import (
            MIN_TOP_K_GAP,
            Trace,
            build_meta,
            full,
            materialize_with_spread_routers,
            optimizer_for,
            record_top_k_gaps,
            train,
        )
        from torch._dynamo.utils import counters

        from d9d.core.dist import DistributedContext, MeshDegrees
        from d9d.kernels.attention import SdpaAttentionConfig
        from d9d.kernels.expert_dispatch import AllToAllDispatchConfig, DeepEpDispatchConfig
        from d9d.kernels.grouped_mm import EagerGroupedMmConfig
        from d9d.models import DecoderConfig
        from d9d.models.qwen3 import parallelize_qwen3_moe
        from d9d.parallel import FsdpConfig, MixedPrecisionConfig

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        ctx = DistributedContext.build(MeshDegrees(dp_shard=world, ep=world))
        dispatch = AllToAllDispatchConfig() if backend == "all_to_all" else DeepEpDispatchConfig()
        mixed = MixedPrecisionConfig() if backend == "deep_ep" else None

        def run(compiled: bool) -> tuple[Trace, dict[str, torch.Tensor]]:
            torch._dynamo.reset()
            counters.clear()
            config = DecoderConfig(
                attention=SdpaAttentionConfig(),
                grouped_mm=EagerGroupedMmConfig(),
                expert_dispatch=dispatch,
                loss_chunk_size=7,
                compile_layers=compiled,
                compile_backend="inductor",
            )
            model = build_meta(config)
            sync = parallelize_qwen3_moe(model, ctx, FsdpConfig(mixed_precision=mixed))
            materialize_with_spread_routers(model, device=ctx.device)
            trace = Trace()
            # On the eager run only: the hook reads a value to the host, which in a compiled layer is a graph break.
            hooks = [] if compiled else record_top_k_gaps(model, trace)
            optimizer = optimizer_for(model)
            train(model, optimizer, range(1), ctx=ctx, sync=sync, trace=trace)
            graphs = counters["stats"]["unique_graphs"]
            with torch._dynamo.config.patch(error_on_recompile=compiled):
                train(model, optimizer, range(1, STEPS), ctx=ctx, sync=sync, trace=trace)
            if compiled:
                assert graphs > 0, "nothing was compiled"
                assert counters["stats"]["unique_graphs"] == graphs, "steps 2.. compiled new graphs"
            for hook in hooks:
                hook.remove()
            return trace, {name: full(param).detach().clone() for name, param in model.named_parameters()}

        eager, eager_params = run(compiled=False)
        compiled, compiled_params = run(compiled=True)
        torch.testing.assert_close(compiled.losses, eager.losses, rtol=loss_rtol, atol=0)
        torch.testing.assert_close(compiled.grad_norms, eager.grad_norms, rtol=norm_rtol, atol=0)
        if param_atol is not None:  # float32: the same routing, so the same loads and parameters
            assert eager.min_gap > MIN_TOP_K_GAP, f"router top-k near-tie ({eager.min_gap:.2e}): parity is luck"
            for step, (got, want) in enumerate(zip(compiled.loads, eager.loads, strict=True)):
                assert torch.equal(got, want), f"step {step}: expert loads differ"
            for name, want in eager_params.items():
                torch.testing.assert_close(compiled_params[name], want, rtol=0, atol=param_atol, msg=name)
        ctx.close()

    run_on_ranks(world, body, init_process_group=False, timeout_seconds=400)
