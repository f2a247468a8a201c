"""ep=2 x cp=2 (4 gloo ranks, dp_shard=2): tiny Qwen3-MoE with ring attention over packed documents and its experts
sharded over an expert group that folds over the data and context ranks, trained 10 steps through the Trainer with
2 micro-batches per rank, equals one process training on the same global batch.

The MoE block routes each rank's sequence shard: under cp the ranks of a cp group hold different tokens of the same
rows, and the expert group (`ep` folds over `dp_shard x cp`) mixes them, so a token may leave its context rank for
an expert on a rank of another data rank and come back. The router z-loss (a mean over tokens) counts 1/cp per shard
(the workload's MoE has no load-balancing loss: that one is a product of per-shard means, see the cp tests).
No router top-k near-ties (router weights drawn wider, the smallest gap checked on the reference): otherwise a
rounding difference could flip a token's expert.

Tolerances as tests/models/test_context_parallel_training.py (float32, sums in another order: ring attention's
online softmax, all-to-all gathered expert rows, FSDP's reductions): 1e-5 on loss, grad norm (relative) and
parameters after 10 AdamW steps; measured worst printed (docs/parallelism.md).
"""

import pytest
import torch.distributed as dist
from cp_workload import train_distributed, train_reference
from ep_workload import MIN_TOP_K_GAP, ROUTER_STD, Trace, record_top_k_gaps

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.kernels.expert_dispatch import AllToAllDispatcher
from d9d.models.blocks.moe import MoELayer

pytestmark = pytest.mark.filterwarnings(
    "ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning",
    "ignore:.*sequential all_gather operations.*:UserWarning",
)

STEPS, GLOBAL_ROWS = 10, 4
TOLERANCE = 1e-5


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.distributed(world_size=4, timeout=600)
def test_ep_x_cp2_training_equals_one_process(ep):
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, cp=2, ep=ep), device="cpu")
    run = train_distributed(ctx, "moe", STEPS, GLOBAL_ROWS, "ring", router_std=ROUTER_STD)
    layers = [module for module in run.model.modules() if isinstance(module, MoELayer)]
    assert layers and all(isinstance(layer.dispatcher, AllToAllDispatcher) for layer in layers)
    local_experts = layers[0].experts.gate_proj.weight.to_local().shape[0]
    assert local_experts * ep * ctx.degrees.expert_replicate() >= layers[0].num_experts
    if ctx.rank == 0:  # the reference once (4 ranks share 2 cores)
        trace = Trace()
        reference = train_reference(
            "moe", STEPS, GLOBAL_ROWS, prepare=lambda model: record_top_k_gaps(model, trace), router_std=ROUTER_STD
        )
        assert trace.min_gap > MIN_TOP_K_GAP, f"router top-k near-tie ({trace.min_gap:.2e}): parity would be luck"
        loss = max(abs(a - b) for a, b in zip(run.losses, reference.losses, strict=True))
        norm = max(abs(a - b) / b for a, b in zip(run.grad_norms, reference.grad_norms, strict=True))
        params = max(float((run.params[name] - value).abs().max()) for name, value in reference.params.items())
        print(
            f"ep={ep} x cp=2 x dp_shard=2: loss {loss:.1e} norm {norm:.1e} params {params:.1e}, gap {trace.min_gap:.1e}"
        )
        assert loss <= TOLERANCE, (run.losses, reference.losses)
        assert norm <= TOLERANCE, (run.grad_norms, reference.grad_norms)
        assert params <= TOLERANCE
    dist.barrier()
