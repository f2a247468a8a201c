"""One-GPU training-step benchmark of the Qwen3 anchor shapes (../shared/reference/anchors.md): dense and MoE.

Each step is forward + backward (per-token chunked cross-entropy summed / token count) + gradient clipping at 1.0 +
AdamW, on synthetic uniform-random tokens, with bf16 parameters and optimizer state (no fp32 master copy), no
activation checkpointing and no torch.compile. After `--warmup` steps, `--steps` steps are timed one by one (CUDA
synchronised around each); the row reports the median tokens/s, MFU over 989 TFLOP/s (H100 SXM dense bf16) with
the anchors' FLOPs-per-token formula, and the peak allocated GPU memory of the whole run.

    python bench/model_step.py                      # both anchors on the current GPU, prints markdown rows
    python bench/model_step.py --model moe --steps 50
    python bench/model_step.py --tiny --device cpu  # a seconds-long smoke run of the script itself
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from anchor_models import DENSE, DENSE_BATCH, MOE, MOE_BATCH, PEAK_TFLOPS, flops_per_token, tiny
from d9d.kernels.attention import ATTENTION_CONFIG_ADAPTER, resolve_attention_config
from d9d.kernels.grouped_mm import GROUPED_MM_CONFIG_ADAPTER, resolve_grouped_mm_config
from d9d.models import DecoderConfig, materialize_
from d9d.models.qwen3 import Qwen3DenseForCausalLM, Qwen3DenseParameters, Qwen3MoeForCausalLM, Qwen3MoeParameters

BATCH = {"dense": DENSE_BATCH, "moe": MOE_BATCH}


@dataclass(frozen=True)
class Result:
    model: str
    tokens_per_step: int
    median_seconds: float
    tokens_per_second: float
    mfu: float
    peak_gib: float
    flops_per_token: float
    parameters: int


def run(name: str, params: Qwen3DenseParameters, config: DecoderConfig, args: argparse.Namespace) -> Result:
    device = torch.device(args.device)
    batch, seq = (2, 64) if args.tiny else BATCH[name]
    cls = Qwen3MoeForCausalLM if isinstance(params, Qwen3MoeParameters) else Qwen3DenseForCausalLM
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cls(params, config=config)  # type: ignore[arg-type]
    materialize_(model, device)
    model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    generator = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, params.vocab_size, (batch, seq), device=device, generator=generator)
    labels = torch.randint(0, params.vocab_size, (batch, seq), device=device, generator=generator)
    tokens = batch * seq

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        losses = model(ids, labels=labels).losses
        (losses.sum() / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
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
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    per_token = flops_per_token(params, seq)
    return Result(
        model=name,
        tokens_per_step=tokens,
        median_seconds=median,
        tokens_per_second=tokens / median,
        mfu=tokens / median * per_token / (PEAK_TFLOPS * 1e12),
        peak_gib=peak,
        flops_per_token=per_token,
        parameters=sum(p.numel() for p in model.parameters()),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["dense", "moe", "both"], default="both")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention", default=None, help='backend JSON, e.g. \'{"kind": "sdpa"}\' (default: auto)')
    parser.add_argument("--grouped-mm", default=None, help='backend JSON, e.g. \'{"kind": "torch"}\' (default: auto)')
    parser.add_argument("--loss-chunk-size", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script itself")
    args = parser.parse_args()
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    attention = ATTENTION_CONFIG_ADAPTER.validate_json(args.attention) if args.attention else None
    grouped_mm = GROUPED_MM_CONFIG_ADAPTER.validate_json(args.grouped_mm) if args.grouped_mm else None
    config = DecoderConfig(attention=attention, grouped_mm=grouped_mm, loss_chunk_size=args.loss_chunk_size)
    models = {"dense": DENSE, "moe": MOE}
    if args.tiny:
        models = {"dense": tiny(DENSE), "moe": tiny(MOE)}
    names = ["dense", "moe"] if args.model == "both" else [args.model]
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    backends = {
        "attention": resolve_attention_config(attention).kind,
        "grouped_mm": resolve_grouped_mm_config(grouped_mm).kind,
    }
    print(f"# {datetime.date.today()} {device_name}, torch {torch.__version__}, Python {platform.python_version()}")
    print(f"# backends: {backends}; bf16 params + AdamW, no activation checkpointing, no compile")
    print("| run (1 GPU) | tokens/s | MFU | peak memory | median step |")
    print("|---|---|---|---|---|")
    failed = False
    for name in names:
        label = f"d9d 0.1 {name}, eager, bf16 params, AdamW, {backends['attention']}" + (
            f", grouped_mm={backends['grouped_mm']}" if name == "moe" else ""
        )
        try:
            result = run(name, models[name], config, args)
        except Exception as error:  # noqa: BLE001 - report and go on to the next workload (one GPU call runs both)
            print(f"| {label} | failed: {type(error).__name__}: {str(error)[:300]} | | | |", flush=True)
            failed = True
            continue
        finally:
            if args.device == "cuda":
                torch.cuda.empty_cache()
        print(
            f"| {label} | {result.tokens_per_second:,.0f} | {result.mfu:.1%} | {result.peak_gib:.1f} GiB "
            f"| {result.median_seconds * 1000:.0f} ms |",
            flush=True,
        )
        print(f"<!-- {json.dumps(result.__dict__)} -->", flush=True)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
