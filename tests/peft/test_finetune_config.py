"""The fine-tune rank program's configuration (the job's `finetune` section embedded unchanged): the PEFT union
inside it, the base's mapping, and where the base comes from."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from d9d.core.config import ConfigError, load_config
from d9d.flows.jobs.finetune.base import resolve_base
from d9d.flows.jobs.finetune.config import FinetuneRankConfig, FinetuneStageConfig
from d9d.peft import LoRAConfig

MINIMAL = {
    "stage": {
        "peft": {"kind": "lora", "module_name_pattern": r".*_proj", "params": {"r": 4}},
        "steps": 50, "global_batch_rows": 8, "microbatch_rows": 4,
    },
    "model": {"kind": "qwen3_dense", "parameters": {
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8}},
    "seq_len": 32,
    "base": "runs/pretrain/checkpoints",
    "train_shards": "runs/data/finetune",
    "checkpoints": "runs/finetune/checkpoints",
    "output": "runs/finetune",
}  # fmt: skip


def test_the_peft_section_is_a_discriminated_union_and_set_overrides_reach_it(tmp_path):
    path = tmp_path / "finetune.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    config = load_config(FinetuneRankConfig, path, ["stage.peft.params.alpha=32"])
    assert isinstance(config.stage.peft, LoRAConfig) and config.stage.peft.params.alpha == 32
    with pytest.raises(ConfigError, match=r"stage\.peft"):
        load_config(FinetuneRankConfig, path, ["stage.peft.kind=prefix"])


def test_a_base_mapping_must_read_into_the_d9d_layout_and_needs_a_base():
    with pytest.raises(ValidationError, match=r"base_mapping='qwen3-d9d-to-hf' must read into d9d's layout; valid: "):
        FinetuneStageConfig(base=Path("hf"), base_mapping="qwen3-d9d-to-hf")
    with pytest.raises(ValidationError, match=r"needs finetune\.base"):
        FinetuneStageConfig(base_mapping="qwen3-hf-to-d9d")
    assert FinetuneStageConfig(base=Path("hf"), base_mapping="qwen3-hf-to-d9d").base_mapping == "qwen3-hf-to-d9d"


def test_the_base_resolves_to_the_newest_complete_checkpoint_or_fails_naming_it(tmp_path):
    for step, complete in [(10, True), (20, True), (30, False)]:
        folder = tmp_path / "ckpt" / f"step-{step:08d}"
        folder.mkdir(parents=True)
        if complete:
            (folder / "COMPLETE").write_text(f"{step}\n")
    assert resolve_base(tmp_path / "ckpt").name == "step-00000020"
    assert resolve_base(tmp_path / "ckpt" / "step-00000010").name == "step-00000010"
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "model.safetensors").write_bytes(b"")
    assert resolve_base(tmp_path / "st") == tmp_path / "st"
    with pytest.raises(FileNotFoundError, match=r"base=.*empty: not a complete job checkpoint"):
        resolve_base(tmp_path / "empty")
