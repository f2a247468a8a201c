"""The data-parallel parity workload on CUDA + NCCL (run on the GPU machine; skipped cleanly without a GPU).

Same models, steps, micro-batches and tolerances as test_data_parallel_parity.py, one rank per GPU (up to 4); HSDP
needs 4 GPUs (2 x 2).
"""

import os

import pytest
import torch
from dp_workloads import TOLERANCES, train_data_parallel

from d9d.core.testing import gpu_world_size, run_on_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*:UserWarning")]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["replicate", "fsdp", "hsdp"])
@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_nccl_training_matches_single_gpu_step_by_step(kind, strategy, bf16):
    world = gpu_world_size()
    if world < 2 or (strategy == "hsdp" and world < 4):
        pytest.skip(f"{strategy} on GPUs needs {4 if strategy == 'hsdp' else 2} of them; {world} visible")

    def body():
        os.environ["D9D_DEVICE"] = "cuda"
        # Plain float32 matmuls (no TF32) so the float32 tolerance means the same as on CPU.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return train_data_parallel(kind, strategy, bf16=bf16, world_size=world)

    deviation = run_on_ranks(world, body, init_process_group=False, timeout_seconds=300)[0]
    print(f"{kind}/{strategy}/{'bf16' if bf16 else 'fp32'} on {world} GPUs: {deviation.describe()}")
    tolerance = TOLERANCES[bf16]
    exceeded = {name: value for name, value in vars(deviation).items() if value > tolerance[name]}
    assert not exceeded, f"{kind}/{strategy} on {world} GPUs: {deviation.describe()}; limits {tolerance}"
