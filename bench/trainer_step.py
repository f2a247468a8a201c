"""Training-step benchmark of the anchor workloads *through the d9d Trainer* (FSDP, bf16 compute, fp32 reduce).

Run one rank per GPU with torchrun; every configuration uses the same per-GPU batch (the anchors' micro-batch,
one micro-batch per step), so per-GPU tokens/s at N GPUs over 1 GPU is the scaling efficiency. After `--warmup`
steps, the median of the next `--steps` steps' tokens/s (Trainer metric: global tokens / step wall time, the step
ending with a host sync on the loss all-reduce) is reported with MFU over 989 TFLOP/s per GPU (anchors.md formula,
`bench/model_step.py`) and the peak allocated memory of rank 0.

    # one multi-GPU call (4 GPUs): dense and MoE on 1 GPU, dense FSDP on 2 and 4 GPUs
    for cfg in "0 dense" "0 moe" "0,1 dense" "0,1,2,3 dense"; do set -- $cfg
      CUDA_VISIBLE_DEVICES=$1 torchrun --nproc-per-node $(( $(echo $1 | tr -cd , | wc -c) + 1 )) \\
        bench/trainer_step.py --model $2; done
    torchrun --nproc-per-node 2 bench/trainer_step.py --model dense --tiny --device cpu   # smoke run on CPU

Ablation switches (docs/kernels.md): `--kernels eager|triton|auto` (the Triton kernels of d9d-kernels for RMSNorm,
SwiGLU, RoPE, MoE permutation, the fused loss and, with `triton`, the grouped GEMM; `auto` is detection),
`--compile` (regional compilation of every decoder layer), `--checkpoint none|full|selective`.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from anchor_models import DENSE, DENSE_BATCH, MOE, MOE_BATCH, PEAK_TFLOPS, flops_per_token, tiny
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
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    Qwen3DenseParameters,
    Qwen3MoeForCausalLM,
    Qwen3MoeParameters,
    parallelize_qwen3_dense,
    parallelize_qwen3_moe,
)
from d9d.parallel import FsdpConfig, MixedPrecisionConfig, clip_grad_norm_


class CausalLMTask:
    def count_tokens(self, batch: TokenBatch) -> int:
        return batch.labels.numel()  # no ignored labels in this synthetic stream: no device sync needed

    def compute_loss(self, model: nn.Module, batch: TokenBatch) -> LossResult:
        device = next(model.parameters()).device
        ids, labels = batch.input_ids.to(device, non_blocking=True), batch.labels.to(device, non_blocking=True)
        return LossResult(loss_sum=model(ids, labels=labels).losses.sum())


def decoder_config_for(kernels: str, *, compile_layers: bool, checkpoint: str) -> DecoderConfig:
    """The model's run options for one ablation row (`kernels`: eager, triton, or auto = detection; attention and
    the grouped matmul stay on detection, i.e. SDPA and torch._grouped_mm on sm90+, except the grouped GEMM of
    `triton`)."""
    from d9d.kernels.grouped_mm import TritonGroupedMmConfig
    from d9d.kernels.linear_cross_entropy import EagerLinearCrossEntropyConfig, TritonLinearCrossEntropyConfig
    from d9d.kernels.moe_permute import EagerMoePermuteConfig, TritonMoePermuteConfig
    from d9d.kernels.rms_norm import EagerRmsNormConfig, TritonRmsNormConfig
    from d9d.kernels.rope import EagerRopeConfig, TritonRopeConfig
    from d9d.kernels.swiglu import EagerSwiGluConfig, TritonSwiGluConfig

    options: dict[str, object] = {
        "loss_chunk_size": 2048,
        "compile_layers": compile_layers,
        "activation_checkpointing": checkpoint != "none",
        "checkpoint_policy": "selective" if checkpoint == "selective" else "full",
    }
    if kernels == "eager":
        options |= {
            "rms_norm": EagerRmsNormConfig(), "swiglu": EagerSwiGluConfig(), "rope": EagerRopeConfig(),
            "moe_permute": EagerMoePermuteConfig(), "linear_cross_entropy": EagerLinearCrossEntropyConfig(),
        }  # fmt: skip
    elif kernels == "triton":
        options |= {
            "grouped_mm": TritonGroupedMmConfig(), "rms_norm": TritonRmsNormConfig(), "swiglu": TritonSwiGluConfig(),
            "rope": TritonRopeConfig(), "moe_permute": TritonMoePermuteConfig(),
            "linear_cross_entropy": TritonLinearCrossEntropyConfig(),
        }  # fmt: skip
    return DecoderConfig.model_validate(options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["dense", "moe"], default="dense")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script itself")
    parser.add_argument("--kernels", choices=["eager", "triton", "auto"], default="eager")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (regional)")
    parser.add_argument("--checkpoint", choices=["none", "full", "selective"], default="none")
    args = parser.parse_args()
    decoder_config = decoder_config_for(args.kernels, compile_layers=args.compile, checkpoint=args.checkpoint)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    params: Qwen3DenseParameters = MOE if args.model == "moe" else DENSE
    rows, seq = (2, 64) if args.tiny else {"dense": DENSE_BATCH, "moe": MOE_BATCH}[args.model]
    if args.tiny:
        params = tiny(params)
    ctx = DistributedContext.build(MeshDegrees(dp_shard=-1), device=args.device)
    dp = ctx.world_size

    def model_provider(ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
        cls = Qwen3MoeForCausalLM if isinstance(params, Qwen3MoeParameters) else Qwen3DenseForCausalLM
        with torch.device("meta"):
            model = cls(params, config=decoder_config)  # type: ignore[arg-type]
        parallelize = parallelize_qwen3_moe if args.model == "moe" else parallelize_qwen3_dense
        sync = parallelize(model, ctx, FsdpConfig(mixed_precision=MixedPrecisionConfig()))
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
    peak = timed[-1]["peak_memory_gib"]
    if ctx.is_main_process:
        name = torch.cuda.get_device_name() if ctx.device.type == "cuda" else "cpu"
        print(f"# {name}, torch {torch.__version__}; {args.model}, {dp} GPU(s), {rows}x{seq} tokens per GPU")
        print("| run | GPUs | tokens/s | tokens/s per GPU | MFU | peak memory (rank 0) |")
        print("|---|---|---|---|---|---|")
        print(
            f"| d9d 0.1 Trainer {args.model}, FSDP, bf16 compute/fp32 reduce, AdamW, kernels={args.kernels}, "
            f"compile={args.compile}, checkpoint={args.checkpoint} | {dp} | {tokens_per_second:,.0f} "
            f"| {tokens_per_second / dp:,.0f} | {mfu:.1%} | {peak:.1f} GiB |",
            flush=True,
        )
    ctx.close()


if __name__ == "__main__":
    main()
