"""The models on a GPU with the auto-selected fast backends (SDPA, `torch._grouped_mm` on sm90+) against the
eager references on the same GPU (run on the GPU machine; skipped cleanly without CUDA).

bf16 tolerance: each backend rounds differently (about 2^-8 relative per op, accumulated over layers), so logits and
gradients are compared by relative L2 error (2e-2) and gradient direction (cosine > 0.99), not per element. MoE
routing is replayed from the eager model, so a rounding difference cannot flip an expert choice.
"""

import contextlib

import pytest
import torch

from d9d.models import DecoderConfig, materialize_
from d9d.models.qwen3 import Qwen3DenseForCausalLM, Qwen3DenseParameters, Qwen3MoeForCausalLM, Qwen3MoeParameters

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
COMMON = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
MOE = {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128, "norm_topk_prob": True}
MODELS = {
    "dense": (Qwen3DenseForCausalLM, Qwen3DenseParameters(**COMMON)),
    "moe": (Qwen3MoeForCausalLM, Qwen3MoeParameters(**COMMON, **MOE)),
}


def _build(cls, params, config):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cls(params, config=config)
    return materialize_(model, DEVICE).to(torch.bfloat16)


@contextlib.contextmanager
def _replayed_routing(source, target):
    """While active, each MoE router of `target` chooses what the same router of `source` chose last."""
    chosen, hooks = {}, []
    sources = source.model.moe_layers() if hasattr(source.model, "moe_layers") else {}
    targets = target.model.moe_layers() if hasattr(target.model, "moe_layers") else {}
    for index, moe in sources.items():
        hooks.append(
            moe.router.register_forward_hook(lambda m, a, out, i=index: chosen.__setitem__(i, out.expert_indices))
        )
    for index, moe in targets.items():

        def replay(module, args, index=index):
            module.forced_indices = chosen[index]

        hooks.append(moe.router.register_forward_pre_hook(replay))
    try:
        yield
    finally:
        for handle in hooks:
            handle.remove()
        for moe in targets.values():
            moe.router.forced_indices = None


def _relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_fast_backends_match_eager_backends_in_bf16(family, monkeypatch):
    monkeypatch.delenv("D9D_BACKEND_AUTO_ATTENTION", raising=False)
    monkeypatch.delenv("D9D_BACKEND_AUTO_GROUPED_MM", raising=False)
    cls, params = MODELS[family]
    fast = _build(cls, params, DecoderConfig())
    for family_name in ("RMS_NORM", "SWIGLU", "ROPE", "MOE_PERMUTE", "LINEAR_CROSS_ENTROPY"):
        monkeypatch.delenv(f"D9D_BACKEND_AUTO_{family_name}", raising=False)
    # Every kernel family eager (the Triton kernels are what `fast` detects on sm90+ with Triton installed).
    eager = _build(cls, params, DecoderConfig.model_validate({
        "attention": {"kind": "eager"}, "grouped_mm": {"kind": "eager"}, "rms_norm": {"kind": "eager"},
        "swiglu": {"kind": "eager"}, "rope": {"kind": "eager"}, "moe_permute": {"kind": "eager"},
        "linear_cross_entropy": {"kind": "eager"},
    }))  # fmt: skip
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    ids = torch.randint(0, 512, (2, 128), device=DEVICE, generator=generator)
    documents = torch.arange(128, device=DEVICE).div(50, rounding_mode="floor").expand(2, 128)
    for kwargs in ({}, {"document_ids": documents}):
        with _replayed_routing(eager, fast):
            expected = eager(ids, **kwargs).logits
            got = fast(ids, **kwargs).logits
        assert _relative(got, expected) < 2e-2, kwargs.keys()
    with _replayed_routing(eager, fast):
        eager(ids, labels=ids).losses.mean().backward()
        fast(ids, labels=ids).losses.mean().backward()
    for (name, a), b in zip(fast.named_parameters(), eager.parameters(), strict=True):
        assert torch.isfinite(a.grad).all(), name
        cosine = torch.nn.functional.cosine_similarity(a.grad.float().flatten(), b.grad.float().flatten(), dim=0)
        assert cosine > 0.99, f"{name}: gradient cosine {cosine:.4f}"
        assert _relative(a.grad, b.grad) < 5e-2, name
