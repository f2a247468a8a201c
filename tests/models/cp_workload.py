"""A tiny Qwen3 (dense or MoE) trained on packed documents through the Trainer, with context parallelism.

Shared by the parity tests (cp x dp_shard against one process on the same global batch) and the layout-change
resume test. Every global batch is a function of the step only: rows of random tokens packed with documents of
random lengths (crossing chunk and rank boundaries), labels shifted within each document, some ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import packed_batches
from d9d.core.determinism import seed_everything
from d9d.core.dist import DistributedContext
from d9d.core.dist.domains import MeshDomain
from d9d.core.loop import (
    BuiltModel,
    CheckpointingConfig,
    EventBus,
    LossResult,
    ModelLoader,
    OptimizerStepped,
    Trainer,
    TrainerConfig,
    build_trainer,
)
from d9d.core.lr import PiecewiseScheduleConfig, build_lr_scheduler
from d9d.core.lr.config import RestPhaseConfig, StepsPhaseConfig
from d9d.core.optim import AdamWConfig, build_optimizer
from d9d.kernels.attention import EagerAttentionConfig
from d9d.kernels.grouped_mm import EagerGroupedMmConfig
from d9d.models import DecoderConfig, materialize_
from d9d.models.blocks.late_init import init_normal_
from d9d.models.blocks.moe import TopKRouter, aux_loss_weights
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    Qwen3MoeForCausalLM,
    parallelize_qwen3_dense,
    parallelize_qwen3_moe,
    qwen3_dense_parameters_from_hf,
    qwen3_moe_parameters_from_hf,
)
from d9d.parallel import AnyDataParallelConfig, FsdpConfig, clip_grad_norm_
from d9d.parallel.context import ContextParallelConfig, ContextParallelDataSource

VOCAB = 96
SEQ = 16
SEED = 3
MAX_NORM = 0.5
EAGER = DecoderConfig(attention=EagerAttentionConfig(), grouped_mm=EagerGroupedMmConfig(), loss_chunk_size=7)
DENSE_HF = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    max_position_embeddings=64,
)
MOE_HF = dict(DENSE_HF, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
OPTIMIZER = AdamWConfig(lr=3e-3, weight_decay=0.01)
SCHEDULE = PiecewiseScheduleConfig(
    initial=0.1, phases=[StepsPhaseConfig(steps=3, target=1.0), RestPhaseConfig(target=0.2)]
)


def build_tiny(family: str, config: DecoderConfig = EAGER) -> nn.Module:
    """On the meta device. The MoE has a router z-loss, so the auxiliary-loss weighting is part of the parity."""
    with torch.device("meta"):
        if family == "moe":
            params = qwen3_moe_parameters_from_hf(MOE_HF).model_copy(update={"z_loss_coef": 0.05})
            return Qwen3MoeForCausalLM(params, config=config)
        return Qwen3DenseForCausalLM(qwen3_dense_parameters_from_hf(DENSE_HF), config=config)


def spread_routers(model: nn.Module, std: float | None) -> None:
    """Redraw the router weights with a wider `std` (None: keep them), the same values whatever the layout, so the
    k-th and (k+1)-th expert of a token are far apart (no top-k near-ties that rounding could flip)."""
    if std is None:
        return
    torch.manual_seed(SEED + 1)
    for module in model.modules():
        if isinstance(module, TopKRouter):
            init_normal_(module.weight, std)


def packed_global_batch(step: int, rows: int, seq: int = SEQ) -> dict[str, torch.Tensor]:
    return packed_batches.packed_global_batch(step, rows=rows, seq=seq, vocab=VOCAB, seed=1000)


class PackedTask:
    def count_tokens(self, batch: Mapping[str, torch.Tensor]) -> int:
        return int((batch["labels"] != -100).sum())

    def compute_loss(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> LossResult:
        positions = batch.get("position_ids")
        output = model(
            batch["input_ids"], position_ids=positions, document_ids=batch["document_ids"], labels=batch["labels"]
        )
        return LossResult(loss_sum=output.loss_sum)


class PackedSource:
    """This data-parallel rank's rows of each global batch, as micro-batches of `microbatch_rows`."""

    def __init__(self, *, global_rows: int, microbatch_rows: int, dp_rank: int, dp_size: int) -> None:
        self._rows, self._micro, self._dp_rank, self._dp_size = global_rows, microbatch_rows, dp_rank, dp_size
        self.steps_consumed = 0

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        batch = packed_global_batch(self.steps_consumed, self._rows)
        self.steps_consumed += 1
        per_rank = self._rows // self._dp_size
        start = self._dp_rank * per_rank
        return [
            {key: value[row : row + self._micro] for key, value in batch.items()}
            for row in range(start, start + per_rank, self._micro)
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"steps_consumed": self.steps_consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps_consumed = int(state["steps_consumed"])


def data_provider_for(global_rows: int, microbatch_rows: int) -> Any:
    def provide(ctx: DistributedContext, microbatches_per_step: int) -> Any:
        coordinate = ctx.coordinate(MeshDomain.BATCH)
        source = PackedSource(
            global_rows=global_rows, microbatch_rows=microbatch_rows, dp_rank=coordinate["dp"], dp_size=ctx.degrees.dp
        )
        if ctx.degrees.cp == 1:
            return source
        return ContextParallelDataSource(source, cp_rank=coordinate["cp"], cp=ctx.degrees.cp)

    return provide


@dataclass(frozen=True)
class CpModelProvider:
    family: str
    context: ContextParallelConfig
    prepare: Callable[[nn.Module], object] | None = None  # e.g. LoRA injection, on the meta model
    data_parallel: AnyDataParallelConfig = field(default_factory=FsdpConfig)
    router_std: float | None = None
    config: DecoderConfig = EAGER

    def __call__(self, ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
        model = build_tiny(self.family, self.config)
        if self.prepare is not None:
            self.prepare(model)
        parallelize = parallelize_qwen3_dense if self.family == "dense" else parallelize_qwen3_moe
        sync = parallelize(model, ctx, self.data_parallel, context=self.context)
        materialize_(model, ctx.device)
        spread_routers(model, self.router_std)
        return BuiltModel(model=model, gradient_sync=sync, aux_losses=aux_loss_weights(model))


def build_cp_trainer(
    ctx: DistributedContext,
    *,
    family: str,
    total_steps: int,
    global_rows: int,
    microbatch_rows: int = 1,
    attention: str = "ring",
    events: EventBus | None = None,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int | None = None,
    prepare: Callable[[nn.Module], object] | None = None,
    data_parallel: AnyDataParallelConfig | None = None,
    router_std: float | None = None,
    decoder: DecoderConfig = EAGER,
) -> Trainer[Any]:
    config = TrainerConfig(
        total_steps=total_steps,
        global_batch_rows=global_rows,
        microbatch_rows=microbatch_rows,
        max_grad_norm=MAX_NORM,
        seed=SEED,
        checkpointing=(
            CheckpointingConfig(directory=checkpoint_dir, every_steps=checkpoint_every)
            if checkpoint_dir is not None
            else None
        ),
    )
    return build_trainer(
        ctx,
        config,
        model_provider=CpModelProvider(  # type: ignore[arg-type]
            family,
            ContextParallelConfig(attention=attention),
            prepare,
            data_parallel or FsdpConfig(),
            router_std,
            decoder,
        ),
        task=PackedTask(),
        data_provider=data_provider_for(global_rows, microbatch_rows),
        optimizer_provider=lambda model: build_optimizer(OPTIMIZER, model.parameters()),
        lr_scheduler_provider=lambda optimizer, steps: build_lr_scheduler(SCHEDULE, optimizer, steps),
        clipper=clip_grad_norm_,
        events=events,
    )


@dataclass
class Run:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]
    model: nn.Module


def train_distributed(
    ctx: DistributedContext,
    family: str,
    steps: int,
    global_rows: int,
    attention: str,
    prepare: Callable[[nn.Module], object] | None = None,
    data_parallel: AnyDataParallelConfig | None = None,
    router_std: float | None = None,
    decoder: DecoderConfig = EAGER,
    events: EventBus | None = None,
) -> Run:
    events = events or EventBus()
    norms: list[float] = []
    events.subscribe(OptimizerStepped, lambda event: norms.append(event.grad_norm))
    trainer = build_cp_trainer(
        ctx,
        family=family,
        total_steps=steps,
        global_rows=global_rows,
        attention=attention,
        events=events,
        prepare=prepare,
        data_parallel=data_parallel,
        router_std=router_std,
        decoder=decoder,
    )
    result = trainer.train()
    model = trainer.parts.model
    return Run([result.losses[s] for s in range(1, steps + 1)], norms, full_parameters(model), model)


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for name, param in model.named_parameters()
    }


def train_reference(
    family: str,
    steps: int,
    global_rows: int,
    *,
    aux_weight: float = 1.0,
    prepare: Callable[[nn.Module], object] | None = None,
    router_std: float | None = None,
) -> Run:
    """One process, the whole global batch per step, plain full attention (positions from the document ids).

    `aux_weight` scales the MoE auxiliary losses (1: one forward over the whole batch is the step's); `router_std`
    as in `spread_routers`."""
    model = build_tiny(family)
    if prepare is not None:
        prepare(model)
    seed_everything(SEED)
    materialize_(model, "cpu")
    spread_routers(model, router_std)
    weights = aux_loss_weights(model)
    if weights is not None:
        weights.set_weight(aux_weight)
    optimizer = build_optimizer(OPTIMIZER, model.parameters())
    scheduler = build_lr_scheduler(SCHEDULE, optimizer, steps)
    losses, norms = [], []
    for step in range(steps):
        batch = packed_global_batch(step, global_rows)
        optimizer.zero_grad(set_to_none=True)
        output = model(batch["input_ids"], document_ids=batch["document_ids"], labels=batch["labels"])
        loss = output.losses.sum() / (batch["labels"] != -100).sum()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return Run(losses, norms, full_parameters(model), model)
