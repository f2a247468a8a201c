"""Decoding throughput of the dense anchor model (Qwen3-0.6B shape) under tensor parallelism: d9d's KV-cached
`generate` on `tp` ranks (the replicated-activation layout, design 0019) next to the same model on one rank, in one
command. Launch with torchrun; rank 0 times the one-rank model first, then every rank runs the tp model.

Random weights (seed 0) in bf16; the tp model gets the one-rank model's weights (`distribute_tensor` of each
parameter), so the greedy tokens can be compared: the last column is the mean fraction of each row's tokens before
the first difference (bf16 with the sums split over ranks may part ways after a near-tie). Rows: median generated
tokens/s (batch x new tokens / wall time, prefill included) of `--repeats` runs after a warm-up, and the peak
allocated memory per rank.

    torchrun --nproc-per-node 2 bench/generation_tp.py                     # batch 1 and 32, prompt 512, 256 new
    torchrun --nproc-per-node 2 bench/generation_tp.py --compile           # the decode step compiled, both sides
    torchrun --nproc-per-node 2 bench/generation_tp.py --tiny --device cpu # a seconds-long smoke run (gloo)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

sys.path.insert(0, str(Path(__file__).parent))
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.kernels.attention import SdpaAttentionConfig
from d9d.models import DecoderConfig, materialize_
from d9d.models.generation import GenerationConfig, generate
from d9d.models.qwen3 import Qwen3DenseForCausalLM, Qwen3DenseParameters, parallelize_qwen3_dense
from d9d.parallel import FsdpConfig
from d9d.parallel.tensor import TensorParallelConfig
from generation import ANCHOR, TINY, agreement  # the one-GPU benchmark's model shapes and token agreement


def _model(params: Qwen3DenseParameters) -> torch.nn.Module:
    with torch.device("meta"):
        return Qwen3DenseForCausalLM(params, config=DecoderConfig(attention=SdpaAttentionConfig()))


def _tokens(model: torch.nn.Module, ids: torch.Tensor, config: GenerationConfig) -> list[list[int]]:
    return generate(model, ids, config).tokens


def _timed(run: Callable[[], list[list[int]]], device: torch.device, repeats: int) -> tuple[float, list[list[int]]]:
    tokens = run()  # warm-up
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        begin = time.perf_counter()
        tokens = run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - begin)
    return statistics.median(seconds), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="compile the decode step (GenerationConfig.compile)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, prompt 16, 8 new tokens (smoke run)")
    args = parser.parse_args()
    params, prompt, new = (TINY, 16, 8) if args.tiny else (ANCHOR, args.prompt, args.new_tokens)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    ctx = DistributedContext.build(MeshDegrees(tp=int(os.environ["WORLD_SIZE"])), device=args.device)
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    rank, tp = dist.get_rank(), ctx.degrees.tp

    single = _model(params)
    torch.manual_seed(0)
    materialize_(single, device)
    single = single.to(dtype).eval()
    model = _model(params)
    parallelize_qwen3_dense(model, ctx, FsdpConfig(), tensor_parallel=TensorParallelConfig(sequence_parallel=False))
    materialize_(model, device)
    model = model.to(dtype).eval()
    with torch.no_grad():  # the one-rank weights, split: every rank built `single` from the same seed
        for param, whole in zip(model.parameters(), single.parameters(), strict=True):
            assert isinstance(param, DTensor)
            param.copy_(distribute_tensor(whole.detach(), param.device_mesh, param.placements))

    if rank == 0:
        print(f"| batch | ranks | tokens/s | peak memory per rank | greedy agreement with 1 rank |  ({device.type})")
        print("|---|---|---|---|---|", flush=True)
    for batch in args.batches:
        ids = torch.randint(0, params.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(batch))
        config = GenerationConfig(max_new_tokens=new, compile=args.compile)
        expected: list[list[int]] = []
        if rank == 0:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            seconds, expected = _timed(partial(_tokens, single, ids, config), device, args.repeats)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            print(f"| {batch} | 1 | {batch * new / seconds:,.0f} | {peak:.2f} GiB | - |", flush=True)
        else:  # the other ranks wait at rank 0's barriers, then join the tp runs
            for _ in range(args.repeats):
                dist.barrier()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds, tokens = _timed(partial(_tokens, model, ids, config), device, args.repeats)
        if rank == 0:
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            shown = agreement(tokens, expected)
            print(f"| {batch} | {tp} (tp) | {batch * new / seconds:,.0f} | {peak:.2f} GiB | {shown:.2f} |", flush=True)
    ctx.close()


if __name__ == "__main__":
    main()
