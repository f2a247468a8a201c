"""Streaming conversion on one process: bit-exact round trips through fuse-and-stack and back on random multi-file
checkpoints, HF-compatible sharded output, checks before any data is read, and memory bounded by the group."""

import json

import pytest
import torch
from safetensors.torch import load_file
from states_testing import fuse_model, moe_checkpoint_tensors, same_bits, unfuse_model, write_checkpoint

from d9d.states import (
    CheckpointError,
    CheckpointSource,
    MappingError,
    StateMismatchError,
    StateStream,
    convert_checkpoint,
    plan_conversion,
)
from d9d.states import mapper as m

SHAPES = {"layers": 3, "experts": 4, "hidden": 16, "inter": 8, "q": 16, "kv": 8, "vocab": 32}


def _checkpoint(tmp_path, seed, files):
    tensors = moe_checkpoint_tensors(**SHAPES, seed=seed)
    return write_checkpoint(tmp_path / f"hf-{seed}", tensors, files=files, seed=seed), tensors


def _load_all(path):
    source = CheckpointSource.open(path)
    with source.open_reader() as reader:
        return {name: reader.read(name) for name in source.locations}


@pytest.mark.parametrize(
    ("seed", "files", "shard_bytes", "in_kernel"),
    [(0, 1, 10**9, True), (1, 3, 20_000, True), (2, 5, 3_000, True), (3, 4, 5_000, False)],
)
def test_fuse_and_stack_then_its_inverse_round_trips_bit_exactly(tmp_path, seed, files, shard_bytes, in_kernel):
    source, tensors = _checkpoint(tmp_path, seed, files)
    layers, experts = SHAPES["layers"], SHAPES["experts"]
    fused = tmp_path / "fused"
    mapper = fuse_model(layers, experts)
    report = convert_checkpoint(source, fused, mapper, max_shard_bytes=shard_bytes, copy_in_kernel=in_kernel)
    ours = _load_all(fused)
    # The fused layout is what the mapping says it is, computed independently here.
    layer = "model.layers.1."
    gate = torch.stack([tensors[f"{layer}mlp.experts.{e}.gate_proj.weight"] for e in range(experts)])
    up = torch.stack([tensors[f"{layer}mlp.experts.{e}.up_proj.weight"] for e in range(experts)])
    assert same_bits(ours[f"{layer}moe.gate_up"], torch.cat([gate, up], dim=1))
    qkv = [tensors[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv"]
    assert same_bits(ours[f"{layer}attn.qkv"], torch.cat(qkv))
    assert same_bits(ours[f"{layer}attn.out"], tensors[f"{layer}self_attn.o_proj.weight"].t().contiguous())
    assert ours[f"{layer}attn_norm"].dtype == torch.float64
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())
    back = tmp_path / "back"
    convert_checkpoint(
        fused, back, unfuse_model(layers, experts, q=SHAPES["q"], kv=SHAPES["kv"], inter=SHAPES["inter"])
    )
    restored = _load_all(back)
    assert restored.keys() == tensors.keys()
    assert all(same_bits(restored[name], tensor) for name, tensor in tensors.items())


def test_output_is_a_hugging_face_sharded_checkpoint_within_the_shard_size(tmp_path):
    source, tensors = _checkpoint(tmp_path, 3, 2)
    report = convert_checkpoint(source, tmp_path / "out", m.Identity(list(tensors)), max_shard_bytes=4_000)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    count = len(report.files)
    assert count > 3
    assert sorted(set(index["weight_map"].values())) == [
        f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)
    ]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    for name in set(index["weight_map"].values()):
        loaded = load_file(out / name)  # the reference reader accepts every shard
        assert sum(t.numel() * t.element_size() for t in loaded.values()) <= max(4_000, largest)
        assert all(index["weight_map"][tensor] == name for tensor in loaded)
    assert {p.name for p in out.iterdir()} == {*index["weight_map"].values(), "model.safetensors.index.json"}


def test_a_small_output_is_one_file_without_an_index(tmp_path):
    source, tensors = _checkpoint(tmp_path, 4, 3)
    report = convert_checkpoint(source, tmp_path / "out", m.Identity(list(tensors)))
    assert report.files == ["model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def test_missing_and_unexpected_tensors_are_errors_before_anything_is_written(tmp_path):
    source, tensors = _checkpoint(tmp_path, 5, 2)
    names = list(tensors)
    with pytest.raises(
        StateMismatchError, match=r"missing tensors: .*'model.layers.0.mlp.experts.9.up_proj.weight'.*did you mean"
    ):
        convert_checkpoint(source, tmp_path / "a", m.Identity([*names, "model.layers.0.mlp.experts.9.up_proj.weight"]))
    with pytest.raises(StateMismatchError, match=r"unexpected tensors: .* has 'lm_head.weight'"):
        convert_checkpoint(source, tmp_path / "b", m.Identity(names[:-1]))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert [p.name for p in tmp_path.iterdir()] == [source.name]  # no staging directory left either
    convert_checkpoint(source, tmp_path / "c", m.Identity(names[:-1]), allow_unused=True)
    assert "lm_head.weight" not in load_file(tmp_path / "c" / "model.safetensors")


def test_shape_errors_name_the_tensors_and_their_files(tmp_path):
    source, _ = _checkpoint(tmp_path, 6, 2)
    bad = m.Stack(["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"], "x")
    with pytest.raises(
        MappingError, match=r"Stack into 'x': .* \(inputs: 'model.embed_tokens.weight' \[32, 16\] bfloat16 in .*model"
    ):
        plan_conversion(source, bad, allow_unused=True)


def test_an_existing_destination_is_kept_unless_overwriting_is_allowed(tmp_path):
    source, tensors = _checkpoint(tmp_path, 7, 1)
    out = tmp_path / "out"
    convert_checkpoint(source, out, m.Identity(list(tensors)))
    with pytest.raises(CheckpointError, match="already exists"):
        convert_checkpoint(source, out, m.Identity(list(tensors)))
    renamed = {name: name + ".v2" for name in tensors}
    convert_checkpoint(source, out, m.Rename(renamed), overwrite=True)
    assert set(load_file(out / "model.safetensors")) == set(renamed.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([source.name, "out"])


def test_a_mapping_factory_receives_the_source_metadata(tmp_path):
    source, tensors = _checkpoint(tmp_path, 8, 2)
    seen = {}

    def factory(metas):
        seen.update(metas)
        return m.Identity(list(metas))

    convert_checkpoint(source, tmp_path / "out", factory)
    assert seen.keys() == tensors.keys() and seen["lm_head.weight"].shape == (32, 16)


def test_each_group_is_read_right_before_it_runs(tmp_path):
    # Streaming: after the first output, only the first group's inputs have been read, not the checkpoint.
    source, tensors = _checkpoint(tmp_path, 9, 3)
    mapper = fuse_model(SHAPES["layers"], SHAPES["experts"])
    plan = plan_conversion(source, mapper)
    stream = StateStream(CheckpointSource.open(source), mapper, plan)
    produced = iter(stream)
    next(produced)
    first_inputs = sum(meta.nbytes for meta in plan.groups[0].inputs.values())
    assert stream.stats.bytes_read == first_inputs
    assert stream.stats.groups == 1
    rest = dict(produced)
    assert len(rest) + 1 == len(plan.outputs())
    assert stream.stats.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())
    assert plan.largest_group_bytes < stream.stats.bytes_read / 3


@pytest.mark.parametrize("in_kernel", [True, False])
def test_copies_into_strided_places_match_the_computed_result(tmp_path, in_kernel):
    # Concatenating along the last dimension interleaves the inputs row by row: many small runs on both sides.
    generator = torch.Generator().manual_seed(10)
    tensors = {name: torch.randn(5, 3, 4, generator=generator).to(torch.bfloat16) for name in "abc"}
    source = write_checkpoint(tmp_path / "src", tensors, files=2)
    mapper = m.Parallel([m.Concatenate(["a", "b"], "ab", dim=-1), m.Unstack("c", ["c0", "c1", "c2"], dim=1)])
    convert_checkpoint(source, tmp_path / "out", mapper, copy_in_kernel=in_kernel)
    written = load_file(tmp_path / "out" / "model.safetensors")
    expected = {**mapper.apply({"a": tensors["a"], "b": tensors["b"]}), **mapper.apply({"c": tensors["c"]})}
    assert written.keys() == expected.keys()
    assert all(same_bits(written[name], tensor.contiguous()) for name, tensor in expected.items())
