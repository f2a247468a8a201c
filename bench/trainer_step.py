"""Training-step benchmark of the anchor workloads *through the d9d Trainer* (bf16 compute, AdamW, one micro-batch).

Run one rank per GPU with torchrun (one GPU: plain `python` works too); every configuration uses the same per-GPU
batch (the anchors' micro-batch), so per-GPU tokens/s at N GPUs over 1 GPU is the scaling efficiency. After
`--warmup` steps, the median of the next `--steps` steps' tokens/s (Trainer metric: global tokens / step wall time,
the step ending with a host sync on the loss) is reported with MFU over 989 TFLOP/s per GPU (anchors.md formula,
`bench/model_step.py`) and the peak allocated memory of rank 0 over the timed steps.

    # one multi-GPU call (4 GPUs): dense and MoE on 1 GPU, dense FSDP on 2 and 4 GPUs
    for cfg in "0 dense" "0 moe" "0,1 dense" "0,1,2,3 dense"; do set -- $cfg
      CUDA_VISIBLE_DEVICES=$1 torchrun --nproc-per-node $(( $(echo $1 | tr -cd , | wc -c) + 1 )) \\
        bench/trainer_step.py --model $2; done
    torchrun --nproc-per-node 2 bench/trainer_step.py --model dense --tiny --device cpu   # smoke run on CPU

    # the single-GPU ablation (docs/kernels.md "The single-GPU levers"): rows back to back in one process
    python bench/trainer_step.py --ablation dense && python bench/trainer_step.py --ablation moe
    python bench/trainer_step.py --ablation dense --tiny --device cpu                      # smoke run on CPU

Switches (each an ablation lever):
- `--kernels eager|triton|loss|auto`: the Triton kernels of d9d-kernels (RMSNorm, SwiGLU, RoPE, MoE permutation, the
  fused loss and, with `triton`, the grouped GEMM); `loss`: eager references (which Inductor fuses under compile) but
  the Triton fused loss; `auto` is detection.
- `--compile none|layers|model`: regional compilation of every decoder layer, or of the whole model's forward.
- `--attention auto|sdpa|cudnn|flex`: SDPA (flash on Hopper), SDPA pinned to cuDNN, FlexAttention.
- `--weights fp32|bf16`: float32 master weights + fused torch AdamW, or bfloat16 weights (no master copy) updated by
  the fused stochastic-rounding AdamW step (`StochasticAdamW(fused=True)`, the Triton step of d9d-kernels).
- `--data-parallel fsdp|single`: FSDP units, or no FSDP on one rank (`SingleDeviceConfig`: parameters stored in bf16,
  so it needs `--weights bf16`).
- `--grad-dtype float32|bfloat16`, `--state-dtype float32|bfloat16`: gradient reduction/accumulation dtype and the
  stochastic AdamW's moment dtype (memory levers).
- `--checkpoint none|full|selective`: activation checkpointing policy.
- `--loss-path in_forward|recompute`: where the Triton fused loss (`--kernels triton|loss`) forms its gradients: in
  forward, for the loss sum (`DecoderConfig.loss_gradients_in_forward`, design note 0023; the default), or in
  backward from recomputed logits (the previous path). `--loss-chunk N`: tokens per chunk of the loss (default 2048).
- `--offload`: CPU offload of the FSDP units (`FsdpConfig(offload=True)`, FSDP rows only): parameter shards,
  gradients and AdamW state in pinned host memory, the optimizer step on the CPU (torch's fused CPU AdamW; with
  `--weights bf16` the PyTorch stochastic AdamW, the Triton step being CUDA-only).

    # rows 10-12: the memory levers against the baseline (CPU offload, selective and full activation checkpointing)
    python bench/trainer_step.py --ablation dense --rows 0,10,11,12
    python bench/trainer_step.py --ablation dense --rows 10,11,12 --tiny --device cpu      # smoke run on CPU
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from anchor_models import DENSE, DENSE_BATCH, MOE, MOE_BATCH, PEAK_TFLOPS, flops_per_token
from anchor_models import tiny as _tiny
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.dist.domains import MeshDomain
from d9d.core.loop import (
    BuiltModel,
    EventBus,
    LossResult,
    ModelLoader,
    ProfilingConfig,
    StepFinished,
    SyntheticTokenSource,
    TokenBatch,
    TrainerConfig,
    build_trainer,
)
from d9d.core.lr import ConstantScheduleConfig, build_lr_scheduler
from d9d.core.optim import AdamWConfig, StochasticAdamWConfig, build_optimizer
from d9d.models import DecoderConfig, materialize_
from d9d.models.blocks.compilation import compile_model
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    Qwen3DenseParameters,
    Qwen3MoeForCausalLM,
    Qwen3MoeParameters,
    parallelize_qwen3_dense,
    parallelize_qwen3_moe,
)
from d9d.parallel import (
    FsdpConfig,
    MixedPrecisionConfig,
    SingleDeviceConfig,
    cast_parameters_,
    clip_grad_norm_,
    compute_device,
)

BATCH = {"dense": DENSE_BATCH, "moe": MOE_BATCH}
DType = Literal["float32", "bfloat16"]


@dataclass(frozen=True, kw_only=True)
class Row:
    """One benchmark configuration (one ablation row)."""

    name: str
    kernels: Literal["eager", "triton", "loss", "auto"] = "triton"
    compile: Literal["none", "layers", "model"] = "layers"
    attention: Literal["auto", "sdpa", "cudnn", "flex"] = "auto"
    weights: Literal["fp32", "bf16"] = "fp32"
    data_parallel: Literal["fsdp", "single"] = "fsdp"
    grad_dtype: DType = "float32"
    state_dtype: DType = "float32"
    checkpoint: Literal["none", "full", "selective"] = "none"
    loss_path: Literal["in_forward", "recompute"] = "in_forward"
    loss_chunk: int = 2048
    offload: bool = False

    @property
    def loss_gradients_in_forward(self) -> bool:
        """The Triton loss rows compute the loss gradients in forward unless `loss_path='recompute'`."""
        return self.kernels in ("triton", "loss") and self.loss_path == "in_forward"

    def describe(self) -> str:
        parts = [f"kernels={self.kernels}", f"compile={self.compile}", f"attention={self.attention}"]
        parts += [f"weights={self.weights}", f"dp={self.data_parallel}", f"grads={self.grad_dtype}"]
        if self.weights == "bf16":
            parts.append(f"adam state={self.state_dtype}")
        if self.kernels in ("triton", "loss"):
            parts.append(f"loss={self.loss_path}")
        parts.append(f"loss chunk={self.loss_chunk}")
        parts.append(f"checkpoint={self.checkpoint}")
        return ", ".join([*parts, "offload=cpu"] if self.offload else parts)


BASELINE = Row(name="baseline: triton + layer compile, FSDP, fp32 master")
ALL = Row(
    name="all: bf16 weights, no FSDP, model compile, cudnn",
    compile="model",
    attention="cudnn",
    weights="bf16",
    data_parallel="single",
)
ABLATION = [
    BASELINE,
    replace(BASELINE, name="+ bf16 weights, stochastic AdamW", weights="bf16"),
    replace(BASELINE, name="+ bf16 weights, no FSDP", weights="bf16", data_parallel="single"),
    replace(BASELINE, name="+ whole-model compile", compile="model"),
    replace(BASELINE, name="+ cuDNN attention", attention="cudnn"),
    replace(BASELINE, name="+ FlexAttention", attention="flex"),
    ALL,
    replace(ALL, name="all, eager kernels but the Triton loss (Inductor fuses the rest)", kernels="loss"),
    replace(ALL, name="all + bf16 grads and Adam moments", grad_dtype="bfloat16", state_dtype="bfloat16"),
    replace(ALL, name="row 7 + bf16 gradients (float32 Adam moments)", kernels="loss", grad_dtype="bfloat16"),
    # the memory levers, each against the baseline (row 0)
    replace(BASELINE, name="baseline + CPU offload of optimizer state", offload=True),
    replace(BASELINE, name="baseline + selective activation checkpointing", checkpoint="selective"),
    replace(BASELINE, name="baseline + full activation checkpointing", checkpoint="full"),
    # the fused loss (design note 0023): row 7 with its gradients recomputed in backward, and with chunk 4096
    replace(
        ALL,
        name="row 7, loss gradients recomputed in backward (the previous fused loss)",
        kernels="loss",
        loss_path="recompute",
    ),
    replace(ALL, name="row 7 + loss chunk 4096", kernels="loss", loss_chunk=4096),
]


@dataclass(frozen=True)
class Measured:
    tokens_per_second: float
    mfu: float
    peak_gib: float
    losses: list[float]


class CyclingTokenSource(SyntheticTokenSource):
    """The synthetic stream's first `pool` global batches over and over: data a model can learn (memorise), so a loss
    curve falls and numerical drift between two configurations shows (uniform tokens sit at ln(vocab) forever)."""

    def __init__(self, *, pool: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pool = pool

    def next_step(self) -> list[TokenBatch]:
        self.steps_consumed %= self.pool
        return super().next_step()


class CausalLMTask:
    def count_tokens(self, batch: TokenBatch) -> int:
        return batch.labels.numel()  # no ignored labels in this synthetic stream: no device sync needed

    def compute_loss(self, model: nn.Module, batch: TokenBatch) -> LossResult:
        device = compute_device(model)  # CPU-offloaded parameters still compute on the GPU
        ids, labels = batch.input_ids.to(device, non_blocking=True), batch.labels.to(device, non_blocking=True)
        return LossResult(loss_sum=model(ids, labels=labels).loss_sum)


def decoder_config_for(row: Row, *, device_type: str) -> DecoderConfig:
    """The model's run options for one row (attention `auto` and the grouped matmul stay on detection, i.e. SDPA and
    torch._grouped_mm on sm90+, except the grouped GEMM of `triton`). On CPU, Triton kernels become their eager
    references, cuDNN attention becomes SDPA and compilation uses `aot_eager` (the smoke run checks the wiring, not
    speed)."""
    from d9d.kernels.attention import ATTENTION_CONFIG_ADAPTER
    from d9d.kernels.grouped_mm import TritonGroupedMmConfig
    from d9d.kernels.linear_cross_entropy import EagerLinearCrossEntropyConfig, TritonLinearCrossEntropyConfig
    from d9d.kernels.moe_permute import EagerMoePermuteConfig, TritonMoePermuteConfig
    from d9d.kernels.rms_norm import EagerRmsNormConfig, TritonRmsNormConfig
    from d9d.kernels.rope import EagerRopeConfig, TritonRopeConfig
    from d9d.kernels.swiglu import EagerSwiGluConfig, TritonSwiGluConfig

    options: dict[str, object] = {
        "loss_chunk_size": row.loss_chunk,
        "loss_gradients_in_forward": row.loss_gradients_in_forward,
        "compile_layers": row.compile == "layers",
        "compile_backend": "inductor" if device_type == "cuda" else "aot_eager",
        "activation_checkpointing": row.checkpoint != "none",
        "checkpoint_policy": "selective" if row.checkpoint == "selective" else "full",
    }
    attention = "sdpa" if row.attention == "cudnn" and device_type != "cuda" else row.attention
    if attention != "auto":
        options["attention"] = ATTENTION_CONFIG_ADAPTER.validate_python({"kind": attention})
    kernels = "eager" if row.kernels in ("triton", "loss") and device_type != "cuda" else row.kernels
    if kernels in ("eager", "loss"):
        options |= {
            "rms_norm": EagerRmsNormConfig(), "swiglu": EagerSwiGluConfig(), "rope": EagerRopeConfig(),
            "moe_permute": EagerMoePermuteConfig(), "linear_cross_entropy": EagerLinearCrossEntropyConfig(),
        }  # fmt: skip
        if kernels == "loss":  # the one Triton kernel compile cannot match in memory (bench/kernels.py)
            options["linear_cross_entropy"] = TritonLinearCrossEntropyConfig()
    elif kernels == "triton":
        options |= {
            "grouped_mm": TritonGroupedMmConfig(), "rms_norm": TritonRmsNormConfig(), "swiglu": TritonSwiGluConfig(),
            "rope": TritonRopeConfig(), "moe_permute": TritonMoePermuteConfig(),
            "linear_cross_entropy": TritonLinearCrossEntropyConfig(),
        }  # fmt: skip
    return DecoderConfig.model_validate(options)


def check_row(row: Row, dp: int) -> None:
    if row.data_parallel == "single" and row.weights != "bf16":
        raise ValueError(
            f"row {row.name!r}: data_parallel='single' stores parameters in the compute dtype (no master copy), so "
            "it needs weights='bf16' (the stochastic-rounding AdamW); use data_parallel='fsdp' for fp32 masters"
        )
    if row.data_parallel == "single" and dp != 1:
        raise ValueError(f"row {row.name!r}: data_parallel='single' needs one rank, got {dp}; use 'fsdp'")
    if row.offload and row.data_parallel != "fsdp":
        raise ValueError(
            f"row {row.name!r}: offload=True is an option of FSDP units, and data_parallel={row.data_parallel!r} has "
            "none; use data_parallel='fsdp' (one rank works)"
        )


def run_row(
    ctx: DistributedContext,
    row: Row,
    *,
    model_name: str,
    warmup: int,
    steps: int,
    tiny: bool,
    lr: float = 1e-4,
    data_pool: int | None = None,
    profile_dir: Path | None = None,
) -> Measured:
    """Build the model, optimizer and Trainer of `row`, train `warmup + steps` steps, measure the last `steps`
    (`data_pool`: cycle over that many global batches instead of fresh uniform tokens; `profile_dir`: a Chrome trace
    of two steps after the warm-up, `bench/trace_summary.py` reads it)."""
    check_row(row, ctx.world_size)
    device_type = ctx.device.type
    decoder_config = decoder_config_for(row, device_type=device_type)
    params: Qwen3DenseParameters = MOE if model_name == "moe" else DENSE
    rows, seq = (2, 64) if tiny else BATCH[model_name]
    if tiny:
        params = _tiny(params)
    dp = ctx.world_size
    precision = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype=row.grad_dtype)
    fused_step = row.weights == "bf16" and device_type == "cuda" and not row.offload  # Triton: CUDA tensors only
    if fused_step:
        from d9d.kernels.adamw import register_triton_stochastic_adamw

        register_triton_stochastic_adamw()

    def model_provider(ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
        cls = Qwen3MoeForCausalLM if isinstance(params, Qwen3MoeParameters) else Qwen3DenseForCausalLM
        with torch.device("meta"):
            model = cls(params, config=decoder_config)  # type: ignore[arg-type]
        if row.weights == "bf16":
            cast_parameters_(model, torch.bfloat16)  # stored in bf16 (FSDP then keeps bf16 shards)
        parallelize = parallelize_qwen3_moe if model_name == "moe" else parallelize_qwen3_dense
        data_parallel = (
            SingleDeviceConfig(mixed_precision=precision)
            if row.data_parallel == "single"
            else FsdpConfig(mixed_precision=precision, offload=row.offload)
        )
        sync = parallelize(model, ctx, data_parallel)
        torch.manual_seed(0)
        materialize_(model, ctx.device)
        if row.compile == "model":
            compile_model(model, backend="inductor" if device_type == "cuda" else "aot_eager")
        return BuiltModel(model=model, gradient_sync=sync, flops_per_token=flops_per_token(params, seq))

    def optimizer_provider(model: nn.Module) -> Optimizer:
        if row.weights == "bf16":
            config = StochasticAdamWConfig(lr=lr, weight_decay=0.1, state_dtype=row.state_dtype, fused=fused_step)
            return build_optimizer(config, model.parameters())
        fused = device_type == "cuda" or row.offload  # offloaded: torch's fused CPU AdamW, not its per-tensor loop
        return build_optimizer(AdamWConfig(lr=lr, weight_decay=0.1, fused=fused), model.parameters())

    def lr_provider(optimizer: Optimizer, total_steps: int) -> LRScheduler:
        return build_lr_scheduler(ConstantScheduleConfig(), optimizer, total_steps)

    def data_provider(ctx: DistributedContext, microbatches: int) -> SyntheticTokenSource:
        stream = {
            "seed": 1, "global_rows": rows * dp, "microbatch_rows": rows, "seq_len": seq,
            "vocab_size": params.vocab_size, "dp_rank": ctx.coordinate(MeshDomain.BATCH)["dp"], "dp_size": dp,
        }  # fmt: skip
        return CyclingTokenSource(pool=data_pool, **stream) if data_pool else SyntheticTokenSource(**stream)

    config = TrainerConfig(
        total_steps=warmup + steps,
        global_batch_rows=rows * dp,
        microbatch_rows=rows,
        max_grad_norm=1.0,
        gc_every=50,
        peak_flops_per_device=PEAK_TFLOPS * 1e12,
        profiling=ProfilingConfig(directory=profile_dir, wait=max(0, warmup - 1), warmup=1, active=2)
        if profile_dir is not None
        else None,
    )
    events, records = EventBus(), []
    events.subscribe(StepFinished, lambda event: records.append(event.metrics))

    def reset_peak_after_warmup(event: StepFinished) -> None:
        if event.step == warmup and ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)  # the timed steps' peak, not an earlier row's

    events.subscribe(StepFinished, reset_peak_after_warmup)
    trainer = build_trainer(
        ctx, config, model_provider=model_provider, task=CausalLMTask(), data_provider=data_provider,
        optimizer_provider=optimizer_provider, lr_scheduler_provider=lr_provider, clipper=clip_grad_norm_,
        events=events,
    )  # fmt: skip
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    trainer.train()
    timed = records[warmup:] or records
    measured = Measured(
        tokens_per_second=statistics.median(record["tokens_per_second"] for record in timed),
        mfu=statistics.median(record.get("mfu", float("nan")) for record in timed),
        peak_gib=timed[-1]["peak_memory_gib"],
        losses=[record["loss"] for record in records],
    )
    del trainer
    release_memory(ctx.device)
    return measured


def release_memory(device: torch.device) -> None:
    """Drop the compiled graphs and cached blocks of a finished row, so the next row's peak is its own."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def row_from_args(args: argparse.Namespace) -> Row:
    return Row(
        name=f"d9d Trainer {args.model}",
        kernels=args.kernels,
        compile=args.compile,
        attention=args.attention,
        weights=args.weights,
        data_parallel=args.data_parallel,
        grad_dtype=args.grad_dtype,
        state_dtype=args.state_dtype,
        checkpoint=args.checkpoint,
        loss_path=args.loss_path,
        loss_chunk=args.loss_chunk,
        offload=args.offload,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["dense", "moe"], default="dense")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20; 8 per ablation row)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5; 3 per ablation row)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script itself")
    parser.add_argument("--kernels", choices=["eager", "triton", "loss", "auto"], default="eager")
    parser.add_argument("--compile", choices=["none", "layers", "model"], nargs="?", const="layers", default="none")
    parser.add_argument("--attention", choices=["auto", "sdpa", "cudnn", "flex"], default="auto")
    parser.add_argument("--weights", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--data-parallel", choices=["fsdp", "single"], default="fsdp")
    parser.add_argument("--grad-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--checkpoint", choices=["none", "full", "selective"], default="none")
    parser.add_argument("--loss-path", choices=["in_forward", "recompute"], default="in_forward")
    parser.add_argument("--loss-chunk", type=int, default=2048, help="tokens per chunk of the fused loss")
    parser.add_argument("--offload", action="store_true", help="CPU offload of the FSDP units (FSDP rows only)")
    parser.add_argument("--ablation", choices=["dense", "moe"], help="run the ablation rows of this model")
    parser.add_argument("--profile", type=Path, default=None, help="write a Chrome trace of 2 steps per row here")
    parser.add_argument("--rows", default=None, help="ablation rows to run, comma-separated indices (default: all)")
    args = parser.parse_args()
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    ctx = DistributedContext.build(MeshDegrees(dp_shard=-1), device=args.device)
    dp = ctx.world_size
    if args.ablation:
        args.model = args.ablation
        wanted = [int(index) for index in args.rows.split(",")] if args.rows else range(len(ABLATION))
        rows = [ABLATION[index] for index in wanted]
        warmup, steps = args.warmup or 3, args.steps or 8
    else:
        rows, warmup, steps = [row_from_args(args)], args.warmup or 5, args.steps or 20
    tokens = (2 * 64) if args.tiny else BATCH[args.model][0] * BATCH[args.model][1]
    if ctx.is_main_process:
        name = torch.cuda.get_device_name() if ctx.device.type == "cuda" else "cpu"
        print(f"# {name}, torch {torch.__version__}; {args.model}, {dp} GPU(s), {tokens} tokens per GPU per step")
        print(f"# warmup {warmup}, timed {steps} steps; bf16 compute, AdamW lr 1e-4 wd 0.1, clip 1.0")
        print("| run | GPUs | tokens/s | tokens/s per GPU | MFU | peak memory (rank 0) | row time |")
        print("|---|---|---|---|---|---|---|", flush=True)
    failed = False
    for row in rows:
        started = time.perf_counter()
        try:
            profile_dir = args.profile / f"row-{ABLATION.index(row) if args.ablation else 0}" if args.profile else None
            result = run_row(
                ctx, row, model_name=args.model, warmup=warmup, steps=steps, tiny=args.tiny, profile_dir=profile_dir
            )
        except Exception as error:
            failed = True
            if ctx.is_main_process:
                print(
                    f"| {row.name} ({row.describe()}) | failed: {type(error).__name__}: {str(error)[:300]} |",
                    flush=True,
                )
            if not args.ablation:
                raise
            result = None
        if result is None:
            release_memory(ctx.device)  # after the except block: its traceback held the failed row's tensors
            continue
        if ctx.is_main_process:
            print(
                f"| {row.name} ({row.describe()}) | {dp} | {result.tokens_per_second:,.0f} "
                f"| {result.tokens_per_second / dp:,.0f} | {result.mfu:.1%} | {result.peak_gib:.1f} GiB "
                f"| {time.perf_counter() - started:.0f} s |",
                flush=True,
            )
    ctx.close()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
