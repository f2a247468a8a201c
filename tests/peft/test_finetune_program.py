"""The must-show: LoRA fine-tuning of a tiny Qwen3 and Qwen3-MoE on 2 gloo ranks with FSDP, fixed seed, 50 steps,
from a pretrain-stage job checkpoint, on a shifted token distribution; adapter-only job checkpoints; the base
checkpoint plus the adapter checkpoint restores the fine-tuned model, which the merged export reproduces."""

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml

from d9d.core.checkpoint import latest_complete, load_model_weights
from d9d.core.data import TokenShardSetWriter
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.flows.jobs.finetune.program import main as finetune
from d9d.flows.jobs.pretrain.program import main as pretrain
from d9d.models.catalogue import Qwen3DenseModelConfig, Qwen3MoeModelConfig, build_model
from d9d.parallel import FsdpConfig
from d9d.peft import build_peft_method, inject_peft_and_freeze
from d9d.peft.config import LoRAConfig
from d9d.states import load_model_state

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

VOCAB = 64
TINY = {
    "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 64,
}  # fmt: skip
# Wide enough that tensor data, not DCP's per-tensor overhead, dominates the checkpoint sizes compared below.
MODELS = {
    "dense": {"kind": "qwen3_dense", "parameters": TINY},
    "moe": {
        "kind": "qwen3_moe",
        "parameters": {**TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    },
}
LORA = {
    "kind": "lora",
    "module_name_pattern": r".*\.self_attn\.(q|k|v|o)_proj|.*\.mlp\.(experts\.)?(gate|up|down)_proj",
    "params": {"r": 4, "alpha": 8},
}


def _markov_shards(path, *, seed: int, chain_seed: int, documents: int) -> None:
    """Documents from a noisy permutation chain: the next token is `perm[token]` 85% of the time, else uniform.
    Different `chain_seed`s give the two corpora (pretrain vs fine-tune): a distribution shift the base must unlearn.
    """
    perm = np.random.default_rng(chain_seed).permutation(VOCAB)
    rng = np.random.default_rng(seed)
    with TokenShardSetWriter(path, dtype="uint16", max_shard_tokens=4096) as writer:
        for _ in range(documents):
            tokens = [int(rng.integers(VOCAB))]
            for _ in range(int(rng.integers(24, 48))):
                tokens.append(int(perm[tokens[-1]]) if rng.random() < 0.85 else int(rng.integers(VOCAB)))
            writer.add_document(np.asarray(tokens), num_bytes=len(tokens))


def _write_yaml(path, content) -> None:
    if dist.get_rank() == 0:  # one writer: another rank must not read a half-written file
        path.write_text(yaml.safe_dump(content))
    dist.barrier()


def _bytes(path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_lora_finetune_lowers_validation_loss_with_adapter_only_checkpoints(tmp_path, kind):
    root = tmp_path
    if dist.get_rank() == 0:
        _markov_shards(root / "pretrain", seed=0, chain_seed=100, documents=120)
        _markov_shards(root / "finetune", seed=1, chain_seed=200, documents=120)
        _markov_shards(root / "finetune-val", seed=2, chain_seed=200, documents=24)
    dist.barrier()
    model = {**MODELS[kind], "decoder": {"attention": {"kind": "eager"}, "grouped_mm": {"kind": "eager"}}}
    loop = {"global_batch_rows": 8, "microbatch_rows": 4, "seed": 0, "device": "cpu"}
    _write_yaml(root / "pretrain.yaml", {
        "stage": {**loop, "model": model, "seq_len": 32, "steps": 30, "optimizer": {"kind": "adamw", "lr": 0.01}},
        "train_shards": str(root / "pretrain"), "checkpoints": str(root / "pretrain-ckpt"),
    })  # fmt: skip
    assert pretrain(["--config", str(root / "pretrain.yaml")]) == 0
    _write_yaml(root / "finetune.yaml", {
        "stage": {**loop, "peft": LORA, "steps": 50, "checkpoint_every": 25, "optimizer": {"kind": "adamw", "lr": 0.01},
                  "validation_rows_per_step": 8, "validation_steps": 4, "export_hf_peft": True},
        "model": model, "seq_len": 32, "base": str(root / "pretrain-ckpt"),
        "train_shards": str(root / "finetune"), "validation_shards": str(root / "finetune-val"),
        "checkpoints": str(root / "finetune-ckpt"), "output": str(root / "out"),
    })  # fmt: skip
    # 25 steps, then a second run resumes from the adapter-only checkpoint (base loaded first) and does 26..50.
    assert finetune(["--config", str(root / "finetune.yaml"), "--set", "stage.steps=25"]) == 0
    assert finetune(["--config", str(root / "finetune.yaml")]) == 0
    dist.barrier()

    report = json.loads((root / "out" / "finetune.json").read_text())
    drop = 1 - report["validation_loss_after"] / report["validation_loss_before"]
    base_ckpt, adapter_ckpt = latest_complete(root / "pretrain-ckpt"), latest_complete(root / "finetune-ckpt")
    full_bytes, adapter_bytes = _bytes(base_ckpt), _bytes(adapter_ckpt)
    if dist.get_rank() == 0:
        print(
            f"\n[{kind}] validation loss {report['validation_loss_before']:.4f} -> "
            f"{report['validation_loss_after']:.4f} ({drop:.1%} lower); trainable parameters "
            f"{report['trainable_parameters']:,} of {report['total_parameters']:,}; job checkpoint (model + "
            f"optimizer) full {full_bytes:,} bytes, adapter-only {adapter_bytes:,} bytes "
            f"({adapter_bytes / full_bytes:.1%})"
        )
    assert drop >= 0.10
    hf_config = json.loads((root / "out" / "hf_peft" / "adapter_config.json").read_text())
    assert "model.layers.0.self_attn.q_proj" in hf_config["target_modules"] and hf_config["r"] == 4
    assert json.loads((root / "out" / "peft.json").read_text())["kind"] == "lora"
    assert adapter_ckpt.name == "step-00000050"
    assert adapter_bytes < 0.5 * full_bytes

    # The base checkpoint plus the adapter checkpoint restores the fine-tuned model; the merged export equals it.
    model_config = (Qwen3DenseModelConfig if kind == "dense" else Qwen3MoeModelConfig).model_validate(model)
    method = build_peft_method(LoRAConfig.model_validate(LORA))
    injections = []  # what the provider's injection returned
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2), device="cpu")
    restored = build_model(
        model_config, ctx, FsdpConfig(), prepare=lambda m: injections.append(inject_peft_and_freeze(method, m))
    ).model
    (injection,) = injections
    base_names = [name for name in restored.state_dict() if name not in injection.adapter_names]
    load_model_weights(base_ckpt, restored, names=base_names)
    load_model_weights(adapter_ckpt, restored, names=sorted(injection.parameters_to_train))
    merged = build_model(model_config, ctx, FsdpConfig()).model
    load_model_state(root / "out" / "merged", merged)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(5))
    restored_losses, merged_losses = token_losses(restored, ids), token_losses(merged, ids)
    # Per-token losses (the LM head's FSDP forward), fp32: W + s*B*A rounded once against the two-path sum.
    torch.testing.assert_close(merged_losses, restored_losses, rtol=1e-4, atol=1e-4)
    base = build_model(model_config, ctx, FsdpConfig()).model
    load_model_weights(base_ckpt, base)
    assert not torch.allclose(token_losses(base, ids), restored_losses, atol=1e-2)  # the adapters were restored


def token_losses(model, ids):
    with torch.no_grad():
        return model.eval()(ids[:, :-1], labels=ids[:, 1:]).losses
