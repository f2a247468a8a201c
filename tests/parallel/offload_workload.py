"""The CPU-offload workload: the tiny Qwen3 of the loop tests through the Trainer with a given data-parallel config,
reporting what the offload tests compare (losses, gradient norms, final parameters) and check (where FSDP keeps the
parameters, where the optimizer state lives, which device the model computes on).

Imported by test_cpu_offload.py (gloo) and test_gpu_cpu_offload.py (CUDA); pytest puts this directory on sys.path.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

sys.path.insert(0, str(Path(__file__).parents[1] / "core" / "loop"))  # the Trainer workload of the loop tests
from loop_workload import CausalLMTask, build_tiny, data_provider_for, lr_provider

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import (
    BuiltModel,
    CheckpointingConfig,
    EventBus,
    LossResult,
    ModelLoader,
    StepFinished,
    StepStarted,
    TokenBatch,
    TrainerConfig,
    build_trainer,
)
from d9d.core.optim import AdamWConfig, StochasticAdamWConfig, build_optimizer
from d9d.models import materialize_
from d9d.models.qwen3 import parallelize_qwen3_dense, parallelize_qwen3_moe
from d9d.parallel import (
    AnyDataParallelConfig,
    FsdpConfig,
    MixedPrecisionConfig,
    cast_parameters_,
    clip_grad_norm_,
    compute_device,
    offloaded_modules,
)


class ComputeDeviceTask(CausalLMTask):
    """The loop tests' task with inputs on the device the model computes on: under CPU offload on a GPU the parameters
    are on the CPU, the computation is not."""

    def compute_loss(self, model: nn.Module, batch: TokenBatch) -> LossResult:
        device = compute_device(model)
        return LossResult(loss_sum=model(batch.input_ids.to(device), labels=batch.labels.to(device)).losses.sum())


STEPS = 6
BF16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().float().cpu().clone()
        for name, param in model.named_parameters()
    }


def offloaded_units(model: nn.Module) -> tuple[int, int]:
    """(FSDP units, of which FSDP itself runs with a CPU offload policy): FSDP's own state, not d9d's record of it."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    policies = [fully_shard.state(unit)._fsdp_param_group.offload_policy for unit in units]  # type: ignore[attr-defined]
    return len(units), sum(isinstance(policy, CPUOffloadPolicy) for policy in policies)


class _Provider:
    def __init__(self, family: str, config: AnyDataParallelConfig, *, bf16: bool) -> None:
        self.family, self.config, self.bf16 = family, config, bf16
        self.model: nn.Module | None = None
        self.initial: dict[str, torch.Tensor] = {}

    def __call__(self, ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
        model = build_tiny(self.family)
        if self.bf16:
            cast_parameters_(model, torch.bfloat16)  # stored in bf16: no master copy, StochasticAdamW
        parallelize = parallelize_qwen3_dense if self.family == "dense" else parallelize_qwen3_moe
        sync = parallelize(model, ctx, self.config)
        materialize_(model, ctx.device)
        self.model, self.initial = model, full_parameters(model)
        return BuiltModel(model=model, gradient_sync=sync)


def _optimizer_provider(bf16: bool) -> Callable[[nn.Module], Optimizer]:
    def provide(model: nn.Module) -> Optimizer:
        if bf16:
            return build_optimizer(StochasticAdamWConfig(lr=3e-3, weight_decay=0.01, seed=4), model.parameters())
        return build_optimizer(AdamWConfig(lr=3e-3, weight_decay=0.01, fused=True), model.parameters())  # CPU kernel

    return provide


_context_numbers = itertools.count()  # the contexts this rank built so far


def _next_master_port() -> None:
    """Rendezvous each of a rank's successive contexts on its own port (the harness's port + the count so far; every
    rank builds them in the same order). On NCCL ranks the GPU test hung or failed at the second context's first
    all-gather (rank 1: "connect to <rank 0> refused", in NCCL's bootstrap), as if rank 1 had read the first
    context's NCCL id from rank 0's first store server, which lives on while anything (a DeviceMesh held by a
    not-yet-collected model) references the old group. Suspected, not yet confirmed on a GPU (docs/testing.md)."""
    base = int(os.environ.setdefault("D9D_TEST_BASE_MASTER_PORT", os.environ["MASTER_PORT"]))
    os.environ["MASTER_PORT"] = str(base + next(_context_numbers))


def train(
    config: AnyDataParallelConfig,
    *,
    family: str = "dense",
    degrees: MeshDegrees | None = None,
    bf16: bool = False,
    steps: int = STEPS,
    checkpoint_dir: Path | None = None,
    preempt_at: int | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Train on this rank's share of the job; returns per-step losses and norms, final full parameters, and where the
    parameters, gradients and optimizer state lived."""
    if device == "cuda":
        _next_master_port()
    ctx = DistributedContext.build(degrees or MeshDegrees(dp_shard=-1), device=device)
    events, norms = EventBus(), {}
    events.subscribe(StepFinished, lambda event: norms.__setitem__(event.step, event.metrics["grad_norm"]))
    if preempt_at is not None:
        events.subscribe(
            StepStarted, lambda event: os.kill(os.getpid(), signal.SIGTERM) if event.step == preempt_at else None
        )
    provider = _Provider(family, config, bf16=bf16)
    trainer_config = TrainerConfig(
        total_steps=steps,
        global_batch_rows=8,
        microbatch_rows=2,  # two micro-batches per rank: gradients accumulate (on the CPU under offload)
        max_grad_norm=0.5,
        seed=3,
        checkpointing=CheckpointingConfig(directory=checkpoint_dir, every_steps=100, keep_last=2)
        if checkpoint_dir is not None
        else None,
    )
    trainer = build_trainer(
        ctx, trainer_config, model_provider=provider, task=ComputeDeviceTask(), data_provider=data_provider_for(8, 2),
        optimizer_provider=_optimizer_provider(bf16), lr_scheduler_provider=lr_provider, clipper=clip_grad_norm_,
        events=events,
    )  # fmt: skip
    result = trainer.train()
    model = provider.model
    assert model is not None
    optimizer_state = [value for state in trainer.parts.optimizer.state.values() for value in state.values()]
    run = {
        "losses": result.losses,
        "norms": norms,
        "resumed_from": result.resumed_from,
        "params": full_parameters(model),
        "moved": max(
            (full_parameters(model)[name] - value).abs().max().item() for name, value in provider.initial.items()
        ),
        "units": offloaded_units(model),
        "offloaded_modules": len(offloaded_modules(model)),
        "state_devices": {value.device.type for value in optimizer_state if isinstance(value, torch.Tensor)},
        "compute_device": compute_device(model),
    }
    ctx.close()
    return run


def assert_same_training(
    offloaded: dict[str, Any], reference: dict[str, Any], *, rtol: float = 0.0, atol: float = 0.0
) -> None:
    """Losses and gradient norms within `rtol`, final parameters within `rtol` and `atol` (0: bit for bit)."""
    steps = sorted(reference["losses"])
    assert sorted(offloaded["losses"]) == steps
    for key in ("losses", "norms"):
        values, expected = [offloaded[key][step] for step in steps], [reference[key][step] for step in steps]
        torch.testing.assert_close(values, expected, rtol=rtol, atol=0, msg=key)
    for name, value in reference["params"].items():
        torch.testing.assert_close(offloaded["params"][name], value, rtol=rtol, atol=atol, msg=name)


def resume(first: bool, second: bool, directory: Path, *, device: str = "cpu", preempt_at: int = 3) -> dict[str, Any]:
    """Train with `offload=first` until preempted (SIGTERM, as a scheduler does) at `preempt_at`, which checkpoints;
    resume with `offload=second` to the end. Returns the second run's report with both runs' losses and norms."""
    before = train(FsdpConfig(offload=first), checkpoint_dir=directory, preempt_at=preempt_at, device=device)
    assert before["resumed_from"] is None
    after = train(FsdpConfig(offload=second), checkpoint_dir=directory, device=device)
    assert after["resumed_from"] is not None and after["resumed_from"].name.endswith(str(preempt_at))
    return {**after, "losses": before["losses"] | after["losses"], "norms": before["norms"] | after["norms"]}
