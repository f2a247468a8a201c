"""pp=2 x cp=2 (4 gloo ranks): tiny Qwen3 dense and Qwen3-MoE (router z-loss) on packed documents, pipelined with
context parallelism in every stage, trained 10 steps with 8 one-row micro-batches through the core Trainer, equal
single-process training on the same global batch.

Each cp rank holds its load-balanced shard of every sequence (`ContextParallelDataSource`: chunks `r` and
`2cp-1-r`, global positions computed on the full row first), so a stage hands the next one `(1, seq / cp, hidden)`
and every stage gets the micro-batch's shard of positions and document ids (attention masks documents across the
ring). Attention is the ring or the key/value all-gather over the cp ranks of the stage; FSDP shards each stage
over `dp_cp_shard` (= cp here), so the parameter gradients are summed over the cp ranks as over data ranks. The
stage inputs, their activations and the pipeline's point-to-point sends are all shards; the task is the one
`d9d run` uses (`PackedCausalLMTask`).

Documents of random lengths cross the cp chunk boundaries; labels are shifted within each document and 20% are
ignored. The reference runs the whole rows in one process with plain causal attention (positions from the document
ids), one row per micro-batch, each backpropagating `loss_sum / global tokens` (the z-loss weighted 1 / rows).

Tolerances (float32): besides the pipeline's reordering (test_pipeline_parity.py), context parallelism sums in
another order (the ring's online-softmax merges, the FSDP reduce-scatter over cp, per-shard losses), a few ulps per
op, as tests/models/test_context_parallel_training.py. Asserted: loss 2e-5 relative, parameters 2e-5 absolute and the
dense grad norm 1e-5 relative (the pp x tp bounds); the MoE grad norm 5e-5 relative: on this workload context
parallelism alone (pp=1 x cp=2, the same run without a pipeline) drifts to 2.4e-5 at step 9 while loss stays within
2e-8 (AdamW carrying the ring's reordering through rarely chosen experts, whose second moments are tiny), and the
pipelined run to 1.8e-5: the drift is cp's, not the pipeline's. The measured worst (printed) is in
docs/parallelism.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pipeline_workload import (
    AUX_LOSSES,
    HIDDEN,
    LAYERS,
    LR_SCHEDULE,
    MAX_GRAD_NORM,
    OPTIMIZER,
    VOCAB,
    RunRecord,
    build_meta,
    errors_against,
    load_initial,
)
from test_pipeline_parity import SCHEDULES
from torch import nn
from torch.distributed.tensor import DTensor

import packed_batches
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.dist.domains import MeshDomain
from d9d.core.loop import BuiltModel, EventBus, StepFinished, TrainerConfig, build_trainer
from d9d.core.lr import build_lr_scheduler
from d9d.core.optim import build_optimizer
from d9d.flows.jobs.rank_wiring import PackedCausalLMTask
from d9d.models import materialize_
from d9d.models.blocks.moe import aux_loss_weights
from d9d.models.qwen3 import parallelize_qwen3_dense, parallelize_qwen3_moe
from d9d.parallel import FsdpConfig, ModuleGradientSync, clip_grad_norm_
from d9d.parallel.context import ContextParallelConfig, ContextParallelDataSource, shard_sequence
from d9d.pipeline import PipelineAuxLosses, PipelineConfig, PipelineStage, build_pipeline_schedule, pipeline_group

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

STEPS, ROWS, SEQ = 10, 8, 16  # seq 16: 4 chunks of 4 tokens over cp=2, documents of 2-9 tokens crossing them
LOSS_RTOL, PARAM_ATOL = 2e-5, 2e-5
NORM_RTOL = {"dense": 1e-5, "moe_z_loss": 5e-5}


def packed_global_batch(step: int, rows: int = ROWS) -> dict[str, torch.Tensor]:
    return packed_batches.packed_global_batch(step, rows=rows, seq=SEQ, vocab=VOCAB, seed=2000)


class PackedRows:
    """This data-parallel rank's one-row micro-batches of each global batch (a `DataSource` of dict batches)."""

    def __init__(self, *, dp_rank: int, dp_size: int) -> None:
        self.dp_rank, self.dp_size, self.steps_consumed = dp_rank, dp_size, 0

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        batch = packed_global_batch(self.steps_consumed)
        self.steps_consumed += 1
        per_rank = ROWS // self.dp_size
        start = self.dp_rank * per_rank
        return [{key: value[row : row + 1] for key, value in batch.items()} for row in range(start, start + per_rank)]

    def state_dict(self) -> dict[str, Any]:
        return {"steps_consumed": self.steps_consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps_consumed = int(state["steps_consumed"])


def reference_run(family: str) -> list[RunRecord]:
    """One process, whole rows, plain causal attention within documents; a record per step."""
    model = materialize_(build_meta(family, PipelineStage()), "cpu")
    load_initial(model, family)
    optimizer = build_optimizer(OPTIMIZER, model.parameters())
    scheduler = build_lr_scheduler(LR_SCHEDULE, optimizer, STEPS)
    aux = aux_loss_weights(model)
    records: list[RunRecord] = []
    for step in range(STEPS):
        batch = packed_global_batch(step)
        tokens = int((batch["labels"] != -100).sum())
        optimizer.zero_grad(set_to_none=True)
        if aux is not None:
            aux.set_weight(1.0 / ROWS)
        loss = 0.0
        for row in range(ROWS):
            micro = {key: value[row : row + 1] for key, value in batch.items()}
            out = model(micro["input_ids"], document_ids=micro["document_ids"], labels=micro["labels"])
            loss_sum = out.losses.sum()
            (loss_sum / tokens).backward()
            loss += float(loss_sum)
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), MAX_GRAD_NORM)
        optimizer.step()
        scheduler.step()
        records.append(
            RunRecord(
                losses=[loss / tokens],
                grad_norms=[float(norm)],
                params={name: param.detach().clone() for name, param in model.named_parameters()},
            )
        )
    return records


def shared_reference(family: str, device: torch.device | None = None) -> list[RunRecord]:
    """`reference_run` on rank 0 (CPU), handed to every rank (`device`: the group's, for NCCL)."""
    box: list[object] = [reference_run(family) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, device=device)
    records = box[0]
    assert isinstance(records, list)
    return records


def pipelined_cp_run(ctx: DistributedContext, family: str, config: PipelineConfig, attention: str) -> RunRecord:
    """The core Trainer with the pipeline schedule on `ctx` (cp > 1); this rank's final parameters, full tensors."""
    dp = ctx.degrees.dp_replicate * ctx.degrees.dp_shard
    context = ContextParallelConfig(attention=attention)  # type: ignore[arg-type]
    holder: dict[str, object] = {}

    def build_stage(stage: PipelineStage) -> nn.Module:
        module = build_meta(family, stage)
        parallelize = parallelize_qwen3_moe if family in AUX_LOSSES else parallelize_qwen3_dense
        parallelize(module, ctx, FsdpConfig(), context=context)
        materialize_(module, ctx.device)
        load_initial(module, family)
        return module

    def provide(ctx: DistributedContext, loader: object) -> BuiltModel:
        schedule = build_pipeline_schedule(
            config, ctx, num_layers=LAYERS, num_microbatches=ROWS // dp, build_stage=build_stage
        )
        holder["schedule"] = schedule
        aux_weights = aux_loss_weights(schedule.model)
        group = pipeline_group(ctx)
        aux = PipelineAuxLosses(aux_weights, group, ctx.device) if family in AUX_LOSSES else None
        return BuiltModel(model=schedule.model, gradient_sync=ModuleGradientSync(schedule.model), aux_losses=aux)

    def data(ctx: DistributedContext, microbatches: int) -> ContextParallelDataSource:
        coordinate = ctx.coordinate(MeshDomain.BATCH)
        rows = PackedRows(dp_rank=coordinate["dp"], dp_size=dp)
        return ContextParallelDataSource(rows, cp_rank=coordinate["cp"], cp=ctx.degrees.cp)

    events = EventBus()
    norms: list[float] = []
    events.subscribe(StepFinished, lambda event: norms.append(event.metrics["grad_norm"]))
    trainer = build_trainer(
        ctx,
        TrainerConfig(
            total_steps=STEPS, global_batch_rows=ROWS, microbatch_rows=1, max_grad_norm=MAX_GRAD_NORM, seed=3
        ),
        model_provider=provide,
        task=PackedCausalLMTask(hidden_size=HIDDEN, sequence_shards=ctx.degrees.tp),
        data_provider=data,
        optimizer_provider=lambda model: build_optimizer(OPTIMIZER, model.parameters()),
        lr_scheduler_provider=lambda optimizer, total: build_lr_scheduler(LR_SCHEDULE, optimizer, total),
        clipper=functools.partial(clip_grad_norm_, across=pipeline_group(ctx)),
        schedule=None,
        events=events,
    )
    trainer.parts.schedule = holder["schedule"]  # type: ignore[assignment]
    result = trainer.train()
    params = {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for name, param in trainer.parts.model.named_parameters()
    }
    return RunRecord(losses=[result.losses[step] for step in sorted(result.losses)], grad_norms=norms, params=params)


def _check(ctx: DistributedContext, schedule: str, attention: str, families: tuple[str, ...]) -> None:
    layout = ctx.degrees.describe()
    for family in families:
        record = pipelined_cp_run(ctx, family, PipelineConfig(schedule=SCHEDULES[schedule]), attention)
        reference = shared_reference(family)
        losses, norms = [step.losses[0] for step in reference], [step.grad_norms[0] for step in reference]
        errors = errors_against(record, reference)
        loss, norm, params = errors.loss, errors.norm, errors.params
        if dist.get_rank() == 0:
            print(f"{family} {schedule} {attention} ({layout}): loss {loss:.1e} norm {norm:.1e} params {params:.1e}")
        assert loss < LOSS_RTOL, (record.losses, losses)
        assert norm < NORM_RTOL[family], (record.grad_norms, norms)
        assert params < PARAM_ATOL
        assert max(norms) > MAX_GRAD_NORM, "clipping should be active in some step"


@pytest.mark.parametrize(("schedule", "attention"), [("1f1b", "ring"), ("zbv", "all_gather")])
@pytest.mark.distributed(world_size=4, timeout=600)
def test_pp2_cp2_matches_single_process(schedule, attention):
    ctx = DistributedContext.build(MeshDegrees(pp=2, cp=2), device="cpu")
    _check(ctx, schedule, attention, ("dense", "moe_z_loss"))


@pytest.mark.distributed(world_size=4, timeout=300)
def test_a_cp_stage_hands_over_its_sequence_shard_and_needs_positions():
    """What the next stage receives under cp: this cp rank's `(1, seq / cp, hidden)` shard of the first stage's
    output, in the load-balanced layout (chunks `r` and `2cp-1-r` of the whole row's output; fp32, attention summed
    in another order: 1e-5), which is `activation_spec`'s shape for the sharded batch; a stage that gets no
    positions refuses the batch (they must be the whole row's)."""
    ctx = DistributedContext.build(MeshDegrees(pp=2, cp=2), device="cpu")
    cp_rank = ctx.coordinate(MeshDomain.BATCH)["cp"]
    stage = PipelineStage(0, 2)
    module = build_meta("dense", stage)
    parallelize_qwen3_dense(module, ctx, FsdpConfig(), context=ContextParallelConfig(attention="ring"))
    materialize_(module, ctx.device)
    load_initial(module, "dense")
    whole = PackedRows(dp_rank=0, dp_size=1).next_step()[0]
    micro = ContextParallelDataSource(PackedRows(dp_rank=0, dp_size=1), cp_rank=cp_rank, cp=2).next_step()[0]
    task = PackedCausalLMTask(hidden_size=HIDDEN)
    out = task.forward_stage(module, micro, stage=stage, hidden=None)
    assert isinstance(out, torch.Tensor)
    assert out.shape == task.activation_spec(micro, stage=stage).shape == (1, SEQ // 2, HIDDEN)
    plain = materialize_(build_meta("dense", stage), "cpu")
    load_initial(plain, "dense")
    expected = plain(whole["input_ids"], document_ids=whole["document_ids"]).hidden_states
    torch.testing.assert_close(out, shard_sequence(expected, cp_rank, 2, dim=1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="must carry position_ids computed on the full sequence"):
        module(micro["input_ids"], document_ids=micro["document_ids"])
