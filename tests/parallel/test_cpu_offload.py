"""CPU offload of FSDP units (`FsdpConfig(offload=True)`): the same training, the state in host memory.

On gloo ranks every tensor is on the CPU already, so offloading changes where FSDP keeps its shards (and which code
paths it runs: the offload policy's copies, the CPU gradient hand-over, the CPU optimizer step), not one operation of
the arithmetic. Two ranks of the tiny Qwen3 through the Trainer (accumulation over micro-batches, clipping, a warm-up
schedule), with and without offload, must therefore agree *exactly*: losses, gradient norms and final parameters,
for float32 AdamW and for bfloat16 parameters with StochasticAdamW (its PyTorch path, whose CPU generator draws the
same rounding noise either way). A job checkpoint written without offload resumes with it and the other way round,
again bit for bit against the uninterrupted run: DCP reshards into CPU-offloaded DTensors like into any others.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from offload_workload import BF16, assert_same_training, resume, train
from pydantic import TypeAdapter, ValidationError

from d9d.core.dist import MeshDegrees
from d9d.parallel import AnyDataParallelConfig, FsdpConfig, HsdpConfig

pytestmark = [
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:Slicing a flattened dim:UserWarning"),
]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-adamw", "bf16-stochastic-adamw"])
@pytest.mark.distributed(world_size=2, timeout=300)
def test_offloaded_fsdp_trains_exactly_like_fsdp(bf16):
    precision = BF16 if bf16 else None
    reference = train(FsdpConfig(mixed_precision=precision), bf16=bf16)
    offloaded = train(FsdpConfig(mixed_precision=precision, offload=True), bf16=bf16)
    units, with_policy = offloaded["units"]
    assert units == 5 and with_policy == units  # 2 layers, embedding, head and the root: every unit offloads
    assert reference["units"] == (5, 0) and reference["offloaded_modules"] == 0
    assert offloaded["state_devices"] == {"cpu"}
    assert offloaded["compute_device"] == torch.device("cpu")  # a CPU mesh computes on the CPU
    assert_same_training(offloaded, reference)
    assert reference["moved"] > 1e-3  # the optimizer moved the weights, so agreeing on them means something


@pytest.mark.parametrize(
    ("family", "degrees", "config", "expected_units"),
    [  # the 5 units of the dense plan (2 layers, embedding, head, root), plus one per MoE layer's experts or block
        ("moe", MeshDegrees(dp_shard=2, ep=2), FsdpConfig(offload=True), 7),
        ("moe", MeshDegrees(tp=2), FsdpConfig(offload=True), 7),
        ("dense", MeshDegrees(dp_replicate=2), HsdpConfig(offload=True), 5),
    ],
    ids=["moe-ep2", "moe-tp2", "dense-hsdp"],
)
@pytest.mark.distributed(world_size=2, timeout=300)
def test_every_unit_of_the_qwen3_plans_offloads(family, degrees, config, expected_units):
    # Expert units (ep: `parallelize_experts`; tp: the MoE blocks over dp_cp_shard x tp) are sharded outside
    # `build_data_parallel`: they must offload too, or the optimizer would see CPU and device parameters mixed.
    run = train(config, family=family, degrees=degrees, steps=4)
    units, with_policy = run["units"]
    assert units == expected_units and with_policy == units, run["units"]
    assert run["state_devices"] == {"cpu"}
    assert all(torch.isfinite(torch.tensor(list(run["losses"].values()))))


@pytest.mark.parametrize(("first", "second"), [(False, True), (True, False)], ids=["on-resume", "off-resume"])
@pytest.mark.distributed(world_size=2, timeout=300)
def test_job_checkpoint_resumes_across_offload(first, second, tmp_path):
    # Preempted (SIGTERM) at step 3 and checkpointed, resumed with offload switched; against the uninterrupted run.
    directory = tmp_path / f"checkpoints-{first}-{second}"  # one path for every rank: ranks fork from the test
    reference = train(FsdpConfig())
    resumed = resume(first, second, directory)
    assert_same_training(resumed, reference)
    dist.barrier()


def test_offload_is_an_option_of_the_sharded_kinds_only():
    adapter: TypeAdapter[AnyDataParallelConfig] = TypeAdapter(AnyDataParallelConfig)
    assert adapter.validate_python({"kind": "fsdp", "offload": True}) == FsdpConfig(offload=True)
    assert adapter.validate_python({"kind": "hsdp", "offload": True}) == HsdpConfig(offload=True)
    assert adapter.validate_python({"kind": "single", "offload": False}).kind == "single"  # false: nothing asked
    with pytest.raises(ValidationError, match=r"kind='single' cannot offload \(got offload=True\).*use kind='fsdp'"):
        adapter.validate_python({"kind": "single", "offload": True})
    with pytest.raises(ValidationError, match=r"kind='replicate' cannot offload .*use kind='fsdp' \(or 'hsdp'\)"):
        adapter.validate_python({"kind": "replicate", "offload": True})
    with pytest.raises(ValidationError, match="offload"):
        adapter.validate_python({"kind": "fsdp", "offload": "sometimes"})
