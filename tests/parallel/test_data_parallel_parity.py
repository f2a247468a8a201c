"""Replicate, FSDP and HSDP (2x2) on 4 gloo ranks match single-process training step by step.

Workload (dp_workloads.py): a small MLP and a small transformer block, 20 AdamW steps, global batch 16 split over
the data-parallel ranks and 2 micro-batches each, variable-length token masks, loss = token sum / exact global token
count, gradients reduced by sum and clipped to a norm that is active on most steps. Every step compares the global
loss, the (pre-clip) gradient norm and every full parameter with the reference.

Tolerances, per dtype:
- float32: 1e-5 relative (loss, norm, parameter L2) and 1e-5 absolute per element. The arithmetic is the same;
  only the summation order differs (per-rank partial sums, micro-batch accumulation, the all-reduce), each
  rounding at float32's 6e-8, over 20 steps. Measured: at most 3e-7.
- bfloat16 compute, float32 master weights and reduction: loss 2e-3, norm 5e-3 and parameter L2 2.5e-2 relative.
  Each micro-batch gradient is rounded to bfloat16 (unit roundoff 2^-8 = 3.9e-3) before the float32 reduction,
  whereas the reference rounds the whole-batch gradient once; Adam's normalised update turns those O(2^-9)
  relative gradient differences into O(lr * 2^-9) per step, summed over 20 steps. No per-element bound: Adam moves
  every element by about +-lr whatever its gradient's size, so an element whose gradient is within bfloat16
  rounding of zero may step the other way (a 2 * lr difference, seen on CUDA), which the per-tensor L2 absorbs.
  Measured on CPU: loss 3.7e-4, norm 1.1e-3, parameter L2 6.5e-3 (element 9.6e-4); on 2 H200s with NCCL:
  parameter L2 3.9e-3 (element 1.0e-2).
"""

import pytest
from dp_workloads import TOLERANCES, train_data_parallel

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["replicate", "fsdp", "hsdp"])
@pytest.mark.parametrize("kind", ["mlp", "block"])
@pytest.mark.distributed(world_size=4, timeout=120)
def test_training_matches_single_process_step_by_step(kind, strategy, bf16):
    deviation = train_data_parallel(kind, strategy, bf16=bf16)
    tolerance = TOLERANCES[bf16]
    exceeded = {name: value for name, value in vars(deviation).items() if value > tolerance[name]}
    assert not exceeded, f"{kind}/{strategy}/{'bf16' if bf16 else 'fp32'}: {deviation.describe()}; limits {tolerance}"
