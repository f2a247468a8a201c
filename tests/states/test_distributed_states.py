"""On 4 gloo ranks: loading into DTensors reads only each rank's shards and equals a full load followed by slicing;
a distributed save (each rank writes its share, one publishes the index) loads back; a distributed conversion equals
a single-process one."""

import pytest
import torch
import torch.distributed as dist
from states_testing import fuse_model, module_with, moe_checkpoint_tensors, same_bits, unfuse_model, write_checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from d9d.states import convert_checkpoint, load_model_state, read_model_state, save_model_state
from d9d.states import mapper as m

SHAPES = {"layers": 2, "experts": 4, "hidden": 16, "inter": 8, "q": 16, "kv": 8, "vocab": 31}
LAYERS, EXPERTS = SHAPES["layers"], SHAPES["experts"]


def _inverse():
    return unfuse_model(LAYERS, EXPERTS, q=SHAPES["q"], kv=SHAPES["kv"], inter=SHAPES["inter"])


@pytest.fixture
def checkpoint(tmp_path):
    tensors = moe_checkpoint_tensors(**SHAPES, seed=11)
    return write_checkpoint(tmp_path / "hf", tensors, files=3, seed=11), tensors


def _placements_2d(name):
    """Mixed Shard/Replicate placements on a (dp=2, tp=2) mesh, by fused tensor name (uneven splits included)."""
    table = {
        "attn.qkv": [Shard(0), Replicate()],
        "attn.out": [Replicate(), Shard(1)],
        "moe.gate_up": [Shard(0), Shard(1)],
        "moe.down": [Shard(0), Replicate()],
        "attn_norm": [Replicate(), Replicate()],
        "embed.weight": [Shard(1), Shard(0)],  # vocab 31 over tp=2: 16 + 15 rows
        "head.weight": [Shard(0), Replicate()],
    }
    return next(value for key, value in table.items() if name.endswith(key))


@pytest.mark.distributed(world_size=4)
def test_dtensor_load_with_mixed_placements_equals_full_load_then_slicing(checkpoint):
    source, _ = checkpoint
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    fuse = fuse_model(LAYERS, EXPERTS)
    full = dict(read_model_state(source, fuse))
    distribute = m.Parallel([m.Distribute(name, mesh, _placements_2d(name)) for name in full])
    loaded = dict(read_model_state(source, m.Sequential([fuse, distribute])))
    assert loaded.keys() == full.keys()
    for name, tensor in full.items():
        got = loaded[name]
        assert isinstance(got, DTensor) and tuple(got.placements) == tuple(_placements_2d(name))
        expected = distribute_tensor(tensor, mesh, _placements_2d(name), src_data_rank=None)
        assert same_bits(got.to_local(), expected.to_local()), name
        assert same_bits(got.full_tensor(), tensor), name


@pytest.mark.distributed(world_size=4)
def test_each_of_four_expert_parallel_ranks_reads_about_a_quarter_of_the_bytes(checkpoint):
    source, tensors = checkpoint
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    fuse = fuse_model(LAYERS, EXPERTS)
    full = dict(read_model_state(source, fuse))
    # Experts, fused q/k/v and the transposed output projection split along dimension 0: each rank reads its experts,
    # its rows of q/k/v and its columns of o_proj. Only the small norms are replicated (read by every rank).
    placements = {name: [Replicate()] if name.endswith("attn_norm") else [Shard(0)] for name in full}
    module = module_with(
        {name: distribute_tensor(torch.zeros_like(t), mesh, placements[name]) for name, t in full.items()}
    )
    report = load_model_state(source, module, fuse)
    for name, tensor in full.items():
        assert same_bits(
            module.get_parameter(name).to_local(), distribute_tensor(tensor, mesh, placements[name]).to_local()
        )
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    replicated = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.endswith("input_layernorm.weight"))
    counts = [None] * 4
    dist.all_gather_object(counts, report.bytes_read)
    assert sum(counts) == total + 3 * replicated  # every sharded byte read by exactly one rank
    for count in counts:
        assert 0.24 * total < count < 0.27 * total, (counts, total)


@pytest.mark.distributed(world_size=4)
def test_distributed_save_then_load_round_trips(checkpoint, tmp_path):
    source, tensors = checkpoint
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    fuse = fuse_model(LAYERS, EXPERTS)
    full = dict(read_model_state(source, fuse))
    module = module_with(
        {n: distribute_tensor(t, mesh, _placements_2d(n), src_data_rank=None) for n, t in full.items()}
    )
    target = tmp_path / "saved-hf"
    report = save_model_state(target, module, _inverse(), max_shard_bytes=2_000)
    groups = [None] * 4
    dist.all_gather_object(groups, report.groups)
    assert all(count > 0 for count in groups)  # every rank wrote a share
    assert sum(groups) == len(_inverse().state_dependency_groups())
    # The HF layout on disk is the original checkpoint, bit for bit.
    on_disk = dict(read_model_state(target, m.Identity(list(tensors))))
    assert all(same_bits(on_disk[name], tensor) for name, tensor in tensors.items())
    # And it loads back into a sharded module of the same layout.
    fresh = module_with({n: distribute_tensor(torch.zeros_like(t), mesh, _placements_2d(n)) for n, t in full.items()})
    load_model_state(target, fresh, fuse)
    for name in full:
        assert same_bits(fresh.get_parameter(name).to_local(), module.get_parameter(name).to_local()), name


@pytest.mark.distributed(world_size=4)
def test_distributed_conversion_equals_a_single_process_one(checkpoint, tmp_path):
    source, _ = checkpoint
    fuse = fuse_model(LAYERS, EXPERTS)
    report = convert_checkpoint(source, tmp_path / "fused", fuse, max_shard_bytes=3_000)
    groups = [None] * 4
    dist.all_gather_object(groups, report.groups)
    assert all(count > 0 for count in groups) and sum(groups) == len(fuse.state_dependency_groups())
    assert len(report.files) >= 4
    expected = dict(read_model_state(source, fuse))
    written = dict(read_model_state(tmp_path / "fused", m.Identity(list(expected))))
    assert all(same_bits(written[name], tensor) for name, tensor in expected.items())
