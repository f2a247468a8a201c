"""pp=2 x ep=2 (x dp_shard=2): the pipeline workload's tiny Qwen3-MoE (4 experts top-2, z-loss and balance loss) with
its experts sharded over the two data ranks of each stage, through the core Trainer, equals single-process training.

Each stage is parallelised on its own (`parallelize_qwen3_moe` with the rank's pipeline coordinate): the expert domain
`(pp, ep_replicate, ep, tp)` gives every stage its own EP group. float32; besides the pipelined sums, an expert's rows
from two ranks meet in one grouped matmul. Measured: loss 2.4e-8 and grad norm 7.1e-7 relative, parameters 1.8e-6
absolute after 10 steps; asserted with the pp x FSDP parity's loss and norm tolerances (test_pipeline_parity.py) and
1e-5 on parameters (that test's 2e-6 is ten times its own worst case, and AdamW carries the extra reordering of the
expert sums into the parameters).
"""

import pytest
import torch.distributed as dist
from pipeline_workload import errors_against, pipelined_run, shared_reference
from test_pipeline_parity import LOSS_RTOL, NORM_RTOL, ROWS, SCHEDULES, STEPS

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.pipeline import PipelineConfig

PARAM_ATOL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore:.*sequential all_gather operations.*:UserWarning")


@pytest.mark.distributed(world_size=4, timeout=300)
def test_pp2_with_ep2_matches_single_process():
    ctx = DistributedContext.build(MeshDegrees(pp=2, dp_shard=2, ep=2), device="cpu")
    record = pipelined_run(
        ctx, "moe", PipelineConfig(schedule=SCHEDULES["1f1b"]), steps=STEPS, global_rows=ROWS, fsdp=True
    )
    errors = errors_against(record, shared_reference("moe", steps=STEPS, global_rows=ROWS))
    if dist.get_rank() == 0:
        print(
            f"moe 1f1b pp=2 dp_shard=2 ep=2: loss {errors.loss:.1e} norm {errors.norm:.1e} params {errors.params:.1e}"
        )
    assert errors.loss < LOSS_RTOL
    assert errors.norm < NORM_RTOL
    assert errors.params < PARAM_ATOL
