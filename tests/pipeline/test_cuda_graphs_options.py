"""`PipelineConfig.cuda_graphs` (design note 0028) on CPU: the option reaches the executor, what cannot be captured
falls back with its reason (training then equals the eager run exactly: it is the eager run), the static-batch
signature and copies, and the device sums the captured last stage adds into. The capture itself needs a GPU:
tests/pipeline/test_gpu_cuda_graphs.py."""

from dataclasses import dataclass

import pytest
import torch
from pipeline_workload import build_meta, context, pipelined_run
from test_pipeline_parity import SCHEDULES
from torch import nn

from d9d.core.loop import TokenBatch
from d9d.pipeline import PipelineConfig, PipelineExecutor, PipelineStage
from d9d.pipeline.program import Placement, StageLayout
from d9d.pipeline.runtime.cuda_graphs import CaptureRefused, StaticSums
from d9d.pipeline.runtime.static_batches import StaticBatches, batch_signature, signature_mismatch

CPU = torch.device("cpu")


def test_option_is_off_by_default_and_validated():
    assert PipelineConfig().cuda_graphs is False
    assert PipelineConfig.model_validate({"cuda_graphs": True}).cuda_graphs is True
    with pytest.raises(ValueError, match="cuda_graphs"):
        PipelineConfig.model_validate({"cuda_graphs": "sometimes"})


def _executor(module: nn.Module, *, cuda_graphs: bool = True) -> PipelineExecutor:
    return PipelineExecutor(
        {0: module}, StageLayout(1, 1, Placement.LOOP), pipeline_rank=0, group=None, device=CPU, cuda_graphs=cuda_graphs
    )


def test_executor_without_the_option_has_no_graphs():
    assert _executor(nn.Linear(2, 2), cuda_graphs=False).graphs is None


def test_unsupported_reasons_name_the_cause():
    graphs = _executor(nn.Linear(2, 2)).graphs
    assert graphs is not None
    assert graphs.unsupported() == "device cpu is not a CUDA device"

    moe = build_meta("moe", PipelineStage()).to_empty(device=CPU)
    reason = _executor(moe).graphs.unsupported()  # type: ignore[union-attr]
    assert reason is not None
    assert "MoELayer" in reason and "route on the host" in reason, reason

    hooked = nn.Linear(2, 2)
    hooked.weight.register_post_accumulate_grad_hook(lambda param: None)
    reason = _executor(hooked).graphs.unsupported()  # type: ignore[union-attr]
    assert reason is not None
    assert "parameter weight has post-accumulate-grad hooks" in reason, reason


@pytest.mark.distributed(world_size=1, timeout=120)
def test_fsdp_stage_is_refused():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
    reason = _executor(module).graphs.unsupported()  # type: ignore[union-attr]
    assert reason is not None
    assert reason.startswith("stages [0] are FSDP-wrapped"), reason


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
@pytest.mark.distributed(world_size=1, timeout=200)
def test_fallback_on_cpu_trains_exactly_as_eager(schedule):
    ctx = context(1)
    config = PipelineConfig(schedule=SCHEDULES[schedule])
    eager = pipelined_run(ctx, "dense", config, steps=4, global_rows=4)
    graphs = pipelined_run(ctx, "dense", config.model_copy(update={"cuda_graphs": True}), steps=4, global_rows=4)
    assert graphs.graph_fallback == "device cpu is not a CUDA device"
    assert graphs.graph_replays == 0
    assert graphs.losses == eager.losses and graphs.grad_norms == eager.grad_norms
    for name, param in eager.params.items():
        assert torch.equal(graphs.params[name], param), name


def _batch(rows: int, seq: int, seed: int) -> TokenBatch:
    generator = torch.Generator().manual_seed(seed)
    return TokenBatch(
        input_ids=torch.randint(0, 50, (rows, seq), generator=generator),
        labels=torch.randint(0, 50, (rows, seq), generator=generator),
    )


@dataclass(frozen=True)
class _Packed:
    tokens: torch.Tensor
    lengths: tuple[int, ...]
    name: str


def test_signature_equal_for_new_values_of_the_same_shapes():
    assert signature_mismatch(batch_signature([_batch(2, 8, 0)]), batch_signature([_batch(2, 8, 1)])) is None
    left = [{"ids": torch.zeros(3, dtype=torch.long), "scale": 2, "tags": ("a", None)}]
    right = [{"ids": torch.ones(3, dtype=torch.long), "scale": 2, "tags": ("a", None)}]
    assert signature_mismatch(batch_signature(left), batch_signature(right)) is None


def test_signature_mismatch_names_the_difference():
    captured = batch_signature([_batch(2, 8, 0), _batch(2, 8, 0)])
    assert signature_mismatch(captured, batch_signature([_batch(2, 8, 0)])) == ("1 micro-batches, the capture had 2")
    assert signature_mismatch(captured, batch_signature([_batch(2, 8, 0), _batch(2, 9, 0)])) == (
        "micro-batch 1, leaf 0: a [2, 9] int64 tensor instead of a [2, 8] int64 tensor"
    )
    half = TokenBatch(input_ids=torch.zeros(2, 8, dtype=torch.int32), labels=torch.zeros(2, 8, dtype=torch.long))
    assert signature_mismatch(captured[:1], batch_signature([half])) == (
        "micro-batch 0, leaf 0: a [2, 8] int32 tensor instead of a [2, 8] int64 tensor"
    )
    packed = batch_signature([_Packed(torch.zeros(4), (1, 3), "x")])
    changed = signature_mismatch(packed, batch_signature([_Packed(torch.zeros(4), (2, 2), "x")]))
    assert changed == "micro-batch 0, leaf 1: the value 2 instead of 1", changed
    renamed = signature_mismatch(packed, batch_signature([_Packed(torch.zeros(4), (1, 3), "y")]))
    assert renamed == "micro-batch 0, leaf 3: the value 'y' instead of 'x'", renamed
    other = signature_mismatch(packed, batch_signature([{"tokens": torch.zeros(4)}]))
    assert other is not None and other.startswith("micro-batch 0 has another structure"), other
    as_tensor = signature_mismatch(batch_signature([{"n": 3}]), batch_signature([{"n": torch.tensor(3)}]))
    assert as_tensor == "micro-batch 0, leaf 0: a [] int64 tensor instead of the value 3", as_tensor


def test_static_batches_rebuild_over_buffers_and_refill():
    first = [_batch(2, 8, 0), _batch(2, 8, 1)]
    static = StaticBatches(first, CPU)
    assert all(isinstance(batch, TokenBatch) for batch in static.batches)
    buffers = [(batch.input_ids, batch.labels) for batch in static.batches]
    for batch, original in zip(static.batches, first, strict=True):
        assert torch.equal(batch.input_ids, original.input_ids) and batch.input_ids is not original.input_ids
    second = [_batch(2, 8, 2), _batch(2, 8, 3)]
    static.fill(second)
    for batch, original, (ids, labels) in zip(static.batches, second, buffers, strict=True):
        assert batch.input_ids is ids and batch.labels is labels  # the same addresses, new values
        assert torch.equal(ids, original.input_ids) and torch.equal(labels, original.labels)


def test_static_batches_keep_non_tensor_leaves():
    static = StaticBatches([{"ids": torch.arange(4), "mode": "packed", "lengths": [1, 3]}], CPU)
    assert static.batches[0]["mode"] == "packed" and static.batches[0]["lengths"] == [1, 3]
    assert torch.equal(static.batches[0]["ids"], torch.arange(4))


def test_static_sums_add_in_the_eager_order_and_refuse_host_numbers():
    sums = StaticSums(["correct"], CPU)
    values = [torch.tensor(0.1), torch.tensor(0.7), torch.tensor(1e-8)]
    eager_loss, eager_metric = 0.0, 0.0
    for value in values:
        sums.add(value.to(torch.float64), {"correct": value * 3})
        eager_loss += float(value.to(torch.float64))
        eager_metric += float(value * 3)
    loss, metrics = sums.read()
    assert loss == eager_loss and metrics == {"correct": eager_metric}  # bitwise: both add float64 from zero
    sums.zero()
    assert sums.read() == (0.0, {"correct": 0.0})
    with pytest.raises(CaptureRefused, match="metric 'correct' is a Python float"):
        sums.add(torch.zeros((), dtype=torch.float64), {"correct": 1.0})
    with pytest.raises(CaptureRefused, match="metric 'other' was not among the warm-up step's metrics"):
        sums.add(torch.zeros((), dtype=torch.float64), {"other": torch.tensor(1.0)})
