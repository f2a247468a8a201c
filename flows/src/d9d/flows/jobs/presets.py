"""Named starting points for a job configuration (`d9d run pipeline --preset NAME`)."""

from __future__ import annotations

import copy
from typing import Any


def _dense(*, vocab_size: int, hidden_size: int, layers: int) -> dict[str, Any]:
    """A tiny Qwen3 dense: 4 query heads over 2 key/value heads, an FFN twice the hidden size."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden_size // 4,
        "max_position_embeddings": 1024,
    }


_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": (
        (
            "the main job: 42 Shakespeare works (5 MB), a 4096-token BPE, a tiny Qwen3 on 2 CPU ranks, LoRA on 7 "
            "Milton works (1.4 MB); under 5 minutes"
        ),
        {
            "workdir": "runs/tiny",
            "data_prep": {
                "corpus": {"kind": "embedded", "name": "shakespeare"},
                "tokenizer": {"kind": "train_bpe", "vocab_size": 4096},
                "validation_fraction": 0.05,
                "workers": 2,
            },
            "pretrain": {
                "model": {"kind": "qwen3_dense", "parameters": _dense(vocab_size=4096, hidden_size=64, layers=2)},
                "seq_len": 128,
                "steps": 400,
                "global_batch_rows": 16,
                "microbatch_rows": 8,
                "checkpoint_every": 100,
                "optimizer": {"kind": "adamw", "lr": 0.006},
                # Warm up over 20 steps, then a cosine decay to a tenth: a better loss in the same minute.
                "lr_schedule": {
                    "kind": "piecewise",
                    "initial": 0.1,
                    "phases": [
                        {"mode": "steps", "steps": 20, "target": 1.0},
                        {"mode": "rest", "target": 0.1, "curve": {"type": "cosine"}},
                    ],
                },
                "nproc_per_node": 2,
                "device": "cpu",
            },
            "finetune_data": {"corpus": {"kind": "embedded", "name": "milton"}, "workers": 2},
            "finetune": {
                "steps": 100,
                "global_batch_rows": 16,
                "microbatch_rows": 8,
                "checkpoint_every": 50,
                # LoRA trains far fewer weights from a trained start: a higher rate than pretrain's is stable.
                "optimizer": {"kind": "adamw", "lr": 0.01},
                "validation_rows_per_step": 16,
                "validation_steps": 4,
                "nproc_per_node": 2,
                "device": "cpu",
            },
            "evaluate": {"rows_per_step": 16, "nproc_per_node": 2, "device": "cpu"},
        },
    ),
    "micro": (
        (
            "a smoke test: 4 works, a 512-token BPE, 8 steps of a tiny Qwen3 on 2 CPU ranks, 4 LoRA steps on 3 "
            "Milton works; under a minute"
        ),
        {
            "workdir": "runs/micro",
            "data_prep": {
                "corpus": {"kind": "embedded", "name": "shakespeare", "limit": 4},
                "tokenizer": {"kind": "train_bpe", "vocab_size": 512},
                "validation_fraction": 0.25,
                "chunk_bytes": 131072,
                "workers": 1,
                "retry_delay_seconds": 0.0,
            },
            "pretrain": {
                "model": {"kind": "qwen3_dense", "parameters": _dense(vocab_size=512, hidden_size=32, layers=2)},
                "seq_len": 64,
                "steps": 8,
                "global_batch_rows": 8,
                "microbatch_rows": 2,
                "checkpoint_every": 4,
                "optimizer": {"kind": "adamw", "lr": 0.003},
                "nproc_per_node": 2,
                "device": "cpu",
                "retry_delay_seconds": 0.0,
            },
            "finetune_data": {
                "corpus": {"kind": "embedded", "name": "milton", "limit": 3},
                "seed": 11,  # holds out Areopagitica (the other two share Comus)
                "chunk_bytes": 131072,
                "workers": 1,
                "retry_delay_seconds": 0.0,
            },
            "finetune": {
                "steps": 4,
                "global_batch_rows": 8,
                "microbatch_rows": 2,
                "checkpoint_every": 2,
                "optimizer": {"kind": "adamw", "lr": 0.01},
                "validation_rows_per_step": 8,
                "validation_steps": 2,
                "nproc_per_node": 2,
                "device": "cpu",
                "retry_delay_seconds": 0.0,
            },
            "evaluate": {"rows_per_step": 8, "steps": 4, "nproc_per_node": 2, "device": "cpu"},
        },
    ),
}


def _micro_moe() -> tuple[str, dict[str, Any]]:
    """`micro` with a tiny Qwen3-MoE (4 experts, top-2): the smoke test of expert parallelism (`degrees.ep`)."""
    job = copy.deepcopy(_PRESETS["micro"][1])
    job["workdir"] = "runs/micro-moe"
    dense = job["pretrain"]["model"]["parameters"]
    moe = {**dense, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": dense["hidden_size"]}
    job["pretrain"]["model"] = {"kind": "qwen3_moe", "parameters": moe}
    return ("`micro` with a tiny Qwen3-MoE (4 experts, top-2), e.g. for --set pretrain.degrees.ep=2", job)


_PRESETS["micro-moe"] = _micro_moe()


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def describe_presets() -> str:
    return "\n".join(f"  {name:8} {_PRESETS[name][0]}" for name in preset_names())


def preset(name: str) -> dict[str, Any]:
    """A copy of preset `name` as plain data (the caller may change it)."""
    if name not in _PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets are: {', '.join(preset_names())}")
    return copy.deepcopy(_PRESETS[name][1])
