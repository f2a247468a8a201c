"""Long-context training steps of the dense anchor model (../shared/reference/anchors.md) with context parallelism.

One launch measures one configuration: `cp` ranks split each sequence of `--seq` tokens (load-balanced layout, ring
or all-gather-KV attention), the remaining ranks of the launch are FSDP data-parallel shards (`dp_shard`), one
sequence per data-parallel rank per step. Each step is forward + backward of the token-weighted chunked loss +
clipping at 1.0 + AdamW, FSDP with bf16 compute and fp32 master weights/reductions, no activation checkpointing, no
compile. The row reports the median step, tokens/s over the launch and per GPU, MFU over 989 TFLOP/s with the
anchors' FLOPs per token where the attention term is counted at this run's sequence length, and the peak allocated
memory of the busiest GPU. `cp=1` runs plain SDPA (flash) attention on the unsharded sequence.

    # issue 14's table (4 x H100/H200, one launch per line; each prints one markdown row)
    CUDA_VISIBLE_DEVICES=0       torchrun --nproc-per-node 1 bench/context_parallel.py --cp 1 --seq 8192
    CUDA_VISIBLE_DEVICES=0       torchrun --nproc-per-node 1 bench/context_parallel.py --cp 1 --seq 16384
    CUDA_VISIBLE_DEVICES=0,1     torchrun --nproc-per-node 2 bench/context_parallel.py --cp 2 --seq 16384
    CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc-per-node 4 bench/context_parallel.py --cp 4 --seq 16384
    CUDA_VISIBLE_DEVICES=0,1     torchrun --nproc-per-node 2 bench/context_parallel.py --cp 2 --seq 32768
    CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc-per-node 4 bench/context_parallel.py --cp 4 --seq 32768
    # add --attention all_gather for the other variant

    # a seconds-long CPU smoke run of the script itself (gloo, tiny model)
    torchrun --nproc-per-node 2 bench/context_parallel.py --tiny --device cpu --cp 2 --seq 64 --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch
import torch.distributed as dist

from anchor_models import DENSE, PEAK_TFLOPS, flops_per_token, tiny
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.dist.domains import MeshDomain
from d9d.kernels.attention import SdpaAttentionConfig
from d9d.models import DecoderConfig, materialize_
from d9d.models.qwen3 import Qwen3DenseForCausalLM, parallelize_qwen3_dense
from d9d.parallel import FsdpConfig, MixedPrecisionConfig, clip_grad_norm_
from d9d.parallel.context import ContextParallelConfig, check_context_parallel, shard_batch_for_context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--seq", type=int, default=16384, help="tokens per sequence (before sharding)")
    parser.add_argument("--attention", choices=["ring", "all_gather"], default="ring")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--loss-chunk-size", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="tiny model, to check the script itself")
    args = parser.parse_args()

    ctx = DistributedContext.build(MeshDegrees(cp=args.cp, dp_shard=-1), device=args.device)
    check_context_parallel(args.seq, ctx.degrees)
    device = ctx.device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    params = tiny(DENSE) if args.tiny else DENSE
    config = DecoderConfig(attention=SdpaAttentionConfig(), loss_chunk_size=args.loss_chunk_size)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(params, config=config)
    mixed = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32") if device.type == "cuda" else None
    parallelize_qwen3_dense(
        model, ctx, FsdpConfig(mixed_precision=mixed), context=ContextParallelConfig(attention=args.attention)
    )
    materialize_(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    coordinate = ctx.coordinate(MeshDomain.BATCH)
    generator = torch.Generator(device=device).manual_seed(1 + coordinate["dp"])  # cp ranks share their sequence
    ids = torch.randint(0, params.vocab_size, (1, args.seq + 1), device=device, generator=generator)
    batch = shard_batch_for_context({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, coordinate["cp"], args.cp)
    global_tokens = args.seq * ctx.degrees.dp

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        losses = model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]).losses
        (losses.sum() / global_tokens).backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    synchronize()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.tensor(
        [torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0], device=device
    )
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    median = statistics.median(times)
    tokens_per_second = global_tokens / median
    per_gpu = tokens_per_second / ctx.world_size
    mfu = per_gpu * flops_per_token(params, args.seq) / (PEAK_TFLOPS * 1e12)
    if ctx.is_main_process:
        device_name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
        variant = "sdpa" if args.cp == 1 else args.attention
        print(f"# {datetime.date.today()} {device_name} x {ctx.world_size}, torch {torch.__version__}")
        print("| run | seq | GPUs | tokens/s | tokens/s per GPU | MFU | peak memory per GPU | median step |")
        print("|---|---|---|---|---|---|---|---|")
        print(
            f"| dense anchor, cp={args.cp} x dp_shard={ctx.degrees.dp_shard}, {variant} | {args.seq} "
            f"| {ctx.world_size} | {tokens_per_second:,.0f} | {per_gpu:,.0f} | {mfu:.1%} | {float(peak):.1f} GiB "
            f"| {median * 1000:.0f} ms |",
            flush=True,
        )
        record = {"cp": args.cp, "seq": args.seq, "world": ctx.world_size, "attention": variant}
        record |= {"tokens_per_second": tokens_per_second, "mfu": mfu, "peak_gib": float(peak), "median_s": median}
        print(f"<!-- {json.dumps(record)} -->", flush=True)
    ctx.close()


if __name__ == "__main__":
    main()
