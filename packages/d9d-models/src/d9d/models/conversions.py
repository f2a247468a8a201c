"""Named checkpoint conversions (`d9d convert --list`): a mapping factory per name, plus the config translation.

Each factory reads a checkpoint's tensor names and shapes (layers, experts, expert layout, tied embeddings) and
builds the d9d-states mapper, so a conversion needs no model code to run and no config for the tensors. The config
hook, when the source directory has one, writes the destination's: Hugging Face `config.json` <-> d9d
`parameters.json` (the model's kind and `*Parameters`, `d9d.models.catalogue`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from d9d.core.checkpoint import write_durable
from d9d.models.catalogue import (
    PARAMETERS_FILE,
    AnyModelParameters,
    model_kind,
    read_parameters,
    write_parameters,
)
from d9d.models.qwen3.huggingface import (
    Qwen3MoeExpertsFormat,
    detect_experts_format,
    hf_config_from_qwen3_dense,
    hf_config_from_qwen3_moe,
    layout_from_names,
    mapper_from_huggingface_qwen3,
    mapper_to_huggingface_qwen3,
    qwen3_dense_parameters_from_hf,
    qwen3_moe_parameters_from_hf,
)
from d9d.models.qwen3.params import Qwen3MoeParameters
from d9d.states import CheckpointSource, MappingError, ModelStateMapper, TensorMeta

HF_CONFIG = "config.json"

MappingFactory = Callable[[Mapping[str, TensorMeta]], ModelStateMapper]


@dataclass(frozen=True, kw_only=True)
class NamedMapping:
    name: str
    description: str
    factory: MappingFactory
    convert_config: Callable[[Path, Path, torch.dtype | None], None]
    source_parameters: Callable[[Path], AnyModelParameters]  # the model a source directory holds, from its config


def _require_family(metas: Mapping[str, TensorMeta], *, moe: bool, d9d_names: bool, name: str) -> None:
    router = "mlp.router.weight" if d9d_names else "mlp.gate.weight"
    has_moe = any(key.endswith(router) for key in metas)
    if has_moe != moe:
        other = name.replace("qwen3-moe-", "qwen3-") if has_moe is False else name.replace("qwen3-", "qwen3-moe-")
        found = "MoE layers" if has_moe else "no MoE layers"
        raise MappingError(f"mapping {name!r}: the checkpoint has {found}; use {other!r}")


def _from_hf(name: str, *, moe: bool) -> MappingFactory:
    def factory(metas: Mapping[str, TensorMeta]) -> ModelStateMapper:
        _require_family(metas, moe=moe, d9d_names=False, name=name)
        return mapper_from_huggingface_qwen3(
            layout_from_names(metas, d9d_names=False),
            tied_embeddings="lm_head.weight" not in metas,
            experts_format=detect_experts_format(metas),
        )

    return factory


def _to_hf(name: str, *, moe: bool, experts_format: Qwen3MoeExpertsFormat) -> MappingFactory:
    def factory(metas: Mapping[str, TensorMeta]) -> ModelStateMapper:
        _require_family(metas, moe=moe, d9d_names=True, name=name)
        return mapper_to_huggingface_qwen3(layout_from_names(metas, d9d_names=True), experts_format=experts_format)

    return factory


def _hf_parameters(*, moe: bool) -> Callable[[Path], AnyModelParameters]:
    def read(source: Path) -> AnyModelParameters:
        config_file = source / HF_CONFIG
        if not config_file.is_file():
            raise FileNotFoundError(f"{source} has no {HF_CONFIG}: the model's shape is unknown")
        config = json.loads(config_file.read_text())
        return qwen3_moe_parameters_from_hf(config) if moe else qwen3_dense_parameters_from_hf(config)

    return read


def _d9d_parameters(source: Path) -> AnyModelParameters:
    if not (source / PARAMETERS_FILE).is_file():
        raise FileNotFoundError(f"{source} has no {PARAMETERS_FILE}: the model's shape is unknown")
    return read_parameters(source)


def _stored_dtype(source: Path) -> torch.dtype:
    """The floating dtype the checkpoint's weights are stored in (what `config.json`'s dtype must say, so that
    `transformers` loads them unrounded); bfloat16 when it has none."""
    metas = CheckpointSource.open(source).metas().values()
    return next((meta.dtype for meta in metas if meta.dtype.is_floating_point), torch.bfloat16)


def _hf_config_to_parameters(*, moe: bool) -> Callable[[Path, Path, torch.dtype | None], None]:
    def convert(source: Path, destination: Path, dtype: torch.dtype | None) -> None:
        del dtype
        if (source / HF_CONFIG).is_file():
            write_parameters(destination, _hf_parameters(moe=moe)(source))

    return convert


def _parameters_to_hf_config(*, moe: bool) -> Callable[[Path, Path, torch.dtype | None], None]:
    def convert(source: Path, destination: Path, dtype: torch.dtype | None) -> None:
        if not (source / PARAMETERS_FILE).is_file():
            return
        params = read_parameters(source)
        dtype = dtype or _stored_dtype(source)
        if moe != isinstance(params, Qwen3MoeParameters):
            raise MappingError(
                f"{source / PARAMETERS_FILE} describes a {model_kind(params)} model; use the "
                f"{'qwen3-moe-d9d-to-hf' if not moe else 'qwen3-d9d-to-hf'} mapping"
            )
        config = (
            hf_config_from_qwen3_moe(params, dtype=dtype)
            if isinstance(params, Qwen3MoeParameters)
            else hf_config_from_qwen3_dense(params, dtype=dtype)
        )
        write_durable(destination / HF_CONFIG, (json.dumps(config, indent=2) + "\n").encode("utf-8"))

    return convert


def _entries() -> list[NamedMapping]:
    per_expert, fused = Qwen3MoeExpertsFormat.PER_EXPERT, Qwen3MoeExpertsFormat.FUSED
    return [
        NamedMapping(
            name="qwen3-hf-to-d9d",
            description="Hugging Face Qwen3 (dense) -> d9d; tied embeddings are untied",
            factory=_from_hf("qwen3-hf-to-d9d", moe=False),
            convert_config=_hf_config_to_parameters(moe=False),
            source_parameters=_hf_parameters(moe=False),
        ),
        NamedMapping(
            name="qwen3-d9d-to-hf",
            description="d9d Qwen3 (dense) -> Hugging Face",
            factory=_to_hf("qwen3-d9d-to-hf", moe=False, experts_format=per_expert),
            convert_config=_parameters_to_hf_config(moe=False),
            source_parameters=_d9d_parameters,
        ),
        NamedMapping(
            name="qwen3-moe-hf-to-d9d",
            description="Hugging Face Qwen3-MoE (per-expert or fused experts) -> d9d stacked experts",
            factory=_from_hf("qwen3-moe-hf-to-d9d", moe=True),
            convert_config=_hf_config_to_parameters(moe=True),
            source_parameters=_hf_parameters(moe=True),
        ),
        NamedMapping(
            name="qwen3-moe-d9d-to-hf",
            description="d9d Qwen3-MoE -> Hugging Face, one module per expert (published checkpoints)",
            factory=_to_hf("qwen3-moe-d9d-to-hf", moe=True, experts_format=per_expert),
            convert_config=_parameters_to_hf_config(moe=True),
            source_parameters=_d9d_parameters,
        ),
        NamedMapping(
            name="qwen3-moe-d9d-to-hf-fused",
            description="d9d Qwen3-MoE -> Hugging Face with fused experts (transformers 5 in-memory layout)",
            factory=_to_hf("qwen3-moe-d9d-to-hf-fused", moe=True, experts_format=fused),
            convert_config=_parameters_to_hf_config(moe=True),
            source_parameters=_d9d_parameters,
        ),
    ]


NAMED_MAPPINGS: dict[str, NamedMapping] = {entry.name: entry for entry in _entries()}


def named_mapping(name: str) -> NamedMapping:
    """The mapping called `name`; `KeyError` listing the valid names otherwise."""
    try:
        return NAMED_MAPPINGS[name]
    except KeyError:
        raise KeyError(f"no mapping named {name!r}; valid: {', '.join(NAMED_MAPPINGS)}") from None


def describe_mappings() -> str:
    width = max(len(name) for name in NAMED_MAPPINGS)
    return "\n".join(f"  {entry.name:<{width}}  {entry.description}" for entry in NAMED_MAPPINGS.values())
