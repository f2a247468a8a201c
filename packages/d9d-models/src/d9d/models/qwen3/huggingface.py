"""Hugging Face Qwen3 / Qwen3-MoE <-> d9d: checkpoint mappings (d9d-states mappers) and config translation.

d9d keeps Hugging Face's parameter names wherever the tensors are the same, so most of a mapping is identity.
The differences: vocabulary tables are split into segments (`model.embed_tokens.segments.<name>.weight`,
`lm_head.segments.<name>.weight`), the router is `mlp.router.weight` (HF `mlp.gate.weight`), and experts are
stacked `(E, out, in)` per projection (`mlp.experts.gate_proj.weight`, ...). Hugging Face stores experts either
one module per expert (published checkpoints, transformers < 5) or fused (`mlp.experts.gate_up_proj`
`(E, 2I, H)` and `mlp.experts.down_proj`, transformers >= 5 in memory); `Qwen3MoeExpertsFormat` names which.

A checkpoint with tied embeddings (no `lm_head.weight`) loads untied: the head starts as a copy of the embedding.
Every mapping can be built for one pipeline stage: it then reads and produces only that stage's tensors.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from d9d.models.blocks.moe.router import RouterScoring
from d9d.models.blocks.rope_scaling import AnyRopeScaling, LinearRopeScaling, YarnRopeScaling
from d9d.models.qwen3.params import Qwen3DenseParameters, Qwen3MoeParameters
from d9d.models.stage import SINGLE_STAGE, PipelineStage
from d9d.states import mapper as m
from d9d.states.meta import TensorMeta

HF_EMBEDDING = "model.embed_tokens.weight"
HF_HEAD = "lm_head.weight"
HF_NORM = "model.norm.weight"
D9D_EMBEDDING = "model.embed_tokens.segments"
D9D_HEAD = "lm_head.segments"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_TIED_HEAD = "lm_head.weight <- model.embed_tokens.weight"  # an intermediate name, never stored


class Qwen3MoeExpertsFormat(enum.StrEnum):
    PER_EXPERT = "per_expert"
    FUSED = "fused"


@dataclass(frozen=True, kw_only=True)
class Qwen3Layout:
    """What one mapping covers: the vocabulary segments, which layers (dense or MoE), and the stage's ends."""

    segments: Mapping[str, int]
    dense_layers: Sequence[int]
    moe_layers: Sequence[int] = ()
    num_experts: int = 0
    embedding: bool = True
    head: bool = True
    attention_bias: bool = False
    qk_norm: bool = True

    @classmethod
    def of(cls, params: Qwen3DenseParameters, stage: PipelineStage = SINGLE_STAGE) -> Qwen3Layout:
        layers = list(stage.layers(params.num_layers))
        is_moe = params.is_moe_layer if isinstance(params, Qwen3MoeParameters) else (lambda _: False)
        if isinstance(params, Qwen3MoeParameters):
            _check_hf_representable(params)
        return cls(
            segments=params.segments(),
            dense_layers=[i for i in layers if not is_moe(i)],
            moe_layers=[i for i in layers if is_moe(i)],
            num_experts=params.num_experts if isinstance(params, Qwen3MoeParameters) else 0,
            embedding=stage.is_first,
            head=stage.is_last,
            attention_bias=params.attention_bias,
            qk_norm=params.qk_norm,
        )

    def layer_names(self) -> list[str]:
        names = [f"self_attn.{p}_proj.weight" for p in "qkvo"]
        if self.attention_bias:
            names += [f"self_attn.{p}_proj.bias" for p in "qkvo"]
        if self.qk_norm:
            names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        return [*names, "input_layernorm.weight", "post_attention_layernorm.weight"]


def _check_hf_representable(params: Qwen3MoeParameters) -> None:
    if params.shared_expert_intermediate_size > 0 or params.router_expert_bias:
        raise ValueError(
            "the Hugging Face Qwen3-MoE layout has no shared experts and no router expert bias; this model has "
            f"shared_expert_intermediate_size={params.shared_expert_intermediate_size}, "
            f"router_expert_bias={params.router_expert_bias}"
        )
    if params.router_scoring != RouterScoring.SOFTMAX:
        raise ValueError("the Hugging Face Qwen3-MoE router scores with softmax; this model uses sigmoid")


# Mappings ---------------------------------------------------------------------------------------------------------


def _segment_names(prefix: str, segments: Mapping[str, int]) -> list[str]:
    return [f"{prefix}.{name}.weight" for name in segments]


def _split_vocab(source: str, prefix: str, segments: Mapping[str, int]) -> m.ModelStateMapper:
    names = _segment_names(prefix, segments)
    if len(names) == 1:
        return m.Rename({source: names[0]})
    return m.Chunk(source, names, dim=0, sizes=list(segments.values()))


def _join_vocab(prefix: str, segments: Mapping[str, int], target: str) -> m.ModelStateMapper:
    names = _segment_names(prefix, segments)
    return m.Rename({names[0]: target}) if len(names) == 1 else m.Concatenate(names, target, dim=0)


def _experts_from_hf(num_experts: int, experts_format: Qwen3MoeExpertsFormat) -> list[m.ModelStateMapper]:
    mappers: list[m.ModelStateMapper] = [m.Rename({"mlp.gate.weight": "mlp.router.weight"})]
    match experts_format:
        case Qwen3MoeExpertsFormat.PER_EXPERT:
            mappers += [
                m.Stack([f"mlp.experts.{e}.{p}.weight" for e in range(num_experts)], f"mlp.experts.{p}.weight")
                for p in PROJECTIONS
            ]
        case Qwen3MoeExpertsFormat.FUSED:
            mappers += [
                m.Chunk("mlp.experts.gate_up_proj", ["mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight"], 1),
                m.Rename({"mlp.experts.down_proj": "mlp.experts.down_proj.weight"}),
            ]
    return mappers


def _experts_to_hf(num_experts: int, experts_format: Qwen3MoeExpertsFormat) -> list[m.ModelStateMapper]:
    mappers: list[m.ModelStateMapper] = [m.Rename({"mlp.router.weight": "mlp.gate.weight"})]
    match experts_format:
        case Qwen3MoeExpertsFormat.PER_EXPERT:
            mappers += [
                m.Unstack(f"mlp.experts.{p}.weight", [f"mlp.experts.{e}.{p}.weight" for e in range(num_experts)])
                for p in PROJECTIONS
            ]
        case Qwen3MoeExpertsFormat.FUSED:
            mappers += [
                m.Concatenate(
                    ["mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight"], "mlp.experts.gate_up_proj", 1
                ),
                m.Rename({"mlp.experts.down_proj.weight": "mlp.experts.down_proj"}),
            ]
    return mappers


def _per_layer(mapper: m.ModelStateMapper, layers: Iterable[int]) -> list[m.ModelStateMapper]:
    prefixes = [f"model.layers.{i}." for i in layers]
    return [m.PrefixScope(mapper, prefixes)] if prefixes else []


def _layers(
    layout: Qwen3Layout,
    experts: Callable[[int, Qwen3MoeExpertsFormat], list[m.ModelStateMapper]],
    experts_format: Qwen3MoeExpertsFormat,
) -> list[m.ModelStateMapper]:
    dense_mlp = [f"mlp.{p}.weight" for p in PROJECTIONS]
    mappers = _per_layer(m.Identity(layout.layer_names()), [*layout.dense_layers, *layout.moe_layers])
    mappers += _per_layer(m.Identity(dense_mlp), layout.dense_layers)
    if layout.moe_layers:
        mappers += _per_layer(m.Parallel(experts(layout.num_experts, experts_format)), layout.moe_layers)
    return mappers


class _DuplicateOp(m.Op):
    """One tensor under two names (a tied embedding becomes the embedding and the head)."""

    def __init__(self, source: str, copies: Sequence[str]) -> None:
        self.inputs = (source,)
        self.outputs = tuple(copies)

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> m.Tensors:
        tensor = tensors[self.inputs[0]]
        return dict.fromkeys(self.outputs, tensor)

    def infer(self, metas: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
        return dict.fromkeys(self.outputs, metas[self.inputs[0]])


def mapper_from_huggingface_qwen3(
    layout: Qwen3Layout,
    *,
    tied_embeddings: bool = False,
    experts_format: Qwen3MoeExpertsFormat = Qwen3MoeExpertsFormat.PER_EXPERT,
) -> m.ModelStateMapper:
    """Hugging Face names -> d9d names for `layout` (any stage; see `Qwen3Layout.of`).

    With `tied_embeddings` the checkpoint has no `lm_head.weight`: the head reads `model.embed_tokens.weight`, and
    a stage that has both the embedding and the head reads it once and uses it twice.
    """
    mappers = _layers(layout, _experts_from_hf, experts_format)
    head_source = HF_HEAD
    duplicate = tied_embeddings and layout.embedding and layout.head
    if tied_embeddings:
        head_source = _TIED_HEAD if duplicate else HF_EMBEDDING
    if layout.embedding:
        mappers.append(_split_vocab(HF_EMBEDDING, D9D_EMBEDDING, layout.segments))
    if layout.head:
        mappers += [m.Identity(HF_NORM), _split_vocab(head_source, D9D_HEAD, layout.segments)]
    mapper: m.ModelStateMapper = m.Parallel(mappers)
    if duplicate:
        mapper = m.Sequential([m.OpMapper([_DuplicateOp(HF_EMBEDDING, [HF_EMBEDDING, _TIED_HEAD])]), mapper])
    return mapper


def mapper_to_huggingface_qwen3(
    layout: Qwen3Layout, *, experts_format: Qwen3MoeExpertsFormat = Qwen3MoeExpertsFormat.PER_EXPERT
) -> m.ModelStateMapper:
    """d9d names -> Hugging Face names (untied: both `model.embed_tokens.weight` and `lm_head.weight`)."""
    mappers = _layers(layout, _experts_to_hf, experts_format)
    if layout.embedding:
        mappers.append(_join_vocab(D9D_EMBEDDING, layout.segments, HF_EMBEDDING))
    if layout.head:
        mappers += [m.Identity(HF_NORM), _join_vocab(D9D_HEAD, layout.segments, HF_HEAD)]
    return m.Parallel(mappers)


def mapper_from_huggingface_qwen3_dense(
    params: Qwen3DenseParameters, *, stage: PipelineStage = SINGLE_STAGE, tied_embeddings: bool = False
) -> m.ModelStateMapper:
    return mapper_from_huggingface_qwen3(Qwen3Layout.of(params, stage), tied_embeddings=tied_embeddings)


def mapper_to_huggingface_qwen3_dense(
    params: Qwen3DenseParameters, *, stage: PipelineStage = SINGLE_STAGE
) -> m.ModelStateMapper:
    return mapper_to_huggingface_qwen3(Qwen3Layout.of(params, stage))


def mapper_from_huggingface_qwen3_moe(
    params: Qwen3MoeParameters,
    *,
    stage: PipelineStage = SINGLE_STAGE,
    tied_embeddings: bool = False,
    experts_format: Qwen3MoeExpertsFormat = Qwen3MoeExpertsFormat.PER_EXPERT,
) -> m.ModelStateMapper:
    return mapper_from_huggingface_qwen3(
        Qwen3Layout.of(params, stage), tied_embeddings=tied_embeddings, experts_format=experts_format
    )


def mapper_to_huggingface_qwen3_moe(
    params: Qwen3MoeParameters,
    *,
    stage: PipelineStage = SINGLE_STAGE,
    experts_format: Qwen3MoeExpertsFormat = Qwen3MoeExpertsFormat.PER_EXPERT,
) -> m.ModelStateMapper:
    return mapper_to_huggingface_qwen3(Qwen3Layout.of(params, stage), experts_format=experts_format)


# Layouts read off a checkpoint's tensor names (for conversions without a config) ---------------------------------

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def detect_experts_format(names: Iterable[str]) -> Qwen3MoeExpertsFormat:
    """`FUSED` if any name is a fused `mlp.experts.gate_up_proj`, else `PER_EXPERT`."""
    fused = any(name.endswith("mlp.experts.gate_up_proj") for name in names)
    return Qwen3MoeExpertsFormat.FUSED if fused else Qwen3MoeExpertsFormat.PER_EXPERT


def layout_from_names(metas: Mapping[str, TensorMeta], *, d9d_names: bool) -> Qwen3Layout:
    """The layout of a whole checkpoint from its names and shapes (HF names, or d9d names if `d9d_names`)."""
    layers = sorted({int(match.group(1)) for name in metas if (match := _LAYER.match(name))})
    router = "mlp.router.weight" if d9d_names else "mlp.gate.weight"
    moe = [i for i in layers if f"model.layers.{i}.{router}" in metas]
    num_experts = metas[f"model.layers.{moe[0]}.{router}"].shape[0] if moe else 0
    if d9d_names:
        segments = {
            name.removeprefix(D9D_EMBEDDING + ".").removesuffix(".weight"): meta.shape[0]
            for name, meta in metas.items()
            if name.startswith(D9D_EMBEDDING + ".")
        }
    else:
        segments = {"regular": metas[HF_EMBEDDING].shape[0]}
    first = layers[0] if layers else 0
    return Qwen3Layout(
        segments=segments,
        dense_layers=[i for i in layers if i not in moe],
        moe_layers=moe,
        num_experts=num_experts,
        attention_bias=f"model.layers.{first}.self_attn.q_proj.bias" in metas,
        qk_norm=f"model.layers.{first}.self_attn.q_norm.weight" in metas,
    )


# Configs ----------------------------------------------------------------------------------------------------------


def _rope_from_hf(config: Mapping[str, Any]) -> tuple[float, AnyRopeScaling | None]:
    """`rope_theta` and scaling from a config.json: transformers >= 5 (`rope_parameters`) or < 5 (`rope_scaling`)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    match kind:
        case "default":
            return theta, None
        case "linear":
            return theta, LinearRopeScaling(factor=rope["factor"])
        case "yarn":
            fields = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")
            original = rope.get("original_max_position_embeddings") or config["max_position_embeddings"]
            extra = {name: rope[name] for name in fields if rope.get(name) is not None}
            return theta, YarnRopeScaling(factor=rope["factor"], original_max_position_embeddings=original, **extra)
        case _:
            raise ValueError(f"RoPE type {kind!r} of this config is not supported; supported: default, linear, yarn")


def _rope_to_hf(params: Qwen3DenseParameters) -> dict[str, Any]:
    scaling = params.rope_scaling
    match scaling:
        case None:
            return {"rope_theta": params.rope_theta, "rope_scaling": None}
        case LinearRopeScaling():
            return {"rope_theta": params.rope_theta, "rope_scaling": {"rope_type": "linear", "factor": scaling.factor}}
        case YarnRopeScaling():
            fields = scaling.model_dump(exclude={"kind"}, exclude_none=True)
            return {"rope_theta": params.rope_theta, "rope_scaling": {"rope_type": "yarn", **fields}}
        case _:
            raise ValueError(f"RoPE scaling {scaling.kind!r} has no Hugging Face Qwen3 equivalent")


def _common_from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    theta, scaling = _rope_from_hf(config)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    return {
        "vocab_size": config["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": config["intermediate_size"],
        "num_layers": config["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or hidden // heads,
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": config.get("max_position_embeddings", 40960),
        "attention_bias": config.get("attention_bias", False),
        "init_std": config.get("initializer_range", 0.02),
    }


def qwen3_dense_parameters_from_hf(config: Mapping[str, Any]) -> Qwen3DenseParameters:
    """Parameters from a Hugging Face Qwen3 `config.json` (as a dict)."""
    return Qwen3DenseParameters(**_common_from_hf(config))


def qwen3_moe_parameters_from_hf(config: Mapping[str, Any]) -> Qwen3MoeParameters:
    """Parameters from a Hugging Face Qwen3-MoE `config.json` (as a dict)."""
    return Qwen3MoeParameters(
        **_common_from_hf(config),
        num_experts=config.get("num_experts") or config["num_local_experts"],
        num_experts_per_tok=config["num_experts_per_tok"],
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=config.get("norm_topk_prob", False),
        decoder_sparse_step=config.get("decoder_sparse_step", 1),
        mlp_only_layers=list(config.get("mlp_only_layers") or []),
    )


def _common_to_hf(params: Qwen3DenseParameters, dtype: torch.dtype) -> dict[str, Any]:
    if params.rotary_dim not in (None, params.head_dim) or not params.qk_norm:
        raise ValueError("Hugging Face Qwen3 rotates whole heads and always normalises q/k; this model does not")
    return {
        "vocab_size": params.vocab_size,
        "hidden_size": params.hidden_size,
        "intermediate_size": params.intermediate_size,
        "num_hidden_layers": params.num_layers,
        "num_attention_heads": params.num_attention_heads,
        "num_key_value_heads": params.num_key_value_heads,
        "head_dim": params.head_dim,
        "rms_norm_eps": params.rms_norm_eps,
        **_rope_to_hf(params),
        "max_position_embeddings": params.max_position_embeddings,
        "attention_bias": params.attention_bias,
        "initializer_range": params.init_std,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hf_config_from_qwen3_dense(params: Qwen3DenseParameters, *, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """A Hugging Face `config.json` dict for a checkpoint exported with `mapper_to_huggingface_qwen3_dense`.

    `dtype` is the dtype the exported tensors are stored in (transformers loads them in it by default).
    """
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_common_to_hf(params, dtype)}


def hf_config_from_qwen3_moe(params: Qwen3MoeParameters, *, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """A Hugging Face `config.json` dict for a checkpoint exported with `mapper_to_huggingface_qwen3_moe`."""
    _check_hf_representable(params)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_common_to_hf(params, dtype),
        "num_experts": params.num_experts,
        "num_experts_per_tok": params.num_experts_per_tok,
        "moe_intermediate_size": params.moe_intermediate_size,
        "norm_topk_prob": params.norm_topk_prob,
        "decoder_sparse_step": params.decoder_sparse_step,
        "mlp_only_layers": list(params.mlp_only_layers),
    }
