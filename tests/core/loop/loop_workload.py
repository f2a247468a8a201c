"""A tiny Qwen3 (dense or MoE) wired into the Trainer the way a job would: providers, task, synthetic data.

Shared by the in-process multi-rank tests and by `rank_program.py`, which `torchrun` launches in the kill tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from d9d.core.dist import DistributedContext
from d9d.core.dist.domains import MeshDomain
from d9d.core.loop import (
    BuiltModel,
    CheckpointingConfig,
    EventBus,
    ForwardBackwardFinished,
    LossResult,
    ModelLoader,
    SyntheticTokenSource,
    TokenBatch,
    Trainer,
    TrainerConfig,
    build_trainer,
)
from d9d.core.lr import PiecewiseScheduleConfig, build_lr_scheduler
from d9d.core.lr.config import RestPhaseConfig, StepsPhaseConfig
from d9d.core.optim import AdamWConfig, build_optimizer
from d9d.kernels.attention import EagerAttentionConfig
from d9d.kernels.grouped_mm import EagerGroupedMmConfig
from d9d.metrics.trackers import JsonlTracker
from d9d.models import DecoderConfig, materialize_
from d9d.models.blocks.moe import moe_bias_balancer
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    Qwen3MoeForCausalLM,
    parallelize_qwen3_dense,
    parallelize_qwen3_moe,
    qwen3_dense_parameters_from_hf,
    qwen3_moe_parameters_from_hf,
)
from d9d.parallel import FsdpConfig, HsdpConfig, clip_grad_norm_

VOCAB = 96
SEQ = 12
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


BIAS_RATE = 1e-2


def build_tiny(family: str) -> nn.Module:
    """The tiny model on the meta device: `dense`, `moe`, or `moe_bias` (sigmoid routing with a balancing bias)."""
    with torch.device("meta"):
        if family == "moe":
            return Qwen3MoeForCausalLM(qwen3_moe_parameters_from_hf(MOE_HF), config=EAGER)
        if family == "moe_bias":
            params = qwen3_moe_parameters_from_hf(MOE_HF).model_copy(
                update={"router_scoring": "sigmoid", "router_expert_bias": True}
            )
            return Qwen3MoeForCausalLM(params, config=EAGER)
        return Qwen3DenseForCausalLM(qwen3_dense_parameters_from_hf(DENSE_HF), config=EAGER)


class CausalLMTask:
    """Labels are already shifted; the model returns per-token losses (0 where ignored)."""

    def count_tokens(self, batch: TokenBatch) -> int:
        return int((batch.labels != -100).sum())

    def compute_loss(self, model: nn.Module, batch: TokenBatch) -> LossResult:
        device = next(model.parameters()).device  # the synthetic source yields CPU tensors
        return LossResult(loss_sum=model(batch.input_ids.to(device), labels=batch.labels.to(device)).losses.sum())

    def count_bytes(self, batch: TokenBatch) -> int:
        return 4 * self.count_tokens(batch)  # pretend every token is 4 bytes of text


@dataclass(frozen=True)
class TinyModelProvider:
    family: str
    parallel: str  # none | fsdp | hsdp

    def __call__(self, ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
        model = build_tiny(self.family)
        parallelize = parallelize_qwen3_dense if self.family == "dense" else parallelize_qwen3_moe
        match self.parallel:
            case "fsdp":
                sync = parallelize(model, ctx, FsdpConfig())
            case "hsdp":
                sync = parallelize(model, ctx, HsdpConfig())
            case "none":
                from d9d.core.loop import NoGradientSync

                sync = NoGradientSync()
            case other:
                raise ValueError(f"parallel={other!r}; valid: none, fsdp, hsdp")
        materialize_(model, ctx.device)
        if loader is not None:
            loader(model)
        balancer = moe_bias_balancer(model, BIAS_RATE) if self.family == "moe_bias" else None
        return BuiltModel(model=model, gradient_sync=sync, subscribers=(balancer,) if balancer else ())


def optimizer_provider(model: nn.Module) -> Optimizer:
    return build_optimizer(OPTIMIZER, model.parameters())


def lr_provider(optimizer: Optimizer, total_steps: int) -> LRScheduler:
    return build_lr_scheduler(SCHEDULE, optimizer, total_steps)


def data_provider_for(global_rows: int, microbatch_rows: int, seed: int = 5):
    def provide(ctx: DistributedContext, microbatches_per_step: int) -> SyntheticTokenSource:
        coordinate = ctx.coordinate(MeshDomain.BATCH)
        layout = ctx.layout_for(MeshDomain.BATCH)
        dp_size = layout.shape[layout.dim_names.index("dp")]
        return SyntheticTokenSource(
            seed=seed,
            global_rows=global_rows,
            microbatch_rows=microbatch_rows,
            seq_len=SEQ,
            vocab_size=VOCAB,
            dp_rank=coordinate["dp"],
            dp_size=dp_size,
            ignore_fraction=0.3,  # ranks and micro-batches hold different numbers of counted tokens
        )

    return provide


def build_tiny_trainer(
    ctx: DistributedContext,
    *,
    family: str,
    parallel: str,
    total_steps: int,
    global_rows: int = 8,
    microbatch_rows: int = 1,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int | None = None,
    tracker_dir: Path | None = None,
    events: EventBus | None = None,
    validation_every: int | None = None,
) -> Trainer[TokenBatch]:
    config = TrainerConfig(
        total_steps=total_steps,
        global_batch_rows=global_rows,
        microbatch_rows=microbatch_rows,
        max_grad_norm=0.5,
        seed=3,
        validation_every=validation_every,
        validation_steps=2,
        checkpointing=(
            CheckpointingConfig(directory=checkpoint_dir, every_steps=checkpoint_every, keep_last=2)
            if checkpoint_dir is not None
            else None
        ),
    )
    return build_trainer(
        ctx,
        config,
        model_provider=TinyModelProvider(family, parallel),
        task=CausalLMTask(),
        data_provider=data_provider_for(global_rows, microbatch_rows),
        validation_provider=data_provider_for(global_rows, microbatch_rows, seed=999) if validation_every else None,
        optimizer_provider=optimizer_provider,
        lr_scheduler_provider=lr_provider,
        clipper=clip_grad_norm_,
        tracker=JsonlTracker(tracker_dir, enabled=ctx.is_main_process) if tracker_dir is not None else None,
        events=events,
    )


def reference_losses(family: str, *, total_steps: int, global_rows: int = 8, device: str = "cpu") -> list[float]:
    """Single-process training on the whole global batch at once: no Trainer, no accumulation, one process.

    On `cuda` the weights come from the CUDA generator, as a Trainer's ranks on CUDA draw them."""
    from d9d.core.determinism import seed_everything
    from d9d.core.loop import synthetic_global_batch

    model = build_tiny(family)
    seed_everything(3)
    materialize_(model, device)
    optimizer = optimizer_provider(model)
    scheduler = lr_provider(optimizer, total_steps)
    balancer = moe_bias_balancer(model, BIAS_RATE) if family == "moe_bias" else None
    losses = []
    for step in range(total_steps):
        batch = synthetic_global_batch(
            seed=5, step=step, rows=global_rows, seq_len=SEQ, vocab_size=VOCAB, ignore_fraction=0.3
        )
        optimizer.zero_grad(set_to_none=True)
        count = (batch.labels != -100).sum()
        loss = model(batch.input_ids.to(device), labels=batch.labels.to(device)).losses.sum() / count.to(device)
        loss.backward()
        if balancer is not None:
            balancer.balance(ForwardBackwardFinished(step=step + 1, num_microbatches=1))  # one process: no reduce
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return losses
