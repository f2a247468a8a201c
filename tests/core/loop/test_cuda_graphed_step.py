"""`CudaGraphedStep`'s refusals on this machine; the capture and replay are tested on GPUs
(tests/models/test_gpu_cuda_graphed_step.py: graphed expert-parallel training equals eager training)."""

import pytest
import torch

from d9d.core.loop import CudaGraphedStep


def test_a_warmup_below_one_is_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"warmup must be at least 1.*got warmup=0"):
        CudaGraphedStep(lambda: torch.zeros(()), warmup=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_is_refused_before_anything_runs():
    ran = []

    def body() -> torch.Tensor:
        ran.append(True)
        return torch.zeros(())

    with pytest.raises(RuntimeError, match="needs CUDA"):
        CudaGraphedStep(body)
    assert not ran
