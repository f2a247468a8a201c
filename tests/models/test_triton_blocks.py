"""Qwen3 dense and MoE with every Triton kernel swapped in match the eager model: losses and all gradients.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 from conftest.py); on a GPU, for real.
"""

import importlib.util

import pytest
import torch
from tiny import EAGER, d9d_from_hf, hf_dense, hf_moe

from d9d.kernels.grouped_mm import TritonGroupedMmConfig
from d9d.kernels.linear_cross_entropy import TritonLinearCrossEntropyConfig
from d9d.kernels.moe_permute import TritonMoePermuteConfig
from d9d.kernels.rms_norm import TritonRmsNormConfig
from d9d.kernels.rope import TritonRopeConfig
from d9d.kernels.swiglu import TritonSwiGluConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

TRITON = EAGER.model_copy(
    update={
        "rms_norm": TritonRmsNormConfig(),
        "swiglu": TritonSwiGluConfig(),
        "rope": TritonRopeConfig(),
        "moe_permute": TritonMoePermuteConfig(),
        "linear_cross_entropy": TritonLinearCrossEntropyConfig(),
        "grouped_mm": TritonGroupedMmConfig(),
    }
)


def _train_step(model, ids, labels):
    output = model(ids, labels=labels)
    output.loss_sum.backward()
    return output.losses.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.parametrize("in_forward", [False, True], ids=["loss-backward", "loss-in-forward"])
def test_triton_blocks_match_eager_losses_and_gradients_fp32(family, in_forward):
    hf = hf_dense() if family == "dense" else hf_moe()
    eager, _ = d9d_from_hf(hf)  # the eager chunked loss, gradients in backward
    fused, _ = d9d_from_hf(hf, config=TRITON.model_copy(update={"loss_gradients_in_forward": in_forward}))
    assert fused.model.norm.rms_norm_kernel.name == "triton" and fused.lm_head.loss_kernel is not None
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, 9), generator=generator)
    labels = torch.randint(0, 96, (2, 9), generator=generator)
    labels[0, :3] = -100
    want_losses, want_grads = _train_step(eager, ids, labels)
    got_losses, got_grads = _train_step(fused, ids, labels)
    # float32 throughout: the kernels differ from the eager ops only in summation order (~1e-6 relative); 3 layers
    # and the loss compound that to a few 1e-6, well inside 1e-4. Routing sees identical router logits (eager ops).
    torch.testing.assert_close(got_losses, want_losses, atol=1e-4, rtol=1e-4)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
