"""Shared helpers of the d9d.states tests: random checkpoints written by the reference safetensors writer, and the
synthetic fuse-and-stack mapping (q/k/v fused, per-expert weights stacked) with its inverse."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

from d9d.states import mapper as m


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(-100, 100, shape, generator=generator).to(dtype)


def write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], *, files: int, seed: int = 0) -> Path:
    """Spread `tensors` over `files` safetensors files at random, with a Hugging Face index when files > 1."""
    directory.mkdir(parents=True, exist_ok=True)
    chooser = random.Random(seed)
    names = (
        [f"model-{n + 1:05d}-of-{files:05d}.safetensors" for n in range(files)] if files > 1 else ["model.safetensors"]
    )
    order = list(tensors)
    chooser.shuffle(order)
    # The first `files` tensors go one to each file, so that no file is empty; the rest land anywhere.
    placement = {name: names[n] if n < files else names[chooser.randrange(files)] for n, name in enumerate(order)}
    for file_name in names:
        part = {name: tensor.contiguous() for name, tensor in tensors.items() if placement[name] == file_name}
        save_file(part, str(directory / file_name), metadata={"format": "pt"})
    if files > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": placement}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory


def moe_layer_names(experts: int) -> list[str]:
    names = ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
    names += ["self_attn.o_proj.weight"]
    for kind in ("gate_proj", "up_proj", "down_proj"):
        names += [f"mlp.experts.{e}.{kind}.weight" for e in range(experts)]
    return names


def moe_checkpoint_tensors(
    *,
    layers: int,
    experts: int,
    hidden: int,
    inter: int,
    q: int,
    kv: int,
    vocab: int,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """Hugging Face Qwen3-MoE-style tensors (per-expert weights, separate q/k/v), random."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {"model.embed_tokens.weight": random_tensor((vocab, hidden), dtype, generator)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        shapes = {
            "input_layernorm.weight": ((hidden,), torch.float32),
            "self_attn.q_proj.weight": ((q, hidden), dtype),
            "self_attn.k_proj.weight": ((kv, hidden), dtype),
            "self_attn.v_proj.weight": ((kv, hidden), dtype),
            "self_attn.o_proj.weight": ((hidden, q), dtype),
        }
        for e in range(experts):
            shapes[f"mlp.experts.{e}.gate_proj.weight"] = ((inter, hidden), dtype)
            shapes[f"mlp.experts.{e}.up_proj.weight"] = ((inter, hidden), dtype)
            shapes[f"mlp.experts.{e}.down_proj.weight"] = ((hidden, inter), dtype)
        for name, (shape, kind) in shapes.items():
            tensors[prefix + name] = random_tensor(shape, kind, generator)
    tensors["lm_head.weight"] = random_tensor((vocab, hidden), dtype, generator)
    return tensors


def fuse_layer(experts: int) -> m.ModelStateMapper:
    """One layer, HF -> ours: fuse q/k/v, stack experts (gate and up side by side), transpose o, cast the norm."""
    gate = [f"mlp.experts.{e}.gate_proj.weight" for e in range(experts)]
    up = [f"mlp.experts.{e}.up_proj.weight" for e in range(experts)]
    down = [f"mlp.experts.{e}.down_proj.weight" for e in range(experts)]
    return m.Parallel(
        [
            m.Concatenate(
                ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"], "attn.qkv"
            ),
            m.Sequential([m.Rename({"self_attn.o_proj.weight": "attn.out"}), m.Transpose("attn.out", 0, 1)]),
            m.Sequential(
                [
                    m.Parallel([m.Stack(gate, "gate"), m.Stack(up, "up")]),
                    m.Concatenate(["gate", "up"], "moe.gate_up", dim=1),
                ]
            ),
            m.Stack(down, "moe.down"),
            m.Sequential([m.Rename({"input_layernorm.weight": "attn_norm"}), m.CastDtype("attn_norm", torch.float64)]),
        ]
    )


def unfuse_layer(experts: int, *, q: int, kv: int, inter: int) -> m.ModelStateMapper:
    """The inverse of `fuse_layer`."""
    gate = [f"mlp.experts.{e}.gate_proj.weight" for e in range(experts)]
    up = [f"mlp.experts.{e}.up_proj.weight" for e in range(experts)]
    down = [f"mlp.experts.{e}.down_proj.weight" for e in range(experts)]
    return m.Parallel(
        [
            m.Chunk(
                "attn.qkv",
                ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                sizes=[q, kv, kv],
            ),
            m.Sequential([m.Transpose("attn.out", 0, 1), m.Rename({"attn.out": "self_attn.o_proj.weight"})]),
            m.Sequential(
                [
                    m.Chunk("moe.gate_up", ["gate", "up"], dim=1, sizes=[inter, inter]),
                    m.Parallel([m.Unstack("gate", gate), m.Unstack("up", up)]),
                ]
            ),
            m.Unstack("moe.down", down),
            m.Sequential([m.CastDtype("attn_norm", torch.float32), m.Rename({"attn_norm": "input_layernorm.weight"})]),
        ]
    )


def fuse_model(layers: int, experts: int) -> m.ModelStateMapper:
    return m.Parallel(
        [
            m.PrefixScope(fuse_layer(experts), [f"model.layers.{i}." for i in range(layers)]),
            m.Rename({"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight"}),
        ]
    )


def unfuse_model(layers: int, experts: int, *, q: int, kv: int, inter: int) -> m.ModelStateMapper:
    return m.Parallel(
        [
            m.PrefixScope(
                unfuse_layer(experts, q=q, kv=kv, inter=inter), [f"model.layers.{i}." for i in range(layers)]
            ),
            m.Rename({"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight"}),
        ]
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN-safe, unlike torch.equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def module_with(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose state_dict() is `state` (nested sub-modules follow the dotted names)."""
    root = torch.nn.Module()
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root
