"""Every d9d kernel against eager PyTorch and `torch.compile` of the eager reference, at the anchor shapes.

Shapes (../shared/reference/anchors.md): hidden 1024, 4 x 4096 tokens, vocabulary 151,936, q/k 16/8 heads of 128,
dense FFN 3072; MoE 2 x 4096 tokens top-8 over 64 experts (65,536 routed rows, skewed: the busiest expert gets 4.5x
the mean), expert FFN 768. Each row times forward + backward (the optimizer step: one step) as the median of
`--iters` runs after `--warmup`, and reports the rate against the card's limits: TFLOP/s against 750 (bf16 GEMM
measured on the H100) for matmul kernels, GB/s against 3000 (device copy) for memory-bound ones, where the bytes are
the minimum a fused implementation must move (each input read once, each output written once, forward and
backward), the same count for every implementation, so the rates compare directly. Peak memory is what the call
allocates above its inputs.

    python bench/kernels.py --json kernels.json               # anchor shapes on the current GPU (~3 minutes)
    python bench/kernels.py --only rms_norm,grouped_mm        # a subset
    python bench/kernels.py --only linear --loss-chunks 2048,4096   # the fused loss rows at two chunk sizes
    python bench/kernels.py --only "stochastic adamw"         # the optimizer step rows (one tensor; whole model)
    python bench/kernels.py --tiny --json /tmp/k.json         # seconds on CPU: Triton's interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

GEMM_TFLOPS, COPY_GBPS = 750.0, 3000.0  # the anchors card's measured ceilings (H100 80GB HBM3)


@dataclass(frozen=True)
class Shapes:
    tokens: int
    hidden: int
    ffn: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    moe_tokens: int
    top_k: int
    experts: int
    expert_ffn: int
    adamw_elements: int


ANCHOR = Shapes(16384, 1024, 3072, 16, 8, 128, 151936, 8192, 8, 64, 768, 64 * 2**20)
TINY = Shapes(64, 64, 96, 4, 2, 16, 300, 32, 2, 4, 48, 4096)


@dataclass
class Row:
    kernel: str
    implementation: str
    shape: str
    median_ms: float
    rate: float
    unit: str
    fraction_of_limit: float
    peak_extra_mib: float


def skewed_sizes(rows: int, experts: int, ratio: float = 4.5) -> list[int]:
    """Deterministic per-expert row counts summing to `rows` whose busiest expert is about `ratio` x the mean."""
    low, high = 0.0, 20.0
    for _ in range(60):  # bisect the decay of exp(-a * i / E) so that max / mean == ratio
        decay = (low + high) / 2
        weights = torch.exp(-decay * torch.arange(experts, dtype=torch.float64) / experts)
        low, high = (decay, high) if weights[0] / weights.mean() < ratio else (low, decay)
    sizes = (weights / weights.sum() * rows).floor().long()
    sizes[0] += rows - int(sizes.sum())
    return sizes.tolist()


class Timer:
    def __init__(self, device: torch.device, warmup: int, iters: int) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, float]:
        """(median milliseconds, peak MiB allocated above what was live before)."""
        for _ in range(self.warmup):
            fn()
        self.sync()
        base = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        times = []
        for _ in range(self.iters):
            start = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - start) * 1e3)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if self.device.type == "cuda" else float("nan")
        return statistics.median(times), peak


def fwd_bwd(fn: Callable[..., Any], inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable[[], None]:
    """A closure running `fn(*inputs)` and backward with `grads` (inputs needing grad get fresh .grad each time)."""

    def run() -> None:
        for tensor in inputs:
            tensor.grad = None
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(list(outs), grads[: len(outs)])

    return run


def leaf(shape: tuple[int, ...], device: torch.device, *, scale: float = 1.0, grad: bool = True) -> torch.Tensor:
    return (torch.randn(shape, device=device) * scale).to(torch.bfloat16).requires_grad_(grad)


def compiled(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    return torch.compile(fn, backend=backend, dynamic=False)


Case = tuple[str, str, str, Callable[[], None], float, str]


DEFAULT_LOSS_CHUNK = 4096


def cases(
    s: Shapes, device: torch.device, compile_backend: str, loss_chunks: tuple[int, ...] = (DEFAULT_LOSS_CHUNK,)
) -> list[Case]:
    """(kernel, implementation, shape, run, work, unit): work in FLOPs (unit TFLOP/s) or bytes (unit GB/s)."""
    from d9d.kernels.grouped_mm import EagerGroupedMm, TorchGroupedMm, TritonGroupedMm
    from d9d.kernels.linear_cross_entropy import EagerLinearCrossEntropy, TritonLinearCrossEntropy
    from d9d.kernels.linear_cross_entropy import linear_cross_entropy_reference as ce_reference
    from d9d.kernels.moe_permute import EagerMoePermute, TritonMoePermute, sort_by_expert
    from d9d.kernels.rms_norm import TritonRmsNorm, rms_norm_reference
    from d9d.kernels.rope import TritonRope, rope_reference
    from d9d.kernels.swiglu import TritonSwiGlu, swiglu_reference

    out: list[Case] = []

    def add(kernel: str, shape: str, impls: dict[str, Callable[[], None]], work: float, unit: str) -> None:
        out.extend((kernel, name, shape, run, work, unit) for name, run in impls.items())

    # RMSNorm with the residual add: y, h = norm(x + r), x + r.
    n, h = s.tokens, s.hidden
    x, r, w = leaf((n, h), device), leaf((n, h), device), leaf((h,), device)
    grads = [leaf((n, h), device, grad=False), leaf((n, h), device, grad=False)]

    def rms_eager(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_reference(x, w, eps=1e-6, residual=r)

    triton_rms = TritonRmsNorm()
    add(
        "rms_norm+residual",
        f"{n}x{h}",
        {
            "eager": fwd_bwd(rms_eager, [x, r, w], grads),
            "compile(eager)": fwd_bwd(compiled(rms_eager, compile_backend), [x, r, w], grads),
            "triton": fwd_bwd(lambda x, r, w: triton_rms(x, w, eps=1e-6, residual=r), [x, r, w], grads),
        },
        8 * n * h * 2,
        "GB/s",
    )

    # SwiGLU activation on the dense FFN.
    gate, up = leaf((n, s.ffn), device), leaf((n, s.ffn), device)
    grads = [leaf((n, s.ffn), device, grad=False)]
    triton_swiglu = TritonSwiGlu()
    add(
        "swiglu",
        f"{n}x{s.ffn}",
        {
            "eager": fwd_bwd(swiglu_reference, [gate, up], grads),
            "compile(eager)": fwd_bwd(compiled(swiglu_reference, compile_backend), [gate, up], grads),
            "triton": fwd_bwd(triton_swiglu, [gate, up], grads),
        },
        8 * n * s.ffn * 2,
        "GB/s",
    )

    # RoPE on q and k together.
    batch, seq = 4 if n >= 4 * 4 else 1, n // (4 if n >= 16 else 1)
    q = leaf((batch, seq, s.q_heads, s.head_dim), device)
    k = leaf((batch, seq, s.kv_heads, s.head_dim), device)
    angles = torch.arange(seq, device=device)[:, None] * torch.rand(s.head_dim // 2, device=device)
    angles = torch.cat([angles, angles], dim=-1)[None].expand(batch, seq, s.head_dim)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    grads = [leaf(tuple(q.shape), device, grad=False), leaf(tuple(k.shape), device, grad=False)]

    def rope_eager(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_reference(q, cos, sin), rope_reference(k, cos, sin)

    triton_rope = TritonRope()
    add(
        "rope(q,k)",
        f"q{tuple(q.shape)} k{tuple(k.shape)}",
        {
            "eager": fwd_bwd(rope_eager, [q, k], grads),
            "compile(eager)": fwd_bwd(compiled(rope_eager, compile_backend), [q, k], grads),
            "triton": fwd_bwd(lambda q, k: triton_rope(q, k, cos, sin), [q, k], grads),
        },
        4 * (q.numel() + k.numel()) * 2,
        "GB/s",
    )

    # Fused linear + cross-entropy over the full vocabulary; the caller sums the per-token losses (as every training
    # task does), so the summed rows (gradients computed in forward, backward scales them) do the same work.
    hidden, weight = leaf((n, h), device), leaf((s.vocab, h), device, scale=0.02)
    labels = torch.randint(0, s.vocab, (n,), device=device)
    grads, total_grad = [torch.ones(n, device=device)], [torch.ones((), device=device)]
    eager_ce, triton_ce = EagerLinearCrossEntropy(), TritonLinearCrossEntropy()
    ce_impls = {
        "eager(full logits)": fwd_bwd(lambda a, b: ce_reference(a, b, labels), [hidden, weight], grads),
        "compile(full logits)": fwd_bwd(
            compiled(lambda a, b: ce_reference(a, b, labels), compile_backend), [hidden, weight], grads
        ),
    }
    for chunk in loss_chunks:
        tag = "" if chunk == DEFAULT_LOSS_CHUNK else f", chunk {chunk}"
        ce_impls |= {
            f"eager(chunked{tag})": fwd_bwd(
                lambda a, b, c=chunk: eager_ce(a, b, labels, chunk_size=c), [hidden, weight], grads
            ),
            f"triton(chunked{tag})": fwd_bwd(
                lambda a, b, c=chunk: triton_ce(a, b, labels, chunk_size=c), [hidden, weight], grads
            ),
            f"triton(summed, grads in forward{tag})": fwd_bwd(
                lambda a, b, c=chunk: triton_ce.summed(a, b, labels, chunk_size=c).total, [hidden, weight], total_grad
            ),
        }
    add(
        "linear+cross_entropy",
        f"{n}x{h} @ {s.vocab}",
        ce_impls,
        6 * n * h * s.vocab,  # useful matmul work: logits, grad hidden, grad weight (recomputation not counted)
        "TFLOP/s",
    )

    # MoE permute + weighted unpermute.
    t, kk = s.moe_tokens, s.top_k
    tokens = leaf((t, h), device)
    probs = torch.softmax(torch.randn(t, kk, device=device), dim=-1).to(torch.bfloat16).requires_grad_()
    experts = torch.rand(t, s.experts, device=device).argsort(dim=1)[:, :kk]  # k distinct experts per token
    grads = [leaf((t, h), device, grad=False)]

    def routed(permuter: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            order, inverse, _ = sort_by_expert(experts, s.experts)
            return permuter.unpermute(permuter.permute(x, order, kk), inverse, p)

        return run

    add(
        "moe permute+unpermute",
        f"{t} tokens x top-{kk} x {h}",
        {
            "eager": fwd_bwd(routed(EagerMoePermute()), [tokens, probs], grads),
            "compile(eager)": fwd_bwd(compiled(routed(EagerMoePermute()), compile_backend), [tokens, probs], grads),
            "triton": fwd_bwd(routed(TritonMoePermute()), [tokens, probs], grads),
        },
        4 * (t * h + t * kk * h) * 2,
        "GB/s",
    )

    # Grouped GEMM: the expert up-projection x (rows, hidden) -> (rows, expert_ffn), skewed groups.
    rows = t * kk
    sizes = torch.tensor(skewed_sizes(rows, s.experts), device=device)
    xg = leaf((rows, h), device)
    wg = leaf((s.experts, s.expert_ffn, h), device, scale=h**-0.5)
    grads = [leaf((rows, s.expert_ffn), device, grad=False)]

    def grouped(backend: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda a, b: backend(a, b, sizes)

    impls = {
        "eager(loop)": fwd_bwd(grouped(EagerGroupedMm()), [xg, wg], grads),
        "compile(torch._grouped_mm)": fwd_bwd(compiled(grouped(TorchGroupedMm()), compile_backend), [xg, wg], grads),
        "torch._grouped_mm": fwd_bwd(grouped(TorchGroupedMm()), [xg, wg], grads),
        "triton": fwd_bwd(grouped(TritonGroupedMm()), [xg, wg], grads),
    }
    if device.type != "cuda":
        del impls["torch._grouped_mm"], impls["compile(torch._grouped_mm)"]  # bf16 CPU kernel: not the comparison
    try:
        from d9d.kernels.grouped_mm import GroupedGemm

        impls["grouped_gemm"] = fwd_bwd(grouped(GroupedGemm()), [xg, wg], grads)
    except Exception:  # noqa: BLE001 - the optional package is absent: the row is left out
        pass
    add("grouped_gemm", f"E={s.experts} {rows}x{h}->{s.expert_ffn}", impls, 6 * rows * h * s.expert_ffn, "TFLOP/s")

    # Stochastic-rounding AdamW step (bf16 params and grads, float32 moments), one tensor: the per-tensor kernel.
    from d9d.core.optim import StochasticAdamW
    from d9d.kernels.adamw import register_triton_stochastic_adamw

    register_triton_stochastic_adamw(multi_tensor=False)
    step_impls = {}
    for name, fused in (("eager", False), ("triton", True)):
        param = torch.nn.Parameter(torch.randn(s.adamw_elements, device=device).to(torch.bfloat16))
        param.grad = torch.randn_like(param)
        optimizer = StochasticAdamW([param], fused=fused, lr=1e-4)
        step_impls[name] = optimizer.step
    add("stochastic adamw step", f"{s.adamw_elements} bf16 params", step_impls, 22 * s.adamw_elements, "GB/s")
    out.extend(model_adamw_cases(s, device))
    return out


def model_adamw_cases(s: Shapes, device: torch.device) -> list[Case]:
    """The optimizer step over a whole model's parameters (the dense anchor's 311 tensors; tiny: its tiny shape).

    Timed as wall time with a device sync after each step, so the host time of a per-parameter Python loop counts:
    with hundreds of parameters it exceeds the update's device time, and the device idles. Rows: torch's fused
    AdamW on float32 parameters (the Trainer's float32-master-weights path), the Triton step per parameter and the
    multi-tensor Triton step (one launch per bucket) on bfloat16 parameters, and the multi-tensor step on float32.
    Bytes: bf16 params and grads with float32 moments move 22 B per element (read 12, write 10), float32 ones 28.
    """
    from anchor_models import DENSE, parameter_shapes, tiny
    from d9d.core.optim import StochasticAdamW
    from d9d.kernels.adamw import register_triton_stochastic_adamw

    shapes = parameter_shapes(DENSE if s == ANCHOR else tiny(DENSE))
    elements = sum(torch.Size(shape).numel() for shape in shapes)
    label = f"{len(shapes)} tensors, {elements / 1e6:,.1f}M params"
    kernel = "stochastic adamw step (multi-tensor)"

    def model(dtype: torch.dtype) -> list[torch.nn.Parameter]:
        params = [torch.nn.Parameter(torch.randn(shape, device=device).to(dtype)) for shape in shapes]
        for param in params:
            param.grad = torch.randn_like(param)
        return params

    def stochastic(params: list[torch.nn.Parameter], *, multi_tensor: bool) -> Callable[[], Any]:
        register_triton_stochastic_adamw(multi_tensor=multi_tensor)  # read when the optimizer is built
        return StochasticAdamW(params, fused=True, lr=1e-4).step

    bf16, fp32 = model(torch.bfloat16), model(torch.float32)  # each shared by the rows of its dtype
    implementations = [
        ("torch AdamW fused (fp32 params)", torch.optim.AdamW(fp32, lr=1e-4, fused=True).step, 28 * elements),
        ("triton per-tensor (bf16 params)", stochastic(bf16, multi_tensor=False), 22 * elements),
        ("triton multi-tensor (bf16 params)", stochastic(bf16, multi_tensor=True), 22 * elements),
        ("triton multi-tensor (fp32 params)", stochastic(fp32, multi_tensor=True), 28 * elements),
    ]
    return [(kernel, name, label, run, float(work), "GB/s") for name, run, work in implementations]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes; on CPU the kernels run in the interpreter")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--json", default=None, help="write the rows and the machine here")
    parser.add_argument("--only", default=None, help="comma-separated kernel-name prefixes")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile rows")
    parser.add_argument(
        "--loss-chunks", default=str(DEFAULT_LOSS_CHUNK), help="comma-separated token chunks of the fused-loss rows"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        if not args.tiny:
            parser.error("on CPU only --tiny runs (the Triton kernels run in the interpreter there)")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shapes = TINY if args.tiny else ANCHOR
    warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 5)
    iters = args.iters if args.iters is not None else (1 if args.tiny else 20)
    timer = Timer(device, warmup, iters)
    torch.manual_seed(0)
    wanted = args.only.split(",") if args.only else None
    rows: list[Row] = []
    print("| kernel | implementation | shape | ms (fwd+bwd) | rate | of limit | peak extra MiB |")
    print("|---|---|---|---|---|---|---|")
    loss_chunks = tuple(int(chunk) for chunk in args.loss_chunks.split(","))
    for kernel, impl, shape, run, work, unit in cases(shapes, device, args.compile_backend, loss_chunks):
        if wanted and not any(kernel.startswith(prefix) for prefix in wanted):
            continue
        try:
            ms, peak = timer(run)
        except Exception as error:  # noqa: BLE001 - one failing implementation must not hide the others' rows
            print(f"| {kernel} | {impl} | {shape} | failed: {type(error).__name__}: {str(error)[:80]} | | | |")
            continue
        rate = work / (ms / 1e3) / (1e12 if unit == "TFLOP/s" else 1e9)
        limit = GEMM_TFLOPS if unit == "TFLOP/s" else COPY_GBPS
        rows.append(Row(kernel, impl, shape, ms, rate, unit, rate / limit, peak))
        memory = "n/a" if peak != peak else f"{peak:,.0f}"  # NaN on CPU: no allocator statistics
        print(f"| {kernel} | {impl} | {shape} | {ms:.3f} | {rate:,.1f} {unit} | {rate / limit:.1%} | {memory} |")
        sys.stdout.flush()
    if args.json:
        machine = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
            "shapes": asdict(shapes),
            "limits": {"gemm_tflops": GEMM_TFLOPS, "copy_gbps": COPY_GBPS},
        }
        report = {"machine": machine, "rows": [asdict(row) for row in rows]}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
