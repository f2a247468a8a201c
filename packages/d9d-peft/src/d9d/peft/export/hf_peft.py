"""LoRA adapters as `adapter_model.safetensors` + `adapter_config.json`, loadable by `PeftModel.from_pretrained`.

Module names come from the model's own to-HF state mapper: the group that moves `<m>.weight` alone to one HF
tensor `<hf>.weight` names the HF module `<hf>`. Grouped experts `(E, ...)` map to E per-expert tensors
(`...experts.<e>.gate_proj.weight`, the layout of HF Qwen3-MoE checkpoints), and their stacked adapters are split
the same way: expert `e` gets `A[e]`, `B[e]` under `...experts.<e>.gate_proj.lora_A/B.weight`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from d9d.peft.config import LoRAParameters
from d9d.peft.lora import LoRAGroupedLinear, LoRALinear
from d9d.peft.lora.merge import full
from d9d.states.mapper import ModelStateMapper

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PREFIX = "base_model.model."


def _hf_targets(to_hf: ModelStateMapper) -> dict[str, list[str]]:
    """d9d weight name -> the HF weight names it becomes (one, or one per expert in expert order)."""
    targets: dict[str, list[str]] = {}
    for group in to_hf.state_dependency_groups():
        if len(group.inputs) == 1:
            (name,) = group.inputs
            targets[name] = sorted(group.outputs, key=_natural_key)
    return targets


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def hf_peft_adapter_state(model: nn.Module, to_hf: ModelStateMapper) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The adapter tensors under peft's names, and the HF module names they target (every rank must call it:
    sharded adapters are gathered)."""
    tensors, modules = _adapter_state(model, to_hf)
    if not modules:
        raise ValueError("the model has no LoRA adapter to export")
    return tensors, modules


def _adapter_state(model: nn.Module, to_hf: ModelStateMapper) -> tuple[dict[str, torch.Tensor], list[str]]:
    targets = _hf_targets(to_hf)
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    for name, sub in model.named_modules():
        if not isinstance(sub, LoRALinear | LoRAGroupedLinear):
            continue
        if sub.merged:
            raise ValueError(f"{name}: the adapter is merged into the base weight; export adapters before merging")
        hf_weights = targets.get(f"{name}.weight")
        if not hf_weights or not all(weight.endswith(".weight") for weight in hf_weights):
            raise ValueError(f"{name}.weight: the to-HF mapper does not move it alone into HF weight(s)")
        lora_a, lora_b = full(sub.lora_A).detach().cpu(), full(sub.lora_B).detach().cpu()
        if isinstance(sub, LoRALinear):
            if len(hf_weights) != 1:
                raise ValueError(
                    f"{name}.weight: the to-HF mapper splits it into {len(hf_weights)} HF weights "
                    f"({', '.join(hf_weights[:3])}); a LoRA adapter on a linear layer exports to exactly one"
                )
            pieces = [(hf_weights[0], lora_a, lora_b)]
        else:
            if len(hf_weights) != lora_a.shape[0]:
                raise ValueError(f"{name}: {lora_a.shape[0]} experts but the to-HF mapper makes {len(hf_weights)}")
            pieces = list(zip(hf_weights, lora_a, lora_b, strict=True))
        for hf_weight, piece_a, piece_b in pieces:
            module = hf_weight.removesuffix(".weight")
            modules.append(module)
            tensors[f"{_PREFIX}{module}.lora_A.weight"] = piece_a.contiguous()
            tensors[f"{_PREFIX}{module}.lora_B.weight"] = piece_b.contiguous()
    return tensors, modules


def _parameters_of(model: nn.Module) -> set[LoRAParameters]:
    return {sub.params for sub in model.modules() if isinstance(sub, LoRALinear | LoRAGroupedLinear)}


def _one_set(found: set[LoRAParameters]) -> LoRAParameters:
    if len(found) != 1:
        raise ValueError(f"export needs one set of LoRA parameters for every adapter, the model has {len(found)}")
    return found.pop()


def export_hf_peft_adapter(
    model: nn.Module,
    to_hf: ModelStateMapper,
    directory: Path,
    *,
    base_model_name_or_path: str | None = None,
    write: bool = True,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Write `directory/adapter_model.safetensors` and `adapter_config.json` for `peft`.

    Every rank calls it; only those with `write` (e.g. rank 0) write the files. `group`: the pipeline ranks whose
    stages together make the model (`model` is this rank's stages, under the whole model's names): each rank's
    adapters are exchanged with `all_gather_object` (every rank of the group then holds all of them: r x (in + out)
    values per adapted module, small next to the model) and the files hold the whole model's adapters."""
    found = _parameters_of(model)
    tensors, modules = _adapter_state(model, to_hf)
    if group is not None:
        parts: list[tuple[set[LoRAParameters], dict[str, torch.Tensor], list[str]] | None]
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, (found, tensors, modules), group=group)
        found, tensors, modules = set(), {}, []
        for part in parts:
            assert part is not None
            found |= part[0]
            tensors |= part[1]
            modules += part[2]
    if not modules:
        raise ValueError("the model has no LoRA adapter to export")
    params = _one_set(found)
    if not write:
        return
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": params.r,
        "lora_alpha": params.alpha,
        "lora_dropout": params.dropout,
        "use_rslora": params.rslora,
        "target_modules": sorted(modules, key=_natural_key),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
