"""Host work per pipeline action: one stage's F, I (store), W (store) and full B, with the kernel ops called through
the dispatcher and directly.

A pipeline stage of a few layers per micro-batch is host-bound when the host takes longer to queue an action than
the GPU takes to run it (ZBV on 4 x H200, issue 16: 22 ms of host for an I of 5 layers whose kernels take 8.5 ms).
This script times the host side of each action of a middle stage (no embedding, no head) of the dense anchor
(bench/anchor_models.py), as the executor runs it: `F` a forward marked for the weight-gradient store (design note
0024), `I store` / `W store` its split backward, `B` an unmarked forward's full backward (timed without the forward).
Each pass is timed with the Triton kernel pieces called through `torch.library` dispatch (`dispatch`, the only
path before `kernel_op`) and directly (`direct`, `kernel_op`'s eager path); the two alternate within every repeat, so
drift on a shared machine hits both alike. Also printed: kernel-op calls per layer and per pass, and with
`--profile` the top host functions (cProfile) of one direct F and I; with `--calls` the host time of single calls
(the RMSNorm forward op dispatched against its body called directly; an autograd function's `apply` with and
without a separate `setup_context`, next to `F.linear`).

On CPU (`D9D_DEVICE=cpu`) the Triton kernels cannot run natively: the script sets `TRITON_INTERPRET=1` and replaces
the kernels' launches with nothing (`--kernels triton`, the default): every other piece of host work (the launcher's
allocations and arguments, the ops, autograd, the store) is real, the kernels' outputs are left uninitialised, and
the times are the host work around the launches, not a step's. `--kernels eager` uses the eager references instead
(no kernel ops at all). On a GPU every kernel launches; host time is then measured up to the queueing (no sync).
CPU times are the calling thread's CPU time with one intra-op thread (`torch.set_num_threads(1)`): with two
threads on a shared 2-core machine the matmuls wait on each other and dominate, and wall time counts the time other
processes hold the cores.

    D9D_DEVICE=cpu python bench/pipeline_host_overhead.py --tiny                # seconds on CPU
    D9D_DEVICE=cpu python bench/pipeline_host_overhead.py --tiny --profile 15   # + the top host functions
    D9D_DEVICE=cpu python bench/pipeline_host_overhead.py --tiny --calls        # + single calls' host time
    python bench/pipeline_host_overhead.py --layers 5                           # one GPU, ZBV's 5-layer stage
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ON_CPU = os.environ.get("D9D_DEVICE") == "cpu"
if ON_CPU:  # before d9d imports Triton (in main): its kernels decorate for the interpreter at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

MODES = ("dispatch", "direct")
PASSES = ("F", "I store", "W store", "B")


class _Unlaunched:
    """A Triton kernel whose launch does nothing (CPU host-time runs only: see the module docstring)."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        del grid
        return lambda *args, **kwargs: None


def skip_triton_launches() -> int:
    """Replace the jitted kernels of the dense layer's Triton modules with `_Unlaunched`; how many were replaced."""
    from d9d.kernels.rms_norm import triton_kernels as rms_norm
    from d9d.kernels.rope import triton_kernels as rope
    from d9d.kernels.swiglu import triton_kernels as swiglu

    replaced = 0
    for module in (rms_norm, rope, swiglu):
        for name, value in list(vars(module).items()):
            if name.startswith("_") and name.endswith("_kernel") and type(value).__module__.startswith("triton"):
                setattr(module, name, _Unlaunched())
                replaced += 1
    return replaced


def decoder_config(kernels: str) -> Any:
    """The `DecoderConfig` with every dense-layer kernel family on `kernels`."""
    from d9d.kernels.rms_norm import EagerRmsNormConfig, TritonRmsNormConfig
    from d9d.kernels.rope import EagerRopeConfig, TritonRopeConfig
    from d9d.kernels.swiglu import EagerSwiGluConfig, TritonSwiGluConfig
    from d9d.models import DecoderConfig

    if kernels == "triton":
        return DecoderConfig(rms_norm=TritonRmsNormConfig(), swiglu=TritonSwiGluConfig(), rope=TritonRopeConfig())
    return DecoderConfig(rms_norm=EagerRmsNormConfig(), swiglu=EagerSwiGluConfig(), rope=EagerRopeConfig())


# On CPU the calling thread's CPU time: everything runs on it (one intra-op thread, CPU autograd runs backward on
# the caller), and unlike wall time it does not count the time other processes of a shared machine hold the cores.
# On a GPU wall time: queueing can also block (a full launch queue), which is host time the GPU waits for.
_CLOCK = time.thread_time if ON_CPU else time.perf_counter


def host_seconds(fn: Callable[[], Any]) -> tuple[Any, float]:
    began = _CLOCK()
    result = fn()
    return result, _CLOCK() - began


class CallCounter:
    """Counts `KernelOp` calls while installed (an untimed pass; nothing on sources without `KernelOp`)."""

    def __init__(self, kernel_op_class: Any) -> None:
        self.calls = 0
        self._class = kernel_op_class
        self._original = kernel_op_class.__call__ if kernel_op_class is not None else None

    def __enter__(self) -> CallCounter:
        original = self._original
        if original is None:
            return self

        def counting(op: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(op, *args, **kwargs)

        self._class.__call__ = counting
        return self

    def __exit__(self, *exc: object) -> None:
        if self._original is not None:
            self._class.__call__ = self._original


class _WithSetupContext(torch.autograd.Function):
    """`F.linear` as an autograd function with a separate `setup_context` (the deferrable linear's old form)."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        del output
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


class _WithCtx(torch.autograd.Function):
    """The same with `forward(ctx, ...)` (the deferrable linear's form now)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


def per_call_microseconds(device: torch.device, dtype: torch.dtype, calls: int = 5000) -> dict[str, float]:
    """Host us per call (median): the RMSNorm forward kernel op dispatched and its body called directly, and an
    autograd function's `apply` with and without `setup_context` next to plain `F.linear`."""
    from d9d.kernels.rms_norm import ops

    x = torch.randn(4, 128, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(128, 128, device=device, dtype=dtype, requires_grad=True)
    norm_weight = torch.ones(128, device=device, dtype=dtype)
    rows = x.detach()

    def median_us(fn: Callable[[], Any]) -> float:
        for _ in range(100):
            fn()
        samples = []
        for _ in range(calls):
            began = _CLOCK()
            fn()
            samples.append(_CLOCK() - began)
        return statistics.median(samples) * 1e6

    with torch.no_grad():
        op = median_us(lambda: ops._forward_op.op(rows, None, norm_weight, 1e-6, dtype))
        body = median_us(lambda: ops._forward_op.body(rows, None, norm_weight, 1e-6, dtype))
    return {
        "rms_norm_forward op": op,
        "rms_norm_forward body": body,
        "apply, setup_context": median_us(lambda: _WithSetupContext.apply(x, weight)),
        "apply, forward(ctx)": median_us(lambda: _WithCtx.apply(x, weight)),
        "F.linear": median_us(lambda: torch.nn.functional.linear(x, weight)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU)")
    parser.add_argument("--layers", type=int, default=5, help="layers of the stage (5: ZBV's stage at pp=4, 32 layers)")
    parser.add_argument("--rows", type=int, default=1, help="rows per micro-batch")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 64 tiny, else 4096)")
    parser.add_argument("--kernels", choices=("triton", "eager"), default="triton")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", type=int, default=0, help="print this many top host functions of F and I")
    parser.add_argument("--calls", action="store_true", help="also time single calls (kernel op, function apply)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    from anchor_models import DENSE, tiny
    from d9d.models import materialize_
    from d9d.models.qwen3 import Qwen3DenseForCausalLM
    from d9d.pipeline import PipelineStage, deferring_weight_gradients, store_backward_input, store_backward_weight

    try:
        from d9d.kernels import triton_support

        kernel_op_class: Any = triton_support.KernelOp
        set_kernel_op_calls: Any = triton_support.set_kernel_op_calls
    except AttributeError:  # sources before `kernel_op` (a baseline run on an older tree): every kernel call dispatches
        kernel_op_class, set_kernel_op_calls = None, None

    device = torch.device(os.environ.get("D9D_DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and not ON_CPU:
        parser.error("no GPU here: run on CPU with D9D_DEVICE=cpu (it sets up Triton's interpreter)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    launches = "real" if args.kernels == "triton" else "none: eager references"
    if device.type == "cpu":
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)  # the skipped kernels leave outputs uninitialised
        if args.kernels == "triton":
            launches = f"skipped ({skip_triton_launches()} kernels)"
    seq = args.seq or (64 if args.tiny else 4096)
    params = (tiny(DENSE) if args.tiny else DENSE).model_copy(update={"num_layers": 3 * args.layers})
    with torch.device("meta"):
        module = Qwen3DenseForCausalLM(params, config=decoder_config(args.kernels), stage=PipelineStage(1, 3))
    materialize_(module, device)
    module = module.to(dtype)
    torch.manual_seed(0)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def forward(*, deferring: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        x = torch.randn(args.rows, seq, params.hidden_size, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        sync()
        with deferring_weight_gradients(deferring):  # as the executor marks the forwards the store will split
            out, host = host_seconds(lambda: module(None, hidden_states=x).hidden_states)
        return x, out, grad, host

    def passes() -> dict[str, float]:
        """One split micro-batch (F, I, W) and one full-backward micro-batch (B): host seconds of each."""
        x, out, grad, f_host = forward(deferring=True)
        sync()
        (_, store), i_host = host_seconds(functools.partial(store_backward_input, [out], [grad], [x]))
        del out
        sync()
        _, w_host = host_seconds(functools.partial(store_backward_weight, store))
        module.zero_grad(set_to_none=True)
        x, out, grad, _ = forward(deferring=False)
        sync()
        _, b_host = host_seconds(functools.partial(torch.autograd.backward, [out], [grad]))
        sync()
        module.zero_grad(set_to_none=True)
        return {"F": f_host, "I store": i_host, "W store": w_host, "B": b_host}

    calls: dict[str, int] = {}
    for name, run in (
        ("F", lambda: forward(deferring=True)),
        ("B", lambda: torch.autograd.backward(*forward(deferring=False)[1:3])),
    ):
        with CallCounter(kernel_op_class) as counter:
            run()
        calls[name] = counter.calls - calls.get("F", 0)  # B's count ran a forward first
        module.zero_grad(set_to_none=True)
    modes = MODES if set_kernel_op_calls is not None else MODES[:1]

    def set_mode(mode: str) -> None:
        if set_kernel_op_calls is not None:
            set_kernel_op_calls(mode)

    samples: dict[str, dict[str, list[float]]] = {mode: {name: [] for name in PASSES} for mode in MODES}
    for mode in modes:  # warm-up: the autotuners and allocator caches of both
        set_mode(mode)
        passes()
    for _ in range(args.repeats):
        for mode in modes:
            set_mode(mode)
            for name, seconds in passes().items():
                samples[mode][name].append(seconds)
    set_mode("direct")
    print(
        f"# {device} {dtype}, middle stage of {args.layers} layers, {args.rows} x {seq} tokens, {args.kernels} "
        f"kernels (launches {launches}); kernel-op calls per layer: F {calls['F'] / args.layers:g}, "
        f"B {calls['B'] / args.layers:g}; median of {args.repeats}"
    )
    print("| pass | host ms, dispatch | host ms, direct | saved | per layer, dispatch | per layer, direct |")
    print("|---|---|---|---|---|---|")
    rows = []
    for name in PASSES:
        before = statistics.median(samples["dispatch"][name]) * 1e3
        after = statistics.median(samples["direct"][name] or samples["dispatch"][name]) * 1e3
        rows.append({"pass": name, "dispatch_ms": before, "direct_ms": after, "layers": args.layers})
        print(
            f"| {name} | {before:.2f} | {after:.2f} | {1 - after / before:.0%} | {before / args.layers:.2f} | "
            f"{after / args.layers:.2f} |"
        )
    if args.calls and kernel_op_class is not None and args.kernels == "triton":
        print("\n| one call | host us |\n|---|---|")
        for name, value in per_call_microseconds(device, dtype).items():
            print(f"| {name} | {value:.1f} |")
    if args.profile:
        for name, run in (("F", lambda: forward(deferring=True)), ("I store", None)):
            profiler = cProfile.Profile()
            if run is None:
                x, out, grad, _ = forward(deferring=True)
                profiler.runcall(store_backward_input, [out], [grad], [x])
            else:
                profiler.runcall(run)
            module.zero_grad(set_to_none=True)
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
            print(f"\n## cProfile, direct {name} (tottime)\n" + text.getvalue().split("\n\n", 1)[-1].strip())
    if args.json:
        with Path(args.json).open("w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
