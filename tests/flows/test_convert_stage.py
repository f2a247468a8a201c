"""The convert stage (no Prefect): named mappings from `d9d.models.conversions`, the random embedded source, the
stage contract (skip when the manifest matches, rerun when the mapping or the source changes), `d9d convert`."""

import json

import pytest
import torch

from d9d.flows.cli import main
from d9d.flows.jobs.contract import StageManifest, StageOutputConflict
from d9d.flows.jobs.convert import ConvertConfig, convert_model
from d9d.models import materialize_
from d9d.models.catalogue import read_parameters
from d9d.models.qwen3 import Qwen3MoeForCausalLM
from d9d.states import load_model_state
from d9d.states.io.source import CheckpointSource


def test_embedded_default_converts_a_random_hf_checkpoint_and_then_skips(tmp_path):
    output = tmp_path / "model"
    first = convert_model(ConvertConfig(), output)
    assert first.status == "ran"
    checkpoint = output / "checkpoint"
    params = read_parameters(checkpoint)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(params)
    materialize_(model, "cpu").to(torch.bfloat16)  # the embedded source is stored in bf16
    load_model_state(checkpoint, model)  # d9d layout: every tensor of the model, nothing else
    manifest = StageManifest.read(output)
    assert manifest.statistics["mapping"] == "qwen3-moe-hf-to-d9d"
    assert {entry.name for entry in manifest.inputs} >= {"config.json", "model.safetensors"}
    again = convert_model(ConvertConfig(), output)
    assert again.status == "skipped"


def test_a_different_mapping_makes_the_output_stale_and_replacing_it_takes_the_explicit_option(tmp_path):
    output = tmp_path / "model"
    convert_model(ConvertConfig(), output)
    created = StageManifest.read(output).created_at
    other = ConvertConfig(mapping="qwen3-moe-hf-to-d9d", max_shard_bytes=2**20)
    with pytest.raises(StageOutputConflict, match=r"complete convert output .* \(config changed \(max_shard_bytes\)\)"):
        convert_model(other, output)
    assert StageManifest.read(output).created_at == created
    fused = convert_model(other, output, replace=True)
    assert fused.status == "ran"
    assert "config changed (max_shard_bytes)" in fused.reason


def test_cli_lists_and_runs_named_mappings(tmp_path, capsys):
    assert main(["convert", "--list"]) == 0
    listing = capsys.readouterr().out
    assert "qwen3-hf-to-d9d" in listing and "qwen3-moe-d9d-to-hf" in listing
    convert_model(ConvertConfig(), tmp_path / "model")
    source = tmp_path / "model" / "checkpoint"
    assert main(["convert", "--mapping", "qwen3-moe-d9d-to-hf", str(source), str(tmp_path / "hf")]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    original = CheckpointSource.open(tmp_path / "model-random-hf-source").metas()
    assert CheckpointSource.open(tmp_path / "hf").metas() == original


def test_cli_reports_bad_mappings_and_missing_arguments(tmp_path, capsys):
    assert main(["convert", "--mapping", "llama", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "no mapping named 'llama'" in capsys.readouterr().err
    assert main(["convert", "--mapping", "qwen3-hf-to-d9d"]) == 2
    assert "convert needs --mapping NAME SRC DST" in capsys.readouterr().err


def test_converting_a_model_directory_without_parameters_json_says_what_to_do(tmp_path, capsys):
    output = tmp_path / "model"
    convert_model(ConvertConfig(), output)
    older = tmp_path / "older-merged"  # a d9d directory as d9d wrote them before they recorded their parameters
    older.mkdir()
    for file in (output / "checkpoint").iterdir():
        if file.name != "parameters.json":
            (older / file.name).write_bytes(file.read_bytes())
    assert main(["convert", "--mapping", "qwen3-moe-d9d-to-hf", str(older), str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert f"{older} has no parameters.json, so {tmp_path / 'hf'} has no config.json" in err
    assert main(["convert", "--mapping", "qwen3-moe-d9d-to-hf", str(output / "checkpoint"), str(tmp_path / "hf2")]) == 0
    assert "no parameters.json" not in capsys.readouterr().err
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["model_type"] == "qwen3_moe"


def _tree(root):
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_cli_overwrite_replaces_only_an_earlier_conversions_output(tmp_path, capsys):
    convert_model(ConvertConfig(), tmp_path / "model")
    source = tmp_path / "model" / "checkpoint"
    hf = tmp_path / "hf"
    convert = ["convert", "--mapping", "qwen3-moe-d9d-to-hf"]
    assert main([*convert, str(source), str(hf)]) == 0
    assert main([*convert, "--overwrite", str(source), str(hf)]) == 0  # an earlier conversion: replaced
    capsys.readouterr()
    converted = _tree(hf)
    assert ".d9d-convert.json" in converted and "config.json" in converted

    (hf / "tokenizer.json").write_text("{}", encoding="utf-8")  # the user's file next to the converted weights
    (hf / "notes").mkdir()
    assert main([*convert, "--overwrite", str(source), str(hf)]) == 2
    err = capsys.readouterr().err
    assert f"{hf} holds notes, tokenizer.json, which no earlier `d9d convert` wrote" in err
    assert _tree(hf) == {**converted, "tokenizer.json": b"{}"}

    folder = tmp_path / "downloads"  # never a conversion's output
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"someone's weights")
    assert main([*convert, "--overwrite", str(source), str(folder)]) == 2
    assert "model.safetensors, which no earlier `d9d convert` wrote" in capsys.readouterr().err
    assert (folder / "model.safetensors").read_bytes() == b"someone's weights"


def test_cli_refuses_a_destination_that_is_the_source_or_inside_it(tmp_path, capsys):
    convert_model(ConvertConfig(), tmp_path / "model")
    source = tmp_path / "model" / "checkpoint"
    before = _tree(source)
    convert = ["convert", "--mapping", "qwen3-moe-d9d-to-hf", "--overwrite"]
    assert main([*convert, str(source), str(source)]) == 2
    assert "the destination is the source" in capsys.readouterr().err
    assert main([*convert, str(source), str(source / "hf")]) == 2
    assert "the destination is inside the source" in capsys.readouterr().err
    assert main([*convert, str(source), str(source.parent)]) == 2
    assert "the destination holds the source" in capsys.readouterr().err
    assert _tree(source) == before
