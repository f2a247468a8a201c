"""`kernel_op`: a torch custom op whose plain eager calls skip the dispatcher and run its Python body directly.

Every Triton kernel piece is a `torch.library.custom_op` (design note 0012): `torch.compile` traces it without a
graph break, its fake implementation propagates shapes, `opcheck` checks it, and dispatch modes (selective activation
checkpointing's policy, `FakeTensorMode`, a profiler's op counter) see one named op. The price is paid on every eager
call too: the dispatcher, the custom op's Python autograd and device kernels and its argument handling cost about
18-46 us of host time per call, against about 1 us for calling the same body (`bench/pipeline_host_overhead.py`). A
transformer layer calls six such ops in forward and ten in backward, on the host's critical path wherever the GPU
outruns it (a pipeline stage of a few layers per micro-batch).

A `KernelOp` is the custom op plus its body. Called from eager code with gradient recording off (inside an
`autograd.Function`'s forward or backward, where the kernels are called) and plain tensors, it runs the body; the op
(which runs the same body, so results are bit-identical) stays what everything that needs it sees:
- with gradient recording on: the op runs its body below autograd, so calling the body would record its torch ops;
- under `torch.compile` tracing (`torch.compiler.is_compiling()`), so graphs keep the opaque op and its fake;
- under any `TorchDispatchMode` (`FakeTensorMode`, `make_fx`/export, selective checkpointing, op counters);
- with a meta tensor (the fake runs) or a tensor subclass among the arguments (its `__torch_dispatch__` runs).
The profiler does not change the path: a profiled step runs what an unprofiled one runs (the pipeline benchmark
measures its bubble on a profiled step), so in a trace a direct call shows as the ops and the kernel launch inside
the body, without the op's name around them (`D9D_KERNEL_OP_CALLS=dispatch` brings the names back).
The op is `KernelOp.op` (also `torch.ops.d9d_kernels.<name>`); `register_fake` registers on it.

`D9D_KERNEL_OP_CALLS=dispatch` (read at import) or `set_kernel_op_calls("dispatch")` sends every call through the
op, as before (to compare, or to rule the direct calls out); `direct`, the default, allows them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Generic, Literal, ParamSpec, TypeVar, get_args

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

P = ParamSpec("P")
R = TypeVar("R")

KernelOpCalls = Literal["direct", "dispatch"]
KERNEL_OP_CALLS_ENV = "D9D_KERNEL_OP_CALLS"
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _calls_from(value: str, source: str) -> KernelOpCalls:
    for choice in get_args(KernelOpCalls):
        if value == choice:
            return choice  # type: ignore[no-any-return]
    raise ValueError(f"{source}={value!r} is not a kernel-op call mode; valid: {', '.join(get_args(KernelOpCalls))}")


_direct_calls = _calls_from(os.environ.get(KERNEL_OP_CALLS_ENV, "direct"), KERNEL_OP_CALLS_ENV) == "direct"


def set_kernel_op_calls(mode: KernelOpCalls) -> None:
    """`direct`: plain eager calls run the body (the default); `dispatch`: every call goes through the op."""
    global _direct_calls  # noqa: PLW0603 - one process-wide switch, read on every call
    _direct_calls = _calls_from(mode, "mode") == "direct"


def kernel_op_calls() -> KernelOpCalls:
    """The current call mode (`set_kernel_op_calls`)."""
    return "direct" if _direct_calls else "dispatch"


def _direct_call_allowed(args: tuple[Any, ...]) -> bool:
    """True when nothing could observe the difference between the body and the op (see the module docstring)."""
    if not _direct_calls or torch.is_grad_enabled() or torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return False
    for arg in args:  # noqa: SIM110 - a loop, not all(generator): this runs on every kernel call
        if isinstance(arg, torch.Tensor) and (type(arg) not in _PLAIN or arg.is_meta):
            return False
    return True


class KernelOp(Generic[P, R]):
    """`torch.library.custom_op(name, mutates_args=())(body)` whose plain eager calls run `body` directly."""

    def __init__(self, name: str, body: Callable[P, R]) -> None:
        self.name = name
        self.body = body
        self.op = torch.library.custom_op(name, mutates_args=())(body)

    def register_fake(self, fake: Callable[P, R]) -> Callable[P, R]:
        """Register `fake` as the op's fake (meta) implementation; usable as a decorator."""
        self.op.register_fake(fake)
        return fake

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if not kwargs and _direct_call_allowed(args):
            return self.body(*args)  # type: ignore[call-arg]  # kwargs is empty here
        result: R = self.op(*args, **kwargs)
        return result


def kernel_op(name: str) -> Callable[[Callable[P, R]], KernelOp[P, R]]:
    """Decorator: `@kernel_op("d9d_kernels::x")` over the body, as `@torch.library.custom_op(..., mutates_args=())`
    (the body must not mutate its arguments: the op declares none)."""

    def wrap(body: Callable[P, R]) -> KernelOp[P, R]:
        return KernelOp(name, body)

    return wrap
