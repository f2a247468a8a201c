"""Tiny Qwen3 dense / MoE trained pipelined through the core Trainer, and the single-process reference.

The reference is the Trainer's math by hand in one process: every step's global batch, one-row micro-batches each
backpropagating `loss_sum / global tokens` (MoE auxiliary losses weighted 1 / micro-batches), clipping to 0.5, AdamW
with the piecewise LR schedule. The pipelined run builds each stage on meta, parallelises it, materialises it and
copies the reference's initial weights in (by the global parameter names stages keep).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.dist.domains import MeshDomain
from d9d.core.loop import (
    BuiltModel,
    CheckpointingConfig,
    EventBus,
    LossResult,
    NoGradientSync,
    StepFinished,
    SyntheticTokenSource,
    TokenBatch,
    TrainerConfig,
    build_trainer,
    synthetic_global_batch,
)
from d9d.core.lr import PiecewiseScheduleConfig, build_lr_scheduler
from d9d.core.lr.config import RestPhaseConfig, StepsPhaseConfig
from d9d.core.optim import AdamWConfig, build_optimizer
from d9d.kernels.attention import EagerAttentionConfig
from d9d.kernels.grouped_mm import EagerGroupedMmConfig
from d9d.kernels.linear_cross_entropy import EagerLinearCrossEntropyConfig
from d9d.kernels.moe_permute import EagerMoePermuteConfig
from d9d.kernels.rms_norm import EagerRmsNormConfig
from d9d.kernels.rope import EagerRopeConfig
from d9d.kernels.swiglu import EagerSwiGluConfig
from d9d.models import DecoderConfig, materialize_
from d9d.models.blocks.moe import aux_loss_weights
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    Qwen3MoeForCausalLM,
    parallelize_qwen3_dense,
    parallelize_qwen3_moe,
    qwen3_dense_parameters_from_hf,
    qwen3_moe_parameters_from_hf,
)
from d9d.parallel import FsdpConfig, ModuleGradientSync, clip_grad_norm_
from d9d.pipeline import (
    ActivationSpec,
    PipelineAuxLosses,
    PipelineConfig,
    PipelineCosts,
    PipelineSchedule,
    PipelineStage,
    build_pipeline_schedule,
    pipeline_group,
)

VOCAB, SEQ, HIDDEN, LAYERS = 64, 8, 32, 8
MAX_GRAD_NORM = 0.5
# Every kernel family named: a backend left to "auto" is resolved from the machine at build time, so on a GPU host
# the CPU reference would get Triton kernels (which refuse CPU tensors).
EAGER = DecoderConfig(
    attention=EagerAttentionConfig(),
    grouped_mm=EagerGroupedMmConfig(),
    rms_norm=EagerRmsNormConfig(),
    swiglu=EagerSwiGluConfig(),
    rope=EagerRopeConfig(),
    moe_permute=EagerMoePermuteConfig(),
    linear_cross_entropy=EagerLinearCrossEntropyConfig(),
    loss_chunk_size=5,
)
DENSE_HF = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=48,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention that tp=2 can split (one key/value head per rank)
    head_dim=8,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    max_position_embeddings=64,
)
MOE_HF = dict(DENSE_HF, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
OPTIMIZER = AdamWConfig(lr=3e-3, weight_decay=0.01)
LR_SCHEDULE = PiecewiseScheduleConfig(
    initial=0.1, phases=[StepsPhaseConfig(steps=3, target=1.0), RestPhaseConfig(target=0.2)]
)


AUX_LOSSES = {
    "moe": {"z_loss_coef": 0.05, "load_balancing_coef": 0.1},  # auxiliary losses ride through stages
    # Under tp each rank routes a sequence shard: its z-loss (a mean over tokens) adds up to the micro-batch's, its
    # load-balancing loss (a product of means) does not (per-shard balance, as per-micro-batch balance without tp).
    "moe_z_loss": {"z_loss_coef": 0.05},
}
"""The MoE families (same parameters, hence the same initial weights) by their auxiliary-loss coefficients."""


def build_meta(family: str, stage: PipelineStage, decoder: DecoderConfig = EAGER) -> nn.Module:
    """`family`: "dense" or a key of `AUX_LOSSES`."""
    with torch.device("meta"):
        if family in AUX_LOSSES:
            params = qwen3_moe_parameters_from_hf(MOE_HF).model_copy(update=AUX_LOSSES[family])
            return Qwen3MoeForCausalLM(params, config=decoder, stage=stage)
        return Qwen3DenseForCausalLM(qwen3_dense_parameters_from_hf(DENSE_HF), config=decoder, stage=stage)


@functools.cache
def initial_state(family: str) -> dict[str, torch.Tensor]:
    """The whole model's initial weights (same on every rank: fixed seed, plain tensors)."""
    torch.manual_seed(1234)
    model = materialize_(build_meta(family, PipelineStage()), "cpu")
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@torch.no_grad()
def load_initial(module: nn.Module, family: str) -> None:
    state = initial_state(family)
    for name, tensor in module.state_dict().items():
        full = state[name]
        if isinstance(tensor, DTensor):
            tensor.to_local().copy_(
                distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            )
        else:
            tensor.copy_(full)


def dense_schedule(
    ctx: DistributedContext, config: PipelineConfig, *, num_layers: int, num_microbatches: int
) -> PipelineSchedule:
    """`config`'s schedule over tiny Qwen3 dense stages holding the shared initial weights (no FSDP)."""

    def build_stage(stage: PipelineStage) -> nn.Module:
        module = build_meta("dense", stage)
        materialize_(module, ctx.device)
        load_initial(module, "dense")
        return module

    return build_pipeline_schedule(
        config, ctx, num_layers=num_layers, num_microbatches=num_microbatches, build_stage=build_stage
    )


class CausalLMPipelineTask:
    """Labels are already shifted; stages hand over `(rows, seq / sequence_shards, hidden)` float32 hidden states:
    under tensor (sequence) parallelism each tp rank sends its shard of the sequence to the same tp rank of the next
    stage."""

    def __init__(self, sequence_shards: int = 1) -> None:
        self.sequence_shards = sequence_shards

    def count_tokens(self, batch: TokenBatch) -> int:
        return int((batch.labels != -100).sum())

    def compute_loss(self, model: nn.Module, batch: TokenBatch) -> LossResult:
        return LossResult(loss_sum=model(batch.input_ids, labels=batch.labels).loss_sum)

    def forward_stage(
        self, module: nn.Module, batch: TokenBatch, *, stage: PipelineStage, hidden: torch.Tensor | None
    ) -> torch.Tensor | LossResult:
        device = next(module.parameters()).device  # the synthetic source yields CPU tensors
        out = module(
            batch.input_ids.to(device) if stage.is_first else None,
            hidden_states=hidden,
            labels=batch.labels.to(device) if stage.is_last else None,
        )
        if stage.is_last:
            return LossResult(loss_sum=out.loss_sum)
        return out.hidden_states

    def activation_spec(self, batch: TokenBatch, *, stage: PipelineStage) -> ActivationSpec:
        rows, seq = batch.input_ids.shape
        return ActivationSpec(shape=(rows, seq // self.sequence_shards, HIDDEN), dtype=torch.float32)


@dataclass
class RunRecord:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]  # this rank's parameters at the end (full tensors), global names
    deferred_weight_gradients: int = 0  # weight gradients the executor's weight-gradient store deferred to W
    graph_replays: int = 0  # steps the executor only replayed as CUDA graphs (PipelineConfig.cuda_graphs)
    graph_fallback: str | None = None  # why the last step ran eagerly under cuda_graphs (None: it replayed)
    measured_costs: PipelineCosts | None = None  # what PipelineConfig.measure_costs_at_step measured


def reference_run(family: str, *, steps: int, global_rows: int, seed: int = 5) -> list[RunRecord]:
    """Single process; a record after every step (params of the last step only are compared per step by tests)."""
    torch.manual_seed(0)
    model = materialize_(build_meta(family, PipelineStage()), "cpu")
    load_initial(model, family)
    optimizer = build_optimizer(OPTIMIZER, model.parameters())
    scheduler = build_lr_scheduler(LR_SCHEDULE, optimizer, steps)
    aux = aux_loss_weights(model)
    task = CausalLMPipelineTask()
    records: list[RunRecord] = []
    for step in range(steps):
        batch = synthetic_global_batch(
            seed=seed, step=step, rows=global_rows, seq_len=SEQ, vocab_size=VOCAB, ignore_fraction=0.3
        )
        tokens = task.count_tokens(batch)
        optimizer.zero_grad(set_to_none=True)
        if aux is not None:
            aux.set_weight(1.0 / global_rows)
        loss = 0.0
        for row in range(global_rows):
            micro = TokenBatch(input_ids=batch.input_ids[row : row + 1], labels=batch.labels[row : row + 1])
            loss_sum = task.compute_loss(model, micro).loss_sum
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


def shared_reference(
    family: str, *, steps: int, global_rows: int, device: torch.device | None = None
) -> list[RunRecord]:
    """`reference_run` computed once, on rank 0 (on CPU), and handed to every rank (ranks share two cores)."""
    box: list[object] = [reference_run(family, steps=steps, global_rows=global_rows) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, device=device)
    records = box[0]
    assert isinstance(records, list)
    return records


def synthetic_source(*, seed: int, global_rows: int, dp_rank: int = 0, dp_size: int = 1) -> SyntheticTokenSource:
    """The workload's synthetic batches (one row per micro-batch), by default all of them on one data-parallel
    rank."""
    return SyntheticTokenSource(
        seed=seed,
        global_rows=global_rows,
        microbatch_rows=1,
        seq_len=SEQ,
        vocab_size=VOCAB,
        dp_rank=dp_rank,
        dp_size=dp_size,
        ignore_fraction=0.3,
    )


def pipelined_run(
    ctx: DistributedContext,
    family: str,
    config: PipelineConfig,
    *,
    steps: int,
    global_rows: int,
    fsdp: bool = False,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int | None = None,
    seed: int = 5,
    decoder: DecoderConfig = EAGER,
) -> RunRecord:
    """Train through the core Trainer with the pipeline schedule; this rank's final parameters as full tensors.
    `decoder` picks the kernel backends (the reference always runs `EAGER`)."""
    trainer_config = TrainerConfig(
        total_steps=steps,
        global_batch_rows=global_rows,
        microbatch_rows=1,
        max_grad_norm=MAX_GRAD_NORM,
        seed=3,
        gc_every=None,
        checkpointing=(
            CheckpointingConfig(directory=checkpoint_dir, every_steps=checkpoint_every, keep_last=4)
            if checkpoint_dir is not None
            else None
        ),
    )
    dp = ctx.degrees.dp_replicate * ctx.degrees.dp_shard
    num_microbatches = global_rows // dp
    group = pipeline_group(ctx)
    holder: dict[str, object] = {}

    def build_stage(stage: PipelineStage) -> nn.Module:
        module = build_meta(family, stage, decoder)
        if fsdp:
            parallelize = parallelize_qwen3_moe if family in AUX_LOSSES else parallelize_qwen3_dense
            parallelize(module, ctx, FsdpConfig())
        materialize_(module, ctx.device)
        load_initial(module, family)
        return module

    def provide(ctx: DistributedContext, loader: object) -> BuiltModel:
        schedule = build_pipeline_schedule(
            config, ctx, num_layers=LAYERS, num_microbatches=num_microbatches, build_stage=build_stage
        )
        holder["schedule"] = schedule
        sync = ModuleGradientSync(schedule.model) if fsdp else NoGradientSync()
        aux = PipelineAuxLosses(aux_loss_weights(schedule.model), group, ctx.device) if family in AUX_LOSSES else None
        return BuiltModel(model=schedule.model, gradient_sync=sync, aux_losses=aux)

    def data(ctx: DistributedContext, microbatches: int) -> SyntheticTokenSource:
        coordinate = ctx.coordinate(MeshDomain.BATCH)
        return synthetic_source(seed=seed, global_rows=global_rows, dp_rank=coordinate["dp"], dp_size=dp)

    events = EventBus()
    norms: list[float] = []
    events.subscribe(StepFinished, lambda event: norms.append(event.metrics["grad_norm"]))
    trainer = build_trainer(
        ctx,
        trainer_config,
        model_provider=provide,
        task=CausalLMPipelineTask(sequence_shards=ctx.degrees.tp),
        data_provider=data,
        optimizer_provider=lambda model: build_optimizer(OPTIMIZER, model.parameters()),
        lr_scheduler_provider=lambda optimizer, total: build_lr_scheduler(LR_SCHEDULE, optimizer, total),
        clipper=functools.partial(clip_grad_norm_, across=group),
        schedule=None,
        events=events,
    )
    trainer.parts.schedule = holder["schedule"]  # type: ignore[assignment]
    result = trainer.train()
    params = {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for name, param in trainer.parts.model.named_parameters()
    }
    schedule = holder["schedule"]
    assert isinstance(schedule, PipelineSchedule)
    return RunRecord(
        losses=[result.losses[step] for step in sorted(result.losses)],
        grad_norms=norms,
        params=params,
        deferred_weight_gradients=schedule.executor.deferred_weight_gradients,
        graph_replays=graphs.replays if (graphs := schedule.executor.graphs) is not None else 0,
        graph_fallback=graphs.reason if graphs is not None else None,
        measured_costs=schedule.measured_costs,
    )


def context(pp: int, dp_shard: int = 1, device: str = "cpu", *, tp: int = 1) -> DistributedContext:
    degrees = MeshDegrees(pp=pp, dp_shard=dp_shard, tp=tp)
    return DistributedContext.build(degrees, device=device)  # type: ignore[arg-type]


def max_relative(actual: list[float], expected: list[float]) -> float:
    assert len(actual) == len(expected), (len(actual), len(expected))
    return max(abs(a - e) / max(abs(e), 1e-12) for a, e in zip(actual, expected, strict=True))


def max_param_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert actual, "this rank holds no parameters"
    return max(float((actual[name].cpu() - expected[name]).abs().max()) for name in actual)


def all_ranks_max(value: float, device: torch.device | None = None) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


@dataclass(frozen=True)
class ParityErrors:
    """How far a pipelined run is from single-process training: the largest relative error of the per-step losses
    and grad norms, and the largest absolute error of the final parameters over every rank."""

    loss: float
    norm: float
    params: float


def errors_against(record: RunRecord, reference: list[RunRecord], device: torch.device | None = None) -> ParityErrors:
    """`record` (this rank's pipelined run) against `reference` (`shared_reference`'s steps); a collective."""
    return ParityErrors(
        loss=max_relative(record.losses, [step.losses[0] for step in reference]),
        norm=max_relative(record.grad_norms, [step.grad_norms[0] for step in reference]),
        params=all_ranks_max(max_param_error(record.params, reference[-1].params), device),
    )
