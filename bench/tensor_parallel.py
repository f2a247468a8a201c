"""Tensor + sequence parallelism against FSDP on the dense anchor, *through the d9d Trainer*, same per-GPU batch.

Every run processes the anchor's 4 x 4096 tokens per GPU and step: under FSDP each GPU holds its own 4 rows; under
`tp` the `tp` ranks of a data-parallel rank share `4 x tp` rows (each rank computes its heads / FFN columns of all of
them and holds a `1/tp` sequence shard between blocks). bf16 compute, fp32 reduce, AdamW, clipping 1.0. After
`--warmup` steps the median tokens/s of the next `--steps` steps (Trainer metric: global tokens / step wall time) is
reported per GPU, with MFU over 989 TFLOP/s per GPU (anchors.md formula) and the peak allocated memory of rank 0.
`--async-tp` turns on torch's micro-pipelined all-gather/reduce-scatter matmuls, which act under `torch.compile`
only: compare it with `--compile` alone (each decoder layer compiled in both).

    # one 4-GPU call; the FSDP baselines are rerun in the same command
    B=bench/tensor_parallel.py
    CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 $B                               # FSDP, 2 GPUs
    CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 $B --tp 2                        # tp2, eager
    CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 $B --compile                     # FSDP, compiled layers
    CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 $B --tp 2 --compile              # tp2, async TP off
    CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 $B --tp 2 --compile --async-tp   # tp2, async TP on
    CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc-per-node 4 $B                           # FSDP, 4 GPUs
    CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc-per-node 4 $B --tp 2                    # tp2 x dp_shard2
    CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc-per-node 4 $B --tp 2 --compile --async-tp
    torchrun --nproc-per-node 4 $B --tp 2 --tiny --device cpu                             # smoke run on CPU (gloo)
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from anchor_models import DENSE, DENSE_BATCH, PEAK_TFLOPS, flops_per_token, tiny
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.dist.domains import MeshDomain
from d9d.core.loop import (
    BuiltModel,
    EventBus,
    LossResult,
    ModelLoader,
    StepFinished,
    SyntheticTokenSource,
    TokenBatch,
    TrainerConfig,
    build_trainer,
)
from d9d.core.lr import ConstantScheduleConfig, build_lr_scheduler
from d9d.core.optim import AdamWConfig, build_optimizer
from d9d.models import DecoderConfig, materialize_
from d9d.models.qwen3 import Qwen3DenseForCausalLM, check_qwen3_tp_degrees, parallelize_qwen3_dense
from d9d.models.roles import Role
from d9d.parallel import ByRole, FsdpConfig, MixedPrecisionConfig, clip_grad_norm_, select_modules
from d9d.parallel.tensor import TensorParallelConfig


class CausalLMTask:
    def count_tokens(self, batch: TokenBatch) -> int:
        return batch.labels.numel()  # no ignored labels in this synthetic stream: no device sync needed

    def compute_loss(self, model: nn.Module, batch: TokenBatch) -> LossResult:
        device = next(model.parameters()).device
        ids, labels = batch.input_ids.to(device, non_blocking=True), batch.labels.to(device, non_blocking=True)
        return LossResult(loss_sum=model(ids, labels=labels).loss_sum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--async-tp", action="store_true", help="micro-pipelined TP (CUDA; needs --compile)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script itself")
    args = parser.parse_args()
    if args.async_tp and not args.compile:
        parser.error("--async-tp acts under torch.compile only: add --compile")
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    params = DENSE
    rows_per_gpu, seq = (2, 64) if args.tiny else DENSE_BATCH
    if args.tiny:
        params = tiny(params)
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    check_qwen3_tp_degrees(params, args.tp)  # before any rank builds anything
    ctx = DistributedContext.build(MeshDegrees(dp_shard=-1, tp=args.tp), device=args.device)
    dp = ctx.world_size // args.tp
    rows = rows_per_gpu * args.tp  # per data-parallel rank: the same tokens per GPU as FSDP

    def model_provider(ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
        with torch.device("meta"):
            model = Qwen3DenseForCausalLM(params, config=DecoderConfig(loss_chunk_size=2048))
        sync = parallelize_qwen3_dense(
            model,
            ctx,
            FsdpConfig(mixed_precision=MixedPrecisionConfig()),
            tensor_parallel=TensorParallelConfig(async_tp=args.async_tp),
        )
        if args.compile:
            for _, layer in select_modules(model, [ByRole(str(Role.DECODER_LAYER))]):
                layer.compile()
        materialize_(model, ctx.device)
        return BuiltModel(model=model, gradient_sync=sync, flops_per_token=flops_per_token(params, seq))

    def optimizer_provider(model: nn.Module) -> Optimizer:
        return build_optimizer(AdamWConfig(lr=1e-4, weight_decay=0.1, fused=args.device == "cuda"), model.parameters())

    def lr_provider(optimizer: Optimizer, total_steps: int) -> LRScheduler:
        return build_lr_scheduler(ConstantScheduleConfig(), optimizer, total_steps)

    def data_provider(ctx: DistributedContext, microbatches: int) -> SyntheticTokenSource:
        return SyntheticTokenSource(
            seed=1, global_rows=rows * dp, microbatch_rows=rows, seq_len=seq, vocab_size=params.vocab_size,
            dp_rank=ctx.coordinate(MeshDomain.BATCH)["dp"], dp_size=dp,
        )  # fmt: skip

    config = TrainerConfig(
        total_steps=args.warmup + args.steps,
        global_batch_rows=rows * dp,
        microbatch_rows=rows,
        max_grad_norm=1.0,
        gc_every=50,
        peak_flops_per_device=PEAK_TFLOPS * 1e12,
    )
    events, records = EventBus(), []
    events.subscribe(StepFinished, lambda event: records.append(event.metrics))
    trainer = build_trainer(
        ctx, config, model_provider=model_provider, task=CausalLMTask(), data_provider=data_provider,
        optimizer_provider=optimizer_provider, lr_scheduler_provider=lr_provider, clipper=clip_grad_norm_,
        events=events,
    )  # fmt: skip
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    trainer.train()
    timed = records[args.warmup :]
    tokens_per_second = statistics.median(record["tokens_per_second"] for record in timed)
    mfu = statistics.median(record.get("mfu", float("nan")) for record in timed)
    peak = timed[-1].get("peak_memory_gib", float("nan"))
    if ctx.is_main_process:
        name = torch.cuda.get_device_name() if ctx.device.type == "cuda" else "cpu"
        layout = f"tp{args.tp} x dp_shard{dp}" if args.tp > 1 else f"FSDP dp_shard{dp}"
        mode = ("compiled, async TP" if args.async_tp else "compiled") if args.compile else "eager"
        print(f"# {name}, torch {torch.__version__}; dense, {ctx.world_size} GPU(s), {rows_per_gpu}x{seq} tokens/GPU")
        print("| run | GPUs | tokens/s per GPU | MFU | peak memory (rank 0) |")
        print("|---|---|---|---|---|")
        print(
            f"| d9d Trainer dense, {layout}, {mode} | {ctx.world_size} | {tokens_per_second / ctx.world_size:,.0f} "
            f"| {mfu:.1%} | {peak:.1f} GiB |",
            flush=True,
        )
    ctx.close()


if __name__ == "__main__":
    main()
