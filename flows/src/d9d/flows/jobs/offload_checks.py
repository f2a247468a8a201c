"""CPU offload in the stages (`data_parallel.offload=true`, d9d.parallel.offload): the preflight of what it cannot run
with, refused before any rank starts naming the fields, their values and the fix; and the optimizer it runs."""

from __future__ import annotations

from d9d.core.dist import MeshDegrees
from d9d.core.optim import AdamWConfig, AnyOptimizerConfig, StochasticAdamWConfig
from d9d.flows.jobs.stage_spec import PreflightError
from d9d.parallel import AnyDataParallelConfig, FsdpConfig, HsdpConfig


def offloads(config: AnyDataParallelConfig) -> bool:
    return isinstance(config, FsdpConfig | HsdpConfig) and config.offload


def check_training_offload(
    section: str, config: AnyDataParallelConfig, degrees: MeshDegrees, optimizer: AnyOptimizerConfig
) -> None:
    """A training stage's offload: no pipeline stages (untested there) and no CUDA-only fused optimizer step.

    Raises:
        PreflightError: naming the fields, their values and what would be valid.
    """
    if not offloads(config):
        return
    if degrees.pp > 1:
        raise PreflightError(
            f"{section}.data_parallel.offload=true with {section}.degrees.pp={degrees.pp} is not supported yet: no "
            "parity test covers CPU-offloaded FSDP units under a pipeline schedule (d9d-pipeline drives their "
            f"gradient reductions itself); set {section}.data_parallel.offload=false or {section}.degrees.pp=1"
        )
    if isinstance(optimizer, StochasticAdamWConfig) and optimizer.fused:
        raise PreflightError(
            f"{section}.optimizer.fused=true (kind=stochastic_adamw) runs d9d-kernels' Triton step on CUDA tensors, "
            f"but {section}.data_parallel.offload=true keeps the parameters, gradients and optimizer state in CPU "
            f"memory, where the step runs; set {section}.optimizer.fused=false (its PyTorch step runs on the CPU)"
        )


def check_evaluation_offload(section: str, config: AnyDataParallelConfig) -> None:
    """Evaluation has no gradients or optimizer state to offload, and its generation feeds the parameters' device.

    Raises:
        PreflightError: `offload=true` in an evaluation section.
    """
    if offloads(config):
        raise PreflightError(
            f"{section}.data_parallel.offload=true: offload moves gradients and optimizer state to CPU memory, and "
            f"evaluation has neither (its parameters would only be copied in for every forward); set "
            f"{section}.data_parallel.offload=false"
        )


def offloaded_optimizer(optimizer: AnyOptimizerConfig, config: AnyDataParallelConfig) -> AnyOptimizerConfig:
    """The optimizer a rank builds: under offload, AdamW with `fused` unset takes PyTorch's fused CPU kernel (unset,
    PyTorch runs its per-tensor loop on CPU tensors, several times slower); an explicit `fused` is kept."""
    if offloads(config) and isinstance(optimizer, AdamWConfig) and optimizer.fused is None and not optimizer.foreach:
        return optimizer.model_copy(update={"fused": True})
    return optimizer
