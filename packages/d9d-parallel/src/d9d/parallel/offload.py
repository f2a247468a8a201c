"""CPU offload of FSDP/HSDP units: parameter shards, their gradients and the optimizer state in host memory.

With FSDP2's `CPUOffloadPolicy` a unit keeps its sharded parameters in CPU memory (pinned when the mesh is on an
accelerator). Forward and backward copy each shard to the device just before its all-gather; the reduce-scattered
gradient is copied back to the CPU, so the optimizer sees CPU parameters with CPU gradients, keeps its state beside
them and runs its step on the CPU. The device holds only the unsharded parameters of the units in use and the
activations: the memory of the fp32 shards, gradients and two AdamW moments moves to the host, at the price of the
copies and a CPU optimizer step.

The rest of a program must follow three rules, and this module has a helper for each that needs one:

- a model built on the meta device is materialised with the offloaded units' parameters on the CPU and every
  buffer on the device (`to_empty_`; `d9d.models.materialize_` calls it), since FSDP refuses offloaded parameters
  anywhere but on the CPU;
- inputs go to the device the model computes on, which is no longer its parameters' device (`compute_device`);
- the optimizer step runs on CPU tensors: `torch.optim.AdamW(fused=True)` has a CPU kernel (its default for CPU
  tensors is the slow per-tensor loop), `StochasticAdamW` runs its PyTorch path, and a CUDA-only fused step (d9d-
  kernels' Triton stochastic AdamW) cannot run.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor

_ATTRIBUTE = "_d9d_cpu_offload"


def cpu_offload_policy(mesh: DeviceMesh) -> CPUOffloadPolicy:
    """FSDP2's policy for `mesh`: shards pinned when the mesh is on an accelerator (faster copies that overlap with
    compute); on a CPU mesh there is no device to copy to, and pinning would need an accelerator."""
    return CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")


def mark_cpu_offloaded(unit: nn.Module) -> None:
    """Record that `unit` (an FSDP unit) keeps its parameters in CPU memory. The record lives on the module: methods
    such as `to_empty` replace parameter contents in place, while the module stays."""
    unit.__dict__[_ATTRIBUTE] = True


def is_cpu_offloaded(unit: nn.Module) -> bool:
    """Whether `unit` was sharded with CPU offload by `parallelize_fsdp` / `parallelize_hsdp`."""
    return bool(unit.__dict__.get(_ATTRIBUTE, False))


def offloaded_modules(module: nn.Module) -> list[nn.Module]:
    """The modules under (and including) `module` whose own parameters live in CPU memory: those inside a
    CPU-offloaded FSDP unit, up to (not into) a nested unit that is not offloaded."""
    found: list[nn.Module] = []

    def visit(current: nn.Module, *, inherited: bool) -> None:
        offloaded = is_cpu_offloaded(current) if isinstance(current, FSDPModule) else inherited
        if offloaded:
            found.append(current)
        for child in current.children():
            visit(child, inherited=offloaded)

    visit(module, inherited=False)
    return found


def to_empty_(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module.to_empty(device=device)`, except that the parameters of CPU-offloaded FSDP units get CPU storage
    (their buffers still go to `device`, where the module computes); returns `module`. Values are uninitialised."""
    offloaded = {id(sub) for sub in offloaded_modules(module)}
    if not offloaded:
        return module.to_empty(device=device)
    for sub in module.modules():
        if id(sub) not in offloaded:
            sub.to_empty(device=device, recurse=False)
            continue
        sub.to_empty(device="cpu", recurse=False)
        for name, buffer in sub._buffers.items():
            if buffer is not None:  # FSDP leaves buffers alone: the forward reads them on the device
                sub._buffers[name] = buffer.to(device)
    return module


def compute_device(module: nn.Module) -> torch.device:
    """The device `module` computes on, where its inputs belong: its parameters' device, or for CPU-offloaded FSDP
    parameters (CPU shards of an accelerator mesh) the mesh's device.

    Raises:
        ValueError: `module` has no parameters to tell the device by.
    """
    param = next(module.parameters(), None)
    if param is None:
        raise ValueError(f"{type(module).__name__} has no parameters to tell its compute device by")
    if isinstance(param, DTensor) and param.device.type == "cpu" and param.device_mesh.device_type != "cpu":
        device_type = param.device_mesh.device_type
        return torch.device(device_type, torch.get_device_module(device_type).current_device())
    return param.device
