"""Expert parallelism against FSDP-only on the MoE anchor (bench/anchor_models.py), N ranks, same per-GPU batch.

Each mode trains the MoE anchor (hidden 1024, 8 MoE layers, 64 experts top-8, expert FFN 768, batch 2 x 4096 per
GPU) with FSDP (bf16 compute, fp32 reduce, fp32 master weights, AdamW, clipping at 1.0) on every rank:

- `fsdp`: `ep=1`, experts FSDP-sharded and all-gathered like every other parameter;
- `ep`: `ep=N` with the all-to-all dispatcher (experts `Shard(0)` over the ranks, tokens exchanged);
- `ep_capacity`: `ep=N` with the static-capacity all-to-all (`all_to_all_capacity`, design 0029): fixed
  `C = round_up(ceil(--capacity-factor * T * k / N), 16)` rows per rank pair, no host sync; its row also prints the
  share of routed copies dropped over capacity;
- `ep_tokens`: `ep=N` with the token-level static-capacity all-to-all (`all_to_all_tokens`, design 0031): each token
  sent once per destination rank and returned as one weighted row, `T` token rows per rank pair (never drops), and
  `--copy-capacity-factor` x `T * k` expert rows per rank; no host sync;
- `deep_ep`: `ep=N` with DeepEP's normal mode (skipped, with the reason, when `deep_ep` does not import).

`--dense-layouts` picks how the expert-parallel modes shard the dense domain (embedding, attention, router, norms,
LM head), each listed layout a row of its own:

- `layers` (default): an FSDP unit per decoder layer, embedding and LM head, resharded after forward: an all-gather
  per layer in forward and again in backward, a reduce-scatter per layer in backward. Under EP these per-layer
  collectives sit between the token exchanges and lock the ranks' backward together (FSDP makes the compute stream
  wait for the previous unit's reduce-scatter at each unit's post-backward, and that reduce-scatter waits for the
  slowest rank);
- `whole`: two FSDP units (the decoder stack `model`, and the LM head with the root), not resharded after forward:
  one all-gather per unit per step and one reduce-scatter per unit at the end of its backward, nothing per layer.
  The dense parameters of the MoE anchor are 0.36 B (0.31 B of them the embedding and the LM head), so holding them
  unsharded costs 0.7 GiB of bf16. The root's reduce-scatter (the LM head's float32 gradient, 0.6 GB) runs after
  the whole backward, exposed (design 0025: 6 ms of the ep=4 step's tail on 4 x H200);
- `split`: `whole` with the LM head a unit of its own: its post-backward fires right after its backward (the first
  of the step), so its reduce-scatter overlaps the decoder layers' backward; only the decoder stack's (embedding and
  layers) stays at the end. Same unsharded memory as `whole`;
- `replicate`: no FSDP: the dense parameters replicated on every rank (bucketed float32 all-reduce overlapped with
  backward), the experts each on one rank (`ep` = the data ranks, as `dp_replicate`); the layout a CUDA-graphed step
  needs, since FSDP frees and re-allocates its unsharded parameters every step (design 0031). For `fsdp` (ep=1)
  every parameter, experts included, is replicated: plain data parallelism;
- `single` (ep=1 on one GPU): no data parallelism at all (`SingleDeviceConfig`), the 1-GPU figure without FSDP's
  per-layer copies and hooks;
- `kept`: `layers` (a unit per decoder layer, embedding and LM head) not resharded after forward: no all-gather in
  backward, each layer's reduce-scatter overlapping the next layers' backward, only the embedding's at the end; the
  per-layer FSDP hooks come back into the host-bound forward. Same unsharded memory as `whole`.

Every mode uses the same optimizer (`--optimizer`): by default `StochasticAdamW(fused=True)` with d9d-kernels'
multi-tensor Triton step (float32 parameters, so exactly AdamW's update; one launch per bucket rather than a dozen
per parameter); `torch` is `torch.optim.AdamW(foreach=False)`, the per-parameter loop of the first measurements.

`--cuda-graph` replays each step's forward, backward and gradient synchronisation as one CUDA graph
(`d9d.core.loop.CudaGraphedStep`, captured in the first timed warm-up step after two eager runs); clipping and the
optimizer stay eager. It needs a step with no host sync and static addresses: `ep_capacity` or `ep_tokens` with the
`replicate` layout, or `fsdp` with `single` or `replicate` (`--fsdp-layouts`). Rows are labelled `-graphed`.

`--compile-layers` compiles every decoder layer's forward (`DecoderConfig.compile_layers`, Inductor on CUDA, `aot_eager`
on CPU, where the smoke run checks the wiring, not speed) in every mode, the `fsdp` baseline and the 1-GPU row included,
so compiled rows compare with compiled rows. Under EP each MoE layer's dispatch, local experts and combine stay eager
(one graph break per layer: the exchange's split sizes are host lists, which compiled code would guard on; design 0025,
third round), so the compiled regions are the norms, attention, router and residuals; under `ep_capacity` the exchange
has static shapes and no host copy, so it is traced inside the layers (design 0029). Compilation happens in the first
warm-up step, so keep `--warmup` at 3 or more (steps 2 and 3 then run warm); rows are labelled `-compiled`, and the
compiled graphs are dropped between rows. `--kernels loss` swaps the small Triton kernels (RMSNorm, SwiGLU, RoPE, MoE
permutation) for their eager references, which Inductor fuses with their neighbours, keeping the Triton fused loss (as
`bench/trainer_step.py --kernels loss`, which beat the Triton kernels under whole-model compile in the single-GPU
ablation, docs/benchmarks.md); `auto` (default) is detection.

Per mode: after `--warmup` steps, `--steps` steps are timed (CUDA synchronised) and the row is printed at once (the
slowest rank's median as tokens/s per GPU, the peak allocated memory of the most loaded rank). Only then do
`--profile-steps` more steps run under `torch.profiler` (skipped when `--budget-seconds` would not leave room for
them), and a per-phase breakdown follows the row: the device time per step of each kernel family (all-to-all,
FSDP collectives, grouped GEMM, dense GEMM, attention, row gathers/sorts, the rest) on the slowest rank, and the
host time in the `moe.dispatch` / `moe.combine` ranges (which includes the split-size sync). A run killed by its
time limit thus keeps every row timed so far. `--trace-dir` writes rank 0's gzipped Chrome trace per mode.

    torchrun --nproc_per_node 4 bench/expert_parallel.py                       # fsdp, ep, deep_ep on 4 GPUs
    torchrun --nproc_per_node 2 bench/expert_parallel.py --modes fsdp ep
    torchrun --nproc_per_node 2 bench/expert_parallel.py --modes fsdp ep ep_capacity --capacity-factor 2.0
    torchrun --nproc_per_node 1 bench/expert_parallel.py --modes fsdp          # the 1-GPU per-GPU figure
    torchrun --nproc_per_node 4 bench/expert_parallel.py --modes ep --dense-layouts layers whole
    torchrun --nproc_per_node 4 bench/expert_parallel.py --modes fsdp ep --dense-layouts whole --compile-layers
    torchrun --nproc_per_node 2 bench/expert_parallel.py --tiny --device cpu   # seconds-long gloo smoke run
    torchrun --nproc_per_node 2 bench/expert_parallel.py --tiny --device cpu --compile-layers --modes fsdp ep
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import importlib.util
import json
import os
import platform
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from anchor_models import MOE, MOE_BATCH, tiny
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import CudaGraphedStep
from d9d.core.optim import StochasticAdamW
from d9d.kernels.expert_dispatch import (
    AllToAllCapacityDispatchConfig,
    AllToAllCapacityDispatcher,
    AllToAllDispatchConfig,
    AllToAllDispatcher,
    AllToAllTokenCapacityDispatcher,
    AllToAllTokensDispatchConfig,
    AnyExpertDispatchConfig,
    DeepEpDispatchConfig,
)
from d9d.kernels.grouped_mm import GROUPED_MM_CONFIG_ADAPTER
from d9d.models import DecoderConfig, Role, materialize_
from d9d.models.qwen3 import Qwen3MoeForCausalLM, Qwen3MoeParameters, parallelize_qwen3_moe
from d9d.parallel import (
    AnyDataParallelConfig,
    FsdpConfig,
    MixedPrecisionConfig,
    ReplicateConfig,
    SingleDeviceConfig,
    clip_grad_norm_,
)

DISPATCH_RANGES = ("moe.dispatch", "moe.combine")
# Backward of the token exchange: the autograd nodes of the all-to-all and DeepEP functions.
BACKWARD_NODES = (
    "_AllToAllBackward",
    "_DispatchBackward",
    "_CombineBackward",
    "_GatherToSlotsBackward",
    "_TokensToSlotsBackward",
    "_SumFromSlotsBackward",
)
# Kernel families by (lower-case) kernel name, first match wins; device time per step of each is reported.
KERNEL_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("a2a", ("sendrecv", "alltoall", "all_to_all", "deep_ep", "intranode")),
    ("fsdp-coll", ("allgather", "reducescatter", "allreduce", "broadcast")),
    ("grouped-gemm", ("group",)),
    ("attn", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "matmul")),
    ("gather/sort", ("index", "gather", "scatter", "sort", "radix", "cumsum", "scan")),
)
# A profile costs about this many timed steps of host work (trace post-processing) on top of its own steps.
PROFILE_OVERHEAD_STEPS = 20
PROFILE_OVERHEAD_SECONDS = 10.0


DENSE_LAYOUTS = ("layers", "whole", "split", "kept", "replicate", "single")
# `whole`: the decoder stack (`model`: embedding, layers, final norm) is one unit, the root (LM head) the other.
WHOLE_DENSE_UNITS = ["model"]


@dataclass(frozen=True)
class Result:
    mode: str
    world_size: int
    ep: int
    tokens_per_gpu_step: int
    median_seconds: float
    tokens_per_second_per_gpu: float
    peak_gib: float


@dataclass(frozen=True)
class Breakdown:
    """Per step, on the slowest rank: host seconds in dispatch/combine and device seconds per kernel family."""

    mode: str
    dispatch_combine_host_seconds: float
    device_seconds: dict[str, float]


MODES = ("fsdp", "ep", "ep_capacity", "ep_tokens", "deep_ep")


def dispatch_config(
    mode: str, capacity_factor: float = 2.0, copy_capacity_factor: float = 2.0
) -> AnyExpertDispatchConfig | None:
    match mode:
        case "fsdp":
            return None
        case "ep":
            return AllToAllDispatchConfig()
        case "ep_capacity":
            return AllToAllCapacityDispatchConfig(capacity_factor=capacity_factor)
        case "ep_tokens":
            return AllToAllTokensDispatchConfig(copy_capacity_factor=copy_capacity_factor)
        case "deep_ep":
            return DeepEpDispatchConfig()
        case _:
            raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")


def data_parallel_config(layout: str, mixed: MixedPrecisionConfig | None) -> AnyDataParallelConfig:
    """The dense domain's data parallelism for `layout` (see the module docstring)."""
    match layout:
        case "replicate":
            return ReplicateConfig(mixed_precision=mixed)
        case "single":
            return SingleDeviceConfig(mixed_precision=mixed)
        case "layers":
            return FsdpConfig(mixed_precision=mixed)
        case "whole":
            return FsdpConfig(mixed_precision=mixed, units=WHOLE_DENSE_UNITS, reshard_after_forward=False)
        case "kept":  # the model's default units (decoder layers, embedding, LM head), kept unsharded
            return FsdpConfig(mixed_precision=mixed, reshard_after_forward=False)
        case "split":
            return FsdpConfig(
                mixed_precision=mixed,
                units=WHOLE_DENSE_UNITS,
                unit_roles=[str(Role.LM_HEAD)],
                reshard_after_forward=False,
            )
        case _:
            raise ValueError(f"unknown dense layout {layout!r}; valid: {', '.join(DENSE_LAYOUTS)}")


def build_optimizer(model: torch.nn.Module, kind: str, device: torch.device) -> torch.optim.Optimizer:
    """The same optimizer for every mode: d9d's multi-tensor AdamW step (`fused`), or PyTorch's per-parameter loop."""
    match kind:
        case "fused":
            fused = device.type == "cuda"  # the Triton step needs CUDA; on CPU the same update in PyTorch ops
            if fused:
                from d9d.kernels.adamw import register_triton_stochastic_adamw

                register_triton_stochastic_adamw()
            return StochasticAdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=fused)
        case "torch":
            # Per parameter: expert and dense parameters are DTensors on different meshes (no cross-mesh foreach).
            return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=False)
        case _:
            raise ValueError(f"unknown optimizer {kind!r}; valid: fused, torch")


def decoder_config(mode: str, args: argparse.Namespace, device: torch.device) -> DecoderConfig:
    """The model's run options: the mode's dispatch, `--grouped-mm`, `--kernels` and `--compile-layers`."""
    options: dict[str, object] = {
        "expert_dispatch": dispatch_config(mode, args.capacity_factor, args.copy_capacity_factor)
    }
    if args.grouped_mm:
        options["grouped_mm"] = GROUPED_MM_CONFIG_ADAPTER.validate_json(args.grouped_mm)
    if args.compile_layers:
        options |= {"compile_layers": True, "compile_backend": "inductor" if device.type == "cuda" else "aot_eager"}
    if args.kernels == "loss":
        from d9d.kernels.linear_cross_entropy import TritonLinearCrossEntropyConfig
        from d9d.kernels.moe_permute import EagerMoePermuteConfig
        from d9d.kernels.rms_norm import EagerRmsNormConfig
        from d9d.kernels.rope import EagerRopeConfig
        from d9d.kernels.swiglu import EagerSwiGluConfig

        options |= {"rms_norm": EagerRmsNormConfig(), "swiglu": EagerSwiGluConfig(), "rope": EagerRopeConfig()}
        options["moe_permute"] = EagerMoePermuteConfig()
        if device.type == "cuda":  # the Triton loss needs CUDA; on CPU detection picks the eager one anyway
            options["linear_cross_entropy"] = TritonLinearCrossEntropyConfig()
    return DecoderConfig.model_validate(options)


def mesh_degrees(layout: str, ep: int) -> MeshDegrees:
    """Data ranks as `dp_replicate` for the replicated layout (every expert on one rank), else as `dp_shard`."""
    if layout == "replicate":
        return MeshDegrees(dp_replicate=int(os.environ.get("WORLD_SIZE", "1")), ep=ep)
    return MeshDegrees(dp_shard=-1, ep=ep)


def build_step(
    mode: str, layout: str, ctx: DistributedContext, params: Qwen3MoeParameters, args: argparse.Namespace
) -> tuple[Callable[[], None], int, torch.nn.Module]:
    """The training step of `mode` on this rank, the tokens it trains on, and the model. With `--cuda-graph` the
    step's forward, backward and gradient synchronisation replay as one CUDA graph (`CudaGraphedStep`, captured in
    the first call); clipping and the optimizer stay eager."""
    device = ctx.device
    batch, seq = (2, 64) if args.tiny else MOE_BATCH
    config = decoder_config(mode, args, device)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(params, config=config)
    mixed = MixedPrecisionConfig() if device.type == "cuda" else None  # bf16 compute needs bf16 kernels
    sync = parallelize_qwen3_moe(model, ctx, data_parallel_config(layout, mixed))
    materialize_(model, device)
    optimizer = build_optimizer(model, args.optimizer, device)
    generator = torch.Generator(device=device).manual_seed(1 + ctx.rank)
    ids = torch.randint(0, params.vocab_size, (batch, seq), device=device, generator=generator)
    labels = torch.randint(0, params.vocab_size, (batch, seq), device=device, generator=generator)
    tokens = batch * seq

    def forward_backward() -> torch.Tensor:
        sync.begin_step(1)
        loss = model(ids, labels=labels).losses.sum() / (tokens * ctx.world_size)
        loss.backward()
        sync.wait()
        return loss.detach()

    replay = CudaGraphedStep(forward_backward, warmup=2) if args.cuda_graph else forward_backward

    def step() -> None:
        replay()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step, tokens, model


def routing_imbalance(model: torch.nn.Module, device: torch.device) -> list[float] | None:
    """Per MoE layer, max over ranks / mean over ranks of the rows its experts received (all-to-all modes only)."""
    layers = all_to_all_dispatchers(model)
    if not layers or not dist.is_initialized():
        return None
    received = torch.tensor([float(d.rows_received) for d in layers], device=device)
    gathered = [torch.empty_like(received) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, received)
    stacked = torch.stack(gathered)
    return (stacked.max(dim=0).values / stacked.mean(dim=0).clamp(min=1.0)).tolist()


AllToAllKinds = AllToAllDispatcher | AllToAllCapacityDispatcher | AllToAllTokenCapacityDispatcher
CapacityKinds = AllToAllCapacityDispatcher | AllToAllTokenCapacityDispatcher


def all_to_all_dispatchers(model: torch.nn.Module) -> list[AllToAllKinds]:
    found: list[AllToAllKinds] = []
    for module in model.modules():
        dispatcher = getattr(module, "dispatcher", None)
        if isinstance(dispatcher, AllToAllKinds):
            found.append(dispatcher)
    return found


def dropped_share(model: torch.nn.Module, device: torch.device) -> float | None:
    """Copies dropped over capacity / copies routed, over every rank, layer and step so far (capacity mode only);
    the counters are device tensors, read here once, after the timed steps."""
    layers = [d for d in all_to_all_dispatchers(model) if isinstance(d, CapacityKinds)]
    if not layers or not dist.is_initialized():
        return None
    dropped = torch.stack([d.dropped_copies for d in layers]).sum().double().to(device)
    sent = torch.stack([d.rows_received for d in layers]).sum().double().to(device)
    both = torch.stack([dropped, sent])
    dist.all_reduce(both)
    return float(both[0] / (both[0] + both[1]).clamp(min=1.0))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    mode: str, ctx: DistributedContext, step: Callable[[], None], tokens: int, args: argparse.Namespace
) -> Result:
    device = ctx.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    median, peak_max = slowest([statistics.median(times), peak], device)
    return Result(
        mode=mode,
        world_size=ctx.world_size,
        ep=ctx.degrees.ep,
        tokens_per_gpu_step=tokens,
        median_seconds=median,
        tokens_per_second_per_gpu=tokens / median,
        peak_gib=peak_max,
    )


def slowest(values: list[float], device: torch.device) -> list[float]:
    """The maximum of each value over the ranks."""
    on_device = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
    return [float(v) for v in on_device.tolist()]


def kernel_family(name: str) -> str:
    lowered = name.lower()
    for family, needles in KERNEL_FAMILIES:
        if any(needle in lowered for needle in needles):
            return family
    return "other"


def profile_steps(mode: str, ctx: DistributedContext, step: Callable[[], None], args: argparse.Namespace) -> Breakdown:
    device = ctx.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            step()
            prof.step()  # ProfilerStep#N ranges: bench/trace_summary.py splits the trace by them
        synchronize(device)
    host_us = 0.0
    families = {family: 0.0 for family, _ in KERNEL_FAMILIES} | {"other": 0.0}
    for event in prof.key_averages():
        if event.key in DISPATCH_RANGES or any(node in event.key for node in BACKWARD_NODES):
            host_us += event.cpu_time_total
        if device.type == "cuda" and event.device_type == torch.autograd.DeviceType.CUDA:
            families[kernel_family(event.key)] += event.self_device_time_total
    if args.trace_dir and ctx.rank == 0:
        export_trace(prof, Path(args.trace_dir) / f"expert_parallel-{mode}-{ctx.world_size}gpu.json")
    names = list(families)
    values = slowest(
        [host_us / args.profile_steps / 1e6] + [families[n] / args.profile_steps / 1e6 for n in names], device
    )
    return Breakdown(
        mode=mode, dispatch_combine_host_seconds=values[0], device_seconds=dict(zip(names, values[1:], strict=True))
    )


def export_trace(prof: profile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    with path.open("rb") as plain, gzip.open(f"{path}.gz", "wb") as packed:
        shutil.copyfileobj(plain, packed)
    path.unlink()


def breakdown_line(result: Result, breakdown: Breakdown) -> str:
    """One short line (the GPU session script cuts lines at 400 characters): host time in dispatch/combine, then
    device time per kernel family on the slowest rank, as ms and share of the step (kernels on different streams
    overlap, so shares can sum past 100%)."""
    step = result.median_seconds
    host = breakdown.dispatch_combine_host_seconds
    line = f"#   {result.mode}: dispatch+combine host {host * 1000:.1f} ms ({host / step:.0%})"
    if not any(breakdown.device_seconds.values()):
        return line + "; kernel families: CUDA only"
    parts = [f"{name} {s * 1000:.1f} ({s / step:.0%})" for name, s in breakdown.device_seconds.items()]
    return line + "; device ms (share): " + ", ".join(parts)


def runs(
    modes: list[str],
    layouts: list[str],
    deep_ep_layouts: list[str] | None = None,
    fsdp_layouts: list[str] | None = None,
) -> list[tuple[str, str]]:
    """(mode, dense layout) pairs in order: `fsdp` once per `fsdp_layouts` (default: per-layer units, the
    baseline), the others once per layout (`deep_ep` once per `deep_ep_layouts` when given)."""

    def layouts_of(mode: str) -> list[str]:
        if mode == "fsdp":
            return fsdp_layouts or ["layers"]
        return deep_ep_layouts if mode == "deep_ep" and deep_ep_layouts else layouts

    return [(mode, layout) for mode in modes for layout in layouts_of(mode)]


def emit(line: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["fsdp", "ep", "deep_ep"], choices=list(MODES))
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=2.0,
        help="ep_capacity mode: rows per rank pair over the mean T * k / ep (design 0029)",
    )
    parser.add_argument(
        "--copy-capacity-factor",
        type=float,
        default=2.0,
        help="ep_tokens mode: expert rows per rank over the mean T * k (design 0031)",
    )
    parser.add_argument(
        "--dense-layouts",
        nargs="+",
        default=["layers"],
        choices=list(DENSE_LAYOUTS),
        help="dense-domain FSDP layouts of the ep/deep_ep modes, a row each (fsdp always uses layers)",
    )
    parser.add_argument(
        "--deep-ep-layouts",
        nargs="+",
        default=None,
        choices=list(DENSE_LAYOUTS),
        help="dense layouts of the deep_ep mode (default: --dense-layouts)",
    )
    parser.add_argument(
        "--fsdp-layouts",
        nargs="+",
        default=None,
        choices=list(DENSE_LAYOUTS),
        help="layouts of the ep=1 mode (default: layers); `single` on one GPU, `replicate` for plain data parallelism",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="replay each step's forward, backward and gradient sync as one CUDA graph (design 0031); needs a "
        "capturable step: ep_tokens or ep_capacity with the replicate layout, or fsdp with single or replicate",
    )
    parser.add_argument("--optimizer", default="fused", choices=["fused", "torch"], help="the same for every mode")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile-steps", type=int, default=2, help="0: no breakdown")
    parser.add_argument(
        "--budget-seconds", type=float, default=0.0, help="skip a profile that would not fit (0: no limit)"
    )
    parser.add_argument("--trace-dir", default=None, help="write rank 0's gzipped Chrome trace of each profile here")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--grouped-mm", default=None, help='backend JSON, e.g. \'{"kind": "torch"}\' (default: auto)')
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script itself (CPU is fine)")
    parser.add_argument(
        "--compile-layers",
        action="store_true",
        help="compile every decoder layer in every mode (Inductor on CUDA; keep --warmup >= 3: compilation is in it)",
    )
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "loss"],
        help="auto: detection (Triton on CUDA); loss: eager norms/SwiGLU/RoPE/permutation for Inductor to fuse, "
        "Triton loss",
    )
    args = parser.parse_args()
    started = time.monotonic()
    os.environ.setdefault("D9D_DEVICE", args.device)
    params = tiny(MOE) if args.tiny else MOE
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    shape = "2 x 64 (tiny)" if args.tiny else f"{MOE_BATCH[0]} x {MOE_BATCH[1]}"
    compiled = ", decoder layers compiled" if args.compile_layers else ""
    compiled += ", CUDA-graphed forward/backward" if args.cuda_graph else ""
    emit(
        f"# {datetime.date.today()} {world} x {device_name}, torch {torch.__version__}, per-GPU batch {shape}, "
        f"optimizer {args.optimizer}, kernels {args.kernels}{compiled}"
    )
    emit("| mode | GPUs | tokens/s per GPU (slowest) | peak memory | median step |")
    emit("|---|---|---|---|---|")
    for mode, layout in runs(args.modes, args.dense_layouts, args.deep_ep_layouts, args.fsdp_layouts):
        label = (mode if layout == "layers" else f"{mode}-{layout}") + ("-compiled" if args.compile_layers else "")
        label += "-graphed" if args.cuda_graph else ""
        ep = 1 if mode == "fsdp" else world
        if mode == "deep_ep" and importlib.util.find_spec("deep_ep") is None:
            emit(f"| {label} | {world} | skipped: deep_ep is not installed (bench/build_deepep.sh) | | |")
            continue
        ctx = DistributedContext.build(mesh_degrees(layout, ep), device=args.device)
        step: Callable[[], None] | None = None
        model: torch.nn.Module | None = None
        try:
            step, tokens, model = build_step(mode, layout, ctx, params, args)
            result = time_steps(label, ctx, step, tokens, args)
            emit(
                f"| {label} (ep={result.ep}) | {world} | {result.tokens_per_second_per_gpu:,.0f} "
                f"| {result.peak_gib:.1f} GiB | {result.median_seconds * 1000:.0f} ms |"
            )
            imbalance = routing_imbalance(model, ctx.device)
            if imbalance is not None:
                per_layer = " ".join(f"{value:.2f}" for value in imbalance)
                emit(f"#   {label}: rows received, max/mean over ranks per MoE layer: {per_layer}")
            dropped = dropped_share(model, ctx.device)
            if dropped is not None:
                factor = (
                    f"copy capacity factor {args.copy_capacity_factor}"
                    if mode == "ep_tokens"
                    else (f"capacity factor {args.capacity_factor}")
                )
                emit(f"#   {label}: {factor}, routed copies dropped: {dropped:.3%}")
            emit(f"<!-- {json.dumps(asdict(result))} -->")
            needed = (args.profile_steps + PROFILE_OVERHEAD_STEPS) * result.median_seconds + PROFILE_OVERHEAD_SECONDS
            left = args.budget_seconds - (time.monotonic() - started)
            # Every rank takes the same decision: the elapsed time of the slowest rank decides.
            fits = not args.budget_seconds or slowest([-left], ctx.device)[0] <= -needed
            if args.profile_steps > 0 and fits:
                breakdown = profile_steps(label, ctx, step, args)
                emit(breakdown_line(result, breakdown))
                emit(f"<!-- {json.dumps(asdict(breakdown))} -->")
            elif args.profile_steps > 0:
                emit(f"#   {label}: profile skipped, {left:.0f} s of --budget-seconds left, {needed:.0f} s needed")
        except Exception as error:  # noqa: BLE001 - report and go on to the next mode
            emit(f"| {label} | {world} | failed: {type(error).__name__}: {str(error)[:300]} | | |")
        finally:
            step = model = None  # the model and optimizer go before the next mode builds its own
            if args.compile_layers:
                torch._dynamo.reset()  # this row's graphs (and their guards on its modules) go too
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
