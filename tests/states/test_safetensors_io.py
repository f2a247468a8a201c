"""Our safetensors reader and writer against the reference implementation, and the checks on broken checkpoints:
each error names the file and, where there is one, the tensor."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from states_testing import random_tensor, same_bits, write_checkpoint

from d9d.states import CheckpointError, CheckpointSource, TensorMeta
from d9d.states.io.safetensors.copy import ByteCopier, paired_runs
from d9d.states.io.safetensors.header import read_header
from d9d.states.io.safetensors.read import FileReader
from d9d.states.io.safetensors.write import FileWriter
from d9d.states.meta import crop

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
]


def _tensors(seed=0):
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"t{i}.{str(d).removeprefix('torch.')}": random_tensor((3, 5, 2), d, generator) for i, d in enumerate(DTYPES)
    }
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.zeros(0, 4)
    return tensors


def test_files_we_write_are_read_by_safetensors_bit_exactly(tmp_path):
    tensors = _tensors()
    entries = [(name, TensorMeta.of(t)) for name, t in tensors.items()]
    writer = FileWriter(tmp_path / "ours.safetensors", entries, {"format": "pt"})
    for name in reversed(list(tensors)):  # any order: each tensor lands at its planned offset
        writer.write(name, tensors[name])
    writer.close()
    loaded = load_file(tmp_path / "ours.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert same_bits(loaded[name], tensor), name


def test_we_read_safetensors_files_and_boxes_of_their_tensors(tmp_path):
    tensors = _tensors(1)
    save_file(tensors, tmp_path / "ref.safetensors")
    header = read_header(tmp_path / "ref.safetensors")
    reader = FileReader(tmp_path / "ref.safetensors")
    for name, tensor in tensors.items():
        got = reader.read(name, header.tensors[name])
        assert same_bits(got, tensor), name
    box = ((1, 3), (2, 4), (0, 1))
    expected_bytes = reader.bytes_read + 2 * 2 * 1 * 2  # bf16: only the box's 4 elements are read
    got = reader.read("t0.bfloat16", header.tensors["t0.bfloat16"], box)
    assert torch.equal(got, crop(tensors["t0.bfloat16"], box))
    assert reader.bytes_read == expected_bytes
    reader.close()


def test_a_transposed_view_is_written_in_row_major_order(tmp_path):
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    writer = FileWriter(tmp_path / "t.safetensors", [("t", TensorMeta.of(tensor))], {})
    writer.write("t", tensor)
    writer.close()
    assert torch.equal(load_file(tmp_path / "t.safetensors")["t"], tensor.contiguous())


def test_a_tensor_other_than_planned_is_refused(tmp_path):
    writer = FileWriter(tmp_path / "t.safetensors", [("t", TensorMeta((2,), torch.float32))], {})
    with pytest.raises(ValueError, match=r"'t' was planned as \[2\] float32 but is \[3\] float32"):
        writer.write("t", torch.zeros(3))
    writer.close(sync=False)


@pytest.fixture
def sharded(tmp_path):
    tensors = _tensors(2)
    return write_checkpoint(tmp_path / "ckpt", tensors, files=3), tensors


def test_a_sharded_checkpoint_opens_with_every_tensor_located(sharded):
    root, tensors = sharded
    source = CheckpointSource.open(root)
    assert source.metas() == {name: TensorMeta.of(t) for name, t in tensors.items()}
    with source.open_reader() as reader:
        assert torch.equal(reader.read("t2.float32"), tensors["t2.float32"])


def test_truncated_file_is_named_with_its_tensor(sharded):
    root, _ = sharded
    victim = max(root.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = victim.read_bytes()
    victim.write_bytes(data[:-7])
    with pytest.raises(CheckpointError, match=rf"{victim.name}: truncated, tensor '.*' ends at byte"):
        CheckpointSource.open(root)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: data[:4], "truncated, 4 bytes is shorter than the 8-byte header length"),
        (lambda data: (10**12).to_bytes(8, "little") + data[8:], "header length 1000000000000 is implausible"),
        (lambda data: data[:8] + b"#" + data[9:], "the header is not valid JSON"),
        (lambda data: data + b"junk", "4 bytes follow the last tensor"),
    ],
    ids=["tiny", "huge-header", "bad-json", "trailing"],
)
def test_corrupt_files_are_named(tmp_path, damage, message):
    save_file({"w": torch.ones(4)}, tmp_path / "model.safetensors")
    path = tmp_path / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match=message) as error:
        CheckpointSource.open(tmp_path)
    assert "model.safetensors" in str(error.value)


def _rewrite_header(path, edit):
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (length - len(raw))
    assert len(raw) == length
    path.write_bytes(data[:8] + raw + data[8 + length :])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda h: h["w"].update(dtype="F7"), "tensor 'w': unsupported dtype 'F7'"),
        (lambda h: h["w"].update(shape=[5]), r"tensor 'w': corrupt, \[5\] float32 needs 20 bytes"),
        (lambda h: h["w"].update(data_offsets=[4, 0]), "tensor 'w': corrupt data_offsets"),
        (lambda h: h["v"].update(data_offsets=[8, 24]), "tensors 'w' and 'v' overlap|tensors 'v' and 'w' overlap"),
    ],
    ids=["dtype", "shape", "offsets", "overlap"],
)
def test_corrupt_entries_name_the_tensor(tmp_path, edit, message):
    save_file({"w": torch.ones(4), "v": torch.zeros(4)}, tmp_path / "model.safetensors")
    _rewrite_header(tmp_path / "model.safetensors", edit)
    with pytest.raises(CheckpointError, match=message):
        CheckpointSource.open(tmp_path / "model.safetensors")


def test_an_index_naming_a_missing_file_is_an_error_naming_both(sharded):
    root, _ = sharded
    index = json.loads((root / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (root / victim).unlink()
    with pytest.raises(
        CheckpointError, match=rf"model.safetensors.index.json: names 1 missing file\(s\), e.g. '{victim}'"
    ):
        CheckpointSource.open(root)


def test_an_index_placing_a_tensor_in_the_wrong_file_is_an_error(sharded):
    root, _ = sharded
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"places '{name}' in '{files[1]}'.*has no such tensor"):
        CheckpointSource.open(root)


def test_pickle_checkpoints_are_refused_without_being_loaded(tmp_path, monkeypatch):
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", forbidden)
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*pickles, which d9d\.states never loads"):
        CheckpointSource.open(tmp_path)
    with pytest.raises(CheckpointError, match=r"not a \.safetensors file"):
        CheckpointSource.open(tmp_path / "pytorch_model.bin")


def test_the_same_tensor_in_two_files_without_an_index_is_ambiguous(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"w": torch.zeros(2)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match=r"'w' is stored in both 'a\.safetensors' and 'b\.safetensors'"):
        CheckpointSource.open(tmp_path)


def test_a_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        CheckpointSource.open(tmp_path / "nope")


def test_byte_copies_pair_differently_cut_runs_and_fall_back_to_user_space(tmp_path):
    assert list(paired_runs([(0, 5), (10, 3)], [(100, 2), (200, 6)])) == [(0, 100, 2), (2, 200, 3), (10, 203, 3)]
    source, target = tmp_path / "s", tmp_path / "t"
    source.write_bytes(bytes(range(256)) * 4)
    target.write_bytes(b"\0" * 64)
    for in_kernel in (True, False):
        copier = ByteCopier()
        copier.in_kernel = copier.in_kernel and in_kernel
        with source.open("rb") as s, target.open("r+b") as t:
            copier.copy(s.fileno(), 300, t.fileno(), 8, 40)
        assert target.read_bytes()[8:48] == (bytes(range(256)) * 4)[300:340]
