"""The fine-tune program's configuration: the PEFT union inside it, and where the base comes from."""

import pytest
import yaml
from pydantic import ValidationError

from d9d.core.config import load_config
from d9d.flows.jobs.finetune.base import resolve_base
from d9d.flows.jobs.finetune.config import FinetuneConfig
from d9d.peft import LoRAConfig

MINIMAL = {
    "model": {"kind": "qwen3_dense", "parameters": {
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8}},
    "base": "runs/pretrain/checkpoints",
    "peft": {"kind": "lora", "module_name_pattern": r".*_proj", "params": {"r": 4}},
    "data": {"shards": "runs/data/finetune", "seq_len": 32},
    "trainer": {"total_steps": 50, "global_batch_rows": 8, "microbatch_rows": 4},
    "output": "runs/finetune",
}  # fmt: skip


def test_the_peft_section_is_a_discriminated_union_and_set_overrides_reach_it(tmp_path):
    path = tmp_path / "finetune.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    config = load_config(FinetuneConfig, path, ["peft.params.alpha=32"])
    assert isinstance(config.peft, LoRAConfig) and config.peft.params.alpha == 32
    with pytest.raises(ValidationError, match="peft"):
        load_config(FinetuneConfig, path, ["peft.kind=prefix"])


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
