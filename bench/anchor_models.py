"""The two anchor workloads of ../shared/reference/anchors.md, shared by every benchmark script.

Shared: Qwen3 attention (16 query heads, 8 KV heads, head_dim 128, RoPE theta 1e6), vocabulary 151,936.
- `DENSE`: the Qwen3-0.6B shape (hidden 1024, 28 layers, FFN 3072), batch `DENSE_BATCH` (4 x 4096) per GPU;
- `MOE`: hidden 1024, 8 layers all MoE, 64 experts top-8, expert FFN 768, renormalised top-k, no shared expert,
  batch `MOE_BATCH` (2 x 4096) per GPU.

`tiny(params)` is the seconds-long CPU stand-in every script's `--tiny` flag uses (it checks the script, not the
numbers); `flops_per_token` is the MFU numerator of anchors.md. Scripts import this module by name (`python
bench/x.py` and `torchrun bench/x.py` put `bench/` on `sys.path`).
"""

from __future__ import annotations

from typing import TypeVar

from d9d.models.qwen3 import Qwen3DenseParameters, Qwen3MoeParameters

PEAK_TFLOPS = 989.0  # H100 SXM dense bf16, as in anchors.md

_ATTENTION = {
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 1e6,
    "vocab_size": 151936,
}
DENSE = Qwen3DenseParameters(hidden_size=1024, intermediate_size=3072, num_layers=28, **_ATTENTION)
MOE = Qwen3MoeParameters(
    hidden_size=1024,
    intermediate_size=3072,  # unused: every layer is MoE
    num_layers=8,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    **_ATTENTION,
)
DENSE_BATCH = (4, 4096)  # rows x sequence per GPU
MOE_BATCH = (2, 4096)

_TINY = {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_attention_heads": 4}
_TINY |= {"num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024}
_TINY |= {"num_experts": 8, "moe_intermediate_size": 64, "num_experts_per_tok": 2}

P = TypeVar("P", Qwen3DenseParameters, Qwen3MoeParameters)


def tiny(params: P) -> P:
    """`params` at the tiny CPU size (the fields its family has)."""
    return params.model_copy(update={k: v for k, v in _TINY.items() if k in type(params).model_fields})


def flops_per_token(params: Qwen3DenseParameters, seq: int) -> float:
    """6 x non-embedding parameters active per token (LM head included) + 12 x layers x heads x head_dim x seq."""
    h, q, kv, d = params.hidden_size, params.num_attention_heads, params.num_key_value_heads, params.head_dim
    attention = h * q * d * 2 + h * kv * d * 2 + 2 * d + 2 * h
    if isinstance(params, Qwen3MoeParameters):
        ffn = params.num_experts_per_tok * 3 * h * params.moe_intermediate_size + params.num_experts * h
    else:
        ffn = 3 * h * params.intermediate_size
    dense = params.num_layers * (attention + ffn) + h + params.vocab_size * h
    return 6 * dense + 12 * params.num_layers * q * d * seq


def parameter_shapes(params: Qwen3DenseParameters) -> list[tuple[int, ...]]:
    """The shapes of the causal-LM model's parameters, in `model.parameters()` order (built on the meta device)."""
    import torch

    from d9d.models.qwen3 import Qwen3DenseForCausalLM, Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(params) if isinstance(params, Qwen3MoeParameters) else Qwen3DenseForCausalLM(params)
    return [tuple(param.shape) for param in model.parameters()]
