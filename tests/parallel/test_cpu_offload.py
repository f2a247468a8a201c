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

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pydantic import TypeAdapter, ValidationError
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
    ModelLoader,
    StepFinished,
    StepStarted,
    TrainerConfig,
    build_trainer,
)
from d9d.core.optim import AdamWConfig, StochasticAdamWConfig, build_optimizer
from d9d.models import materialize_
from d9d.models.qwen3 import parallelize_qwen3_dense, parallelize_qwen3_moe
from d9d.parallel import (
    AnyDataParallelConfig,
    FsdpConfig,
    HsdpConfig,
    MixedPrecisionConfig,
    cast_parameters_,
    clip_grad_norm_,
    compute_device,
    offloaded_modules,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:Slicing a flattened dim:UserWarning"),
]

STEPS = 6
BF16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")


def _full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().float().clone()
        for name, param in model.named_parameters()
    }


def _offloaded_units(model: nn.Module) -> tuple[int, int]:
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
        self.model, self.initial = model, _full_parameters(model)
        return BuiltModel(model=model, gradient_sync=sync)


def _optimizer_provider(bf16: bool) -> Callable[[nn.Module], Optimizer]:
    def provide(model: nn.Module) -> Optimizer:
        if bf16:
            return build_optimizer(StochasticAdamWConfig(lr=3e-3, weight_decay=0.01, seed=4), model.parameters())
        return build_optimizer(AdamWConfig(lr=3e-3, weight_decay=0.01, fused=True), model.parameters())  # CPU kernel

    return provide


def _train(
    config: AnyDataParallelConfig,
    *,
    family: str = "dense",
    degrees: MeshDegrees | None = None,
    bf16: bool = False,
    steps: int = STEPS,
    checkpoint_dir: Path | None = None,
    preempt_at: int | None = None,
) -> dict[str, Any]:
    """Train on this rank's share of the job; returns per-step losses and norms, final full parameters, and where the
    parameters, gradients and optimizer state lived."""
    ctx = DistributedContext.build(degrees or MeshDegrees(dp_shard=-1), device="cpu")
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
        ctx, trainer_config, model_provider=provider, task=CausalLMTask(), data_provider=data_provider_for(8, 2),
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
        "params": _full_parameters(model),
        "moved": max(
            (_full_parameters(model)[name] - value).abs().max().item() for name, value in provider.initial.items()
        ),
        "units": _offloaded_units(model),
        "offloaded_modules": len(offloaded_modules(model)),
        "state_devices": {value.device.type for value in optimizer_state if isinstance(value, torch.Tensor)},
        "compute_device": compute_device(model),
    }
    ctx.close()
    return run


def _assert_same_training(offloaded: dict[str, Any], reference: dict[str, Any]) -> None:
    # Exact: the arithmetic is the same on a CPU mesh (module docstring); a difference is a bug, not rounding.
    assert offloaded["losses"] == reference["losses"]
    assert offloaded["norms"] == reference["norms"]
    for name, value in reference["params"].items():
        torch.testing.assert_close(offloaded["params"][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32-adamw", "bf16-stochastic-adamw"])
@pytest.mark.distributed(world_size=2, timeout=300)
def test_offloaded_fsdp_trains_exactly_like_fsdp(bf16):
    precision = BF16 if bf16 else None
    reference = _train(FsdpConfig(mixed_precision=precision), bf16=bf16)
    offloaded = _train(FsdpConfig(mixed_precision=precision, offload=True), bf16=bf16)
    units, with_policy = offloaded["units"]
    assert units == 5 and with_policy == units  # 2 layers, embedding, head and the root: every unit offloads
    assert reference["units"] == (5, 0) and reference["offloaded_modules"] == 0
    assert offloaded["state_devices"] == {"cpu"}
    assert offloaded["compute_device"] == torch.device("cpu")  # a CPU mesh computes on the CPU
    _assert_same_training(offloaded, reference)
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
    run = _train(config, family=family, degrees=degrees, steps=4)
    units, with_policy = run["units"]
    assert units == expected_units and with_policy == units, run["units"]
    assert run["state_devices"] == {"cpu"}
    assert all(torch.isfinite(torch.tensor(list(run["losses"].values()))))


def _resume(first: bool, second: bool, directory: Path) -> dict[str, Any]:
    before = _train(FsdpConfig(offload=first), checkpoint_dir=directory, preempt_at=3)
    assert before["resumed_from"] is None
    after = _train(FsdpConfig(offload=second), checkpoint_dir=directory)
    assert after["resumed_from"] is not None and after["resumed_from"].name.endswith("3"), after["resumed_from"]
    return {**after, "losses": before["losses"] | after["losses"], "norms": before["norms"] | after["norms"]}


@pytest.mark.parametrize(("first", "second"), [(False, True), (True, False)], ids=["on-resume", "off-resume"])
@pytest.mark.distributed(world_size=2, timeout=300)
def test_job_checkpoint_resumes_across_offload(first, second, tmp_path):
    # Preempted (SIGTERM) at step 3 and checkpointed, resumed with offload switched; against the uninterrupted run.
    directory = tmp_path / f"checkpoints-{first}-{second}"  # one path for every rank: ranks fork from the test
    reference = _train(FsdpConfig())
    resumed = _resume(first, second, directory)
    _assert_same_training(resumed, reference)
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
