"""Expert parallelism against FSDP-only on the MoE anchor (../shared/reference/anchors.md), N ranks, same per-GPU batch.

Each mode trains the MoE anchor (hidden 1024, 8 MoE layers, 64 experts top-8, expert FFN 768, batch 2 x 4096 per
GPU) with FSDP (bf16 compute, fp32 reduce, fp32 master weights, AdamW, clipping at 1.0) on every rank:

- `fsdp`: `ep=1`, experts FSDP-sharded and all-gathered like every other parameter;
- `ep`: `ep=N` with the all-to-all dispatcher (experts `Shard(0)` over the ranks, tokens exchanged);
- `deep_ep`: `ep=N` with DeepEP's normal mode (skipped, with the reason, when `deep_ep` does not import).

After `--warmup` steps, `--steps` steps are timed (CUDA synchronised); the slowest rank's median is reported as
tokens/s per GPU, with the peak allocated memory of the most loaded rank. A further `--profile-steps` steps run under
`torch.profiler`: the share of step time in the `moe.dispatch` / `moe.combine` ranges (forward, host wall time,
which includes the split-size sync) and in the exchange's backward nodes, and the device time of the communication
kernels (NCCL all-to-all / send-recv, DeepEP) per step.

    torchrun --nproc_per_node 4 bench/expert_parallel.py                       # fsdp, ep, deep_ep on 4 GPUs
    torchrun --nproc_per_node 2 bench/expert_parallel.py --modes fsdp ep
    torchrun --nproc_per_node 1 bench/expert_parallel.py --modes fsdp          # the 1-GPU per-GPU figure
    torchrun --nproc_per_node 2 bench/expert_parallel.py --tiny --device cpu   # seconds-long gloo smoke run
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.kernels.expert_dispatch import AllToAllDispatchConfig, AnyExpertDispatchConfig, DeepEpDispatchConfig
from d9d.kernels.grouped_mm import GROUPED_MM_CONFIG_ADAPTER
from d9d.models import DecoderConfig, materialize_
from d9d.models.qwen3 import Qwen3MoeForCausalLM, Qwen3MoeParameters, parallelize_qwen3_moe
from d9d.parallel import FsdpConfig, MixedPrecisionConfig, clip_grad_norm_

MOE = Qwen3MoeParameters(
    hidden_size=1024,
    intermediate_size=3072,  # unused: every layer is MoE
    num_layers=8,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=1e6,
    vocab_size=151936,
)
TINY = {"hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
TINY |= {"vocab_size": 512, "num_experts": 8, "moe_intermediate_size": 32, "num_experts_per_tok": 2}
DISPATCH_RANGES = ("moe.dispatch", "moe.combine")
# Backward of the token exchange: the autograd nodes of the all-to-all and DeepEP functions.
BACKWARD_NODES = ("_AllToAllBackward", "_DispatchBackward", "_CombineBackward")
COMM_KERNELS = ("alltoall", "all_to_all", "sendrecv", "deep_ep", "intranode")


@dataclass(frozen=True)
class Result:
    mode: str
    world_size: int
    ep: int
    tokens_per_gpu_step: int
    median_seconds: float
    tokens_per_second_per_gpu: float
    peak_gib: float
    dispatch_combine_share: float
    comm_kernel_share: float


def dispatch_config(mode: str) -> AnyExpertDispatchConfig | None:
    match mode:
        case "fsdp":
            return None
        case "ep":
            return AllToAllDispatchConfig()
        case "deep_ep":
            return DeepEpDispatchConfig()
        case _:
            raise ValueError(f"unknown mode {mode!r}; valid: fsdp, ep, deep_ep")


def run(mode: str, ctx: DistributedContext, params: Qwen3MoeParameters, args: argparse.Namespace) -> Result:
    device = ctx.device
    batch, seq = (2, 64) if args.tiny else (2, 4096)
    grouped_mm = GROUPED_MM_CONFIG_ADAPTER.validate_json(args.grouped_mm) if args.grouped_mm else None
    config = DecoderConfig(grouped_mm=grouped_mm, expert_dispatch=dispatch_config(mode))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(params, config=config)
    mixed = MixedPrecisionConfig() if device.type == "cuda" else None  # bf16 compute needs bf16 kernels
    parallelize_qwen3_moe(model, ctx, FsdpConfig(mixed_precision=mixed))
    materialize_(model, device)
    # Per-parameter AdamW: expert and dense parameters are DTensors on different meshes (no cross-mesh foreach).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=False)
    generator = torch.Generator(device=device).manual_seed(1 + ctx.rank)
    ids = torch.randint(0, params.vocab_size, (batch, seq), device=device, generator=generator)
    labels = torch.randint(0, params.vocab_size, (batch, seq), device=device, generator=generator)
    tokens = batch * seq

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        (model(ids, labels=labels).losses.sum() / (tokens * ctx.world_size)).backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    synchronize()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    dispatch_seconds, comm_seconds = profile_exchange(step, synchronize, args.profile_steps, device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    slowest = torch.tensor([median, peak, dispatch_seconds / median, comm_seconds / median], dtype=torch.float64)
    slowest_median, peak_max, dispatch_share, comm_share = slowest_values(slowest, device)
    return Result(
        mode=mode,
        world_size=ctx.world_size,
        ep=ctx.degrees.ep,
        tokens_per_gpu_step=tokens,
        median_seconds=slowest_median,
        tokens_per_second_per_gpu=tokens / slowest_median,
        peak_gib=peak_max,
        dispatch_combine_share=dispatch_share,
        comm_kernel_share=comm_share,
    )


def slowest_values(values: torch.Tensor, device: torch.device) -> tuple[float, float, float, float]:
    on_device = values.to(device)
    dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
    first, second, third, fourth = (float(v) for v in on_device.tolist())
    return first, second, third, fourth


def profile_exchange(
    step: Callable[[], None], synchronize: Callable[[], None], steps: int, device: torch.device
) -> tuple[float, float]:
    """Per step: host seconds in the dispatch/combine ranges and their backward nodes; device seconds in
    communication kernels (0 on CPU)."""
    if steps <= 0:
        return 0.0, 0.0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize()
    host_us = 0.0
    device_us = 0.0
    for event in prof.key_averages():
        name = event.key
        if name in DISPATCH_RANGES or any(node in name for node in BACKWARD_NODES):
            host_us += event.cpu_time_total
        if device.type == "cuda" and any(kernel in name.lower() for kernel in COMM_KERNELS):
            device_us += getattr(event, "self_device_time_total", 0.0)
    return host_us / steps / 1e6, device_us / steps / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["fsdp", "ep", "deep_ep"], choices=["fsdp", "ep", "deep_ep"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--grouped-mm", default=None, help='backend JSON, e.g. \'{"kind": "torch"}\' (default: auto)')
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script itself (CPU is fine)")
    args = parser.parse_args()
    os.environ.setdefault("D9D_DEVICE", args.device)
    params = MOE.model_copy(update=TINY) if args.tiny else MOE
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows: list[str] = []
    for mode in args.modes:
        ep = 1 if mode == "fsdp" else world
        if mode == "deep_ep" and importlib.util.find_spec("deep_ep") is None:
            rows.append(f"| {mode} | skipped: deep_ep is not installed (bench/build_deepep.sh) | | | | |")
            continue
        ctx = DistributedContext.build(MeshDegrees(dp_shard=-1, ep=ep), device=args.device)
        try:
            result = run(mode, ctx, params, args)
        except Exception as error:  # noqa: BLE001 - report and go on to the next mode
            rows.append(f"| {mode} | failed: {type(error).__name__}: {str(error)[:300]} | | | | |")
            continue
        finally:
            if args.device == "cuda":
                torch.cuda.empty_cache()
        rows.append(
            f"| {mode} (ep={result.ep}) | {result.tokens_per_second_per_gpu:,.0f} | {result.peak_gib:.1f} GiB "
            f"| {result.median_seconds * 1000:.0f} ms | {result.dispatch_combine_share:.1%} "
            f"| {result.comm_kernel_share:.1%} |"
        )
        rows.append(f"<!-- {json.dumps(asdict(result))} -->")
    if int(os.environ.get("RANK", "0")) == 0:
        device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
        shape = "2 x 64 (tiny)" if args.tiny else "2 x 4096"
        print(f"# {datetime.date.today()} {world} x {device_name}, torch {torch.__version__}, per-GPU batch {shape}")
        print("| mode | tokens/s per GPU (slowest) | peak memory | median step | dispatch+combine | comm kernels |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
