"""A rank's compute actions replayed as CUDA graphs (`PipelineExecutor(cuda_graphs=True)`, design note 0028).

Per training program and batch signature (runtime/static_batches.py): the first step runs eagerly (warm-up:
allocator, Triton autotuning, NCCL communicators); the next captures every compute action (`F`, `B`, `I`, `W`) in
program order into its own `torch.cuda.CUDAGraph`, all sharing one memory pool, and replays each right after
capturing it (capture records, it does not compute); later steps only replay. Sends and receives stay eager between
the graphs. Graphs that share a pool must replay in capture order, which a program's fixed action order gives, so
the pool reuses memory exactly as the eager step did; the `W` graphs read the saved tensors of their `F` and `I`
graphs at the addresses they had when captured.

What crosses a graph's boundary is static: the batches (copied into per-micro-batch buffers each step), the
receive buffers (one per receive action; the receive writes there), the tensors the sends read (a graph's outputs),
the loss scale (a device scalar filled each step: token-weighted losses change it), the loss and metric sums
(float64 device scalars the last stage's graphs add into, read once after the step) and the parameter gradients:
each parameter that got a gradient in the warm-up step gets a preallocated `.grad`, into which autograd's
accumulator (and the weight-gradient store's `addmm_`) adds in place. The Trainer sets `.grad` to None before each
step; the executor then attaches its zeroed static gradient (a `.grad` left by the caller is copied in, so
accumulation across calls stays as eager). The optimizer updates parameters in place, so their addresses hold; a
parameter whose storage moved (re-materialised, loaded with a new tensor) makes the program warm up and capture
again, as a batch of another signature does (at most `MAX_CAPTURES` captures per program).

What the first version does not capture runs eagerly with a one-line reason, logged once per reason: a CPU device,
FSDP-wrapped stages, modules that declare `pipeline_cuda_graphs_unsupported` (d9d-models' MoE layers: their dispatch
reads group sizes on the host), parameters with post-accumulate-grad hooks (gradient buckets of data-parallel
replication), metrics that are Python numbers, and an `F` whose capture raises (a host sync inside the forward):
that action reruns eagerly, the rest of the step runs eagerly and the program stays eager. A backward or weight
action whose capture raises cannot be rerun (autograd freed its graph), so that error is raised with the advice to
turn `cuda_graphs` off. Forward-only programs always run eagerly.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from d9d.pipeline.program import Action, ActionKind, Program
from d9d.pipeline.runtime.outcome import StepOutcome
from d9d.pipeline.runtime.p2p import ReceiveHandle
from d9d.pipeline.runtime.static_batches import BatchSignature, StaticBatches, batch_signature, signature_mismatch

if TYPE_CHECKING:
    from d9d.pipeline.runtime.executor import PipelineExecutor, _RankPlan, _Step

logger = logging.getLogger(__name__)

UNSUPPORTED_ATTRIBUTE = "pipeline_cuda_graphs_unsupported"
"""A module (or submodule) of a stage with this attribute set to a reason keeps its pipeline eager."""
MAX_CAPTURES = 4  # captures of one program (the first and re-captures after a changed signature) before it stays eager


class CaptureRefused(RuntimeError):
    """Raised inside a capture for something a graph would replay wrongly (the executor then falls back)."""


class StaticSums:
    """The step's loss and metric sums as float64 device scalars that the captured last-stage forwards add into."""

    def __init__(self, metric_names: Sequence[str], device: torch.device) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.metrics = {name: torch.zeros((), dtype=torch.float64, device=device) for name in metric_names}

    def zero(self) -> None:
        torch._foreach_zero_([self.loss, *self.metrics.values()])

    def add(self, loss: torch.Tensor, metrics: Any) -> None:
        """`loss` (float64, detached) and a `LossResult`'s metrics; the eager step's sums in the same order."""
        self.loss.add_(loss)
        for name, value in metrics.items():
            total = self.metrics.get(name)
            if total is None:
                raise CaptureRefused(f"metric {name!r} was not among the warm-up step's metrics {sorted(self.metrics)}")
            if not isinstance(value, torch.Tensor):
                raise CaptureRefused(
                    f"metric {name!r} is a Python {type(value).__name__}: a graph would replay its captured value"
                )
            total.add_(value.detach().to(torch.float64))

    def read(self) -> tuple[float, dict[str, float]]:
        """One device-to-host copy for all sums."""
        values = torch.stack([self.loss, *self.metrics.values()]).tolist()
        return values[0], dict(zip(self.metrics, values[1:], strict=True))


@dataclass
class _Entry:
    """What a replay does at one action of the plan."""

    graph: torch.cuda.CUDAGraph | None = None  # compute: its graph (None: no kernels, nothing to replay)
    waits: tuple[int, ...] = ()  # compute: the receive actions whose data it reads
    deferred: int = 0  # compute: weight-gradient work items its capture ran (the executor's counter)
    buffer: torch.Tensor | None = None  # receive: the static buffer it writes
    sent: torch.Tensor | None = None  # send: the graph output it reads


@dataclass
class _ProgramGraphs:
    """One training program's capture (or its warm-up, before `captured`)."""

    program: Program
    signature: BatchSignature
    metric_names: tuple[str, ...]
    params: list[nn.Parameter]  # those that got a gradient in the warm-up step
    captures: int = 0
    captured: bool = False
    disabled: str | None = None
    static: StaticBatches | None = None
    sums: StaticSums | None = None
    scale: torch.Tensor | None = None
    grads: list[torch.Tensor] = field(default_factory=list)
    addresses: tuple[int, ...] = ()  # the parameters' data pointers when captured
    entries: list[_Entry] = field(default_factory=list)
    pool: Any = None

    def release(self) -> None:
        self.entries, self.grads, self.static, self.sums, self.scale, self.pool = [], [], None, None, None, None
        self.captured = False


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


class ActionGraphs:
    """The CUDA-graph side of one `PipelineExecutor` (see the module docstring)."""

    def __init__(self, executor: PipelineExecutor) -> None:
        self.executor = executor
        self.reason: str | None = None  # the last reason a step ran eagerly (None while graphs run)
        self.captures = 0  # steps captured, over the executor's life
        self.replays = 0  # steps only replayed
        self._programs: dict[int, _ProgramGraphs] = {}
        self._logged: set[str] = set()
        self._static_reason: str | None = None
        self._checked = False
        self._stream: torch.cuda.Stream | None = None

    # Fallback ------------------------------------------------------------------------------------------------------

    def fallback(self, reason: str) -> None:
        """Record why this step runs eagerly; log each reason once."""
        self.reason = reason
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("pipeline rank %d: CUDA graphs off: %s", self.executor.rank, reason)

    def unsupported(self) -> str | None:
        """Why this executor's stages cannot be captured at all (None: they may be)."""
        if not self._checked:
            self._checked, self._static_reason = True, self._find_unsupported()
        return self._static_reason

    def _find_unsupported(self) -> str | None:
        executor = self.executor
        if executor.fsdp_stages:
            return (
                f"stages {list(executor.fsdp_stages)} are FSDP-wrapped: their per-unit all-gathers and streams do not "
                "capture (keep parameters unsharded in the step: replicate, or ZeRO-1/2)"
            )
        for stage, module in executor.modules.items():
            for name, submodule in module.named_modules():
                reason = getattr(submodule, UNSUPPORTED_ATTRIBUTE, None)
                if reason:
                    return f"stage {stage}, {name or type(module).__name__} ({type(submodule).__name__}): {reason}"
            for name, param in module.named_parameters():
                if getattr(param, "_post_accumulate_grad_hooks", None):
                    return (
                        f"stage {stage}, parameter {name} has post-accumulate-grad hooks (data-parallel gradient "
                        "buckets?): they would run once, inside the capture"
                    )
        if executor.device.type != "cuda":
            return f"device {executor.device} is not a CUDA device"
        return None

    def _parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for module in self.executor.modules.values():
            for param in module.parameters():
                seen.setdefault(id(param), param)
        return list(seen.values())

    # Steps ---------------------------------------------------------------------------------------------------------

    def forget(self, program: Program) -> None:
        """Drop `program`'s warm-up or capture and release its graphs and memory pool (it will not run again)."""
        state = self._programs.get(id(program))
        if state is not None and state.program is program:
            state.release()
            del self._programs[id(program)]

    def programs(self) -> tuple[Program, ...]:
        """The programs this holds a warm-up or a capture of."""
        return tuple(state.program for state in self._programs.values())

    def run(
        self, program: Program, plan: _RankPlan, task: Any, batches: Sequence[Any], loss_scale: float
    ) -> StepOutcome | None:
        """Run a training step with graphs (warming up, capturing or replaying); None: run it eagerly."""
        reason = self.unsupported()
        if reason is not None:
            self.fallback(reason)
            return None
        state = self._programs.get(id(program))
        if state is not None and state.program is not program:
            state = None  # another program reused the id
        if state is not None and state.disabled is not None:
            self.fallback(state.disabled)
            return None
        signature = batch_signature(batches)
        captures = 0
        if state is not None:
            changed = signature_mismatch(state.signature, signature)
            if changed is None and state.captured and self._moved(state):
                changed = "a parameter's storage moved since the capture"
            if changed is not None:
                captures = state.captures
                state.release()
                if captures >= MAX_CAPTURES:
                    state.disabled = f"program {program.name!r}: {changed}, after {captures} captures; staying eager"
                    self.fallback(state.disabled)
                    return None
                self.fallback(f"program {program.name!r}: {changed}; warming up and capturing again")
                state = None
        if state is None:
            outcome = self.executor.run_eager(plan, task, batches, loss_scale=loss_scale, training=True)
            params = [param for param in self._parameters() if param.grad is not None]
            self._programs[id(program)] = _ProgramGraphs(
                program, signature, tuple(outcome.metric_sums), params, captures=captures
            )
            self.reason = "warm-up step"
            return outcome
        if not state.captured:
            # A CUDA graph destroyed during another capture breaks that capture (its destruction is refused there
            # and the generator's capture state is left set): collect the garbage of dropped executors first, and
            # let no collection run while capturing.
            gc.collect()
            enabled = gc.isenabled()
            gc.disable()
            try:
                return self._capture(state, plan, task, batches, loss_scale)
            finally:
                if enabled:
                    gc.enable()
        return self._replay(state, plan, batches, loss_scale)

    def _moved(self, state: _ProgramGraphs) -> bool:
        return tuple(param.data_ptr() for param in state.params) != state.addresses

    def _prepare(self, state: _ProgramGraphs, loss_scale: float) -> None:
        """Fill the step's scalars and attach the static gradients (zeroed where the caller cleared `.grad`)."""
        assert state.scale is not None
        assert state.sums is not None
        state.scale.fill_(loss_scale)
        state.sums.zero()
        cleared = []
        for param, grad in zip(state.params, state.grads, strict=True):
            current = param.grad
            if current is None:
                cleared.append(grad)
                param.grad = grad
            elif current is not grad:
                grad.copy_(current)
                param.grad = grad
        if cleared:
            torch._foreach_zero_(cleared)

    def _capture(
        self, state: _ProgramGraphs, plan: _RankPlan, task: Any, batches: Sequence[Any], loss_scale: float
    ) -> StepOutcome:
        executor, device = self.executor, self.executor.device
        # Every peer has finished the previous step's messages (the step ends with a collective), so a device
        # synchronisation here cannot wait on a peer. Releasing the eager step's cached blocks lets the pool take them.
        torch.cuda.empty_cache()
        state.static = StaticBatches(batches, device)
        state.scale = torch.empty((), dtype=torch.float32, device=device)
        state.sums = StaticSums(state.metric_names, device)
        state.grads = [torch.zeros_like(param) for param in state.params]
        state.pool = torch.cuda.graph_pool_handle()
        state.captures += 1
        self._prepare(state, loss_scale)
        step = executor.new_step(state.static.batches, state.scale, plan, sums=state.sums)
        comm = executor.communicator()
        entries = [_Entry() for _ in plan.actions]
        receive_at: dict[tuple[str, int, int], int] = {}
        failed: str | None = None
        for index, action in enumerate(plan.actions):
            entry = entries[index]
            if not action.kind.is_compute:
                assert comm is not None, f"{action} in a single-rank program"
                # Kept for the replays: each receive's buffer (the receive writes there again), each send's tensor.
                message = executor._communicate(action, task, step, comm, plan.peers[index])
                if action.kind is ActionKind.RECV_ACTIVATION or action.kind is ActionKind.RECV_GRADIENT:
                    entry.buffer = message
                    direction = "F" if action.kind is ActionKind.RECV_ACTIVATION else "B"
                    receive_at[(direction, action.stage, action.microbatch)] = index
                else:
                    entry.sent = message
                continue
            needed = executor.wait_received(action, step)  # before the capture, which cannot wait on NCCL's events
            entry.waits = tuple(receive_at[key] for key in needed)
            before = executor.deferred_weight_gradients
            if failed is not None or _launches_nothing(action):
                executor._compute(action, task, step)
            else:
                failed = self._capture_compute(state, action, task, step, entry)
            entry.deferred = executor.deferred_weight_gradients - before
        if comm is not None:
            comm.wait_all()
        loss_sum, metric_sums = state.sums.read()
        failed = failed or self._check_gradients(state)
        if failed is not None:
            state.release()
            state.disabled = failed
            self.fallback(failed)
        else:
            state.entries, state.captured = entries, True
            state.addresses = tuple(param.data_ptr() for param in state.params)
            self.captures += 1
            self.reason = None
        return StepOutcome(loss_sum=loss_sum, metric_sums=metric_sums)

    def _capture_compute(
        self, state: _ProgramGraphs, action: Action, task: Any, step: _Step, entry: _Entry
    ) -> str | None:
        """Capture one compute action and replay it; a forward whose capture raises reruns eagerly (the reason is
        returned: the rest of the step runs eagerly)."""
        executor = self.executor
        before, snapshot = executor.deferred_weight_gradients, step.snapshot()
        try:
            entry.graph = self._capture_action(state, lambda: executor._compute(action, task, step))
        except Exception as error:
            if action.kind is not ActionKind.FORWARD:
                raise RuntimeError(
                    f"pipeline rank {executor.rank}: capturing {action} as a CUDA graph failed ({_first_line(error)}); "
                    "a backward cannot be rerun eagerly: set cuda_graphs=False"
                ) from error
            failed = f"program {state.program.name!r}: capturing {action} failed ({_first_line(error)})"
            self.fallback(failed)
            step.restore(snapshot)
            executor.deferred_weight_gradients = before
            executor._compute(action, task, step)  # eagerly, as the rest of this step
            return failed
        if entry.graph is not None:
            entry.graph.replay()
        return None

    def _check_gradients(self, state: _ProgramGraphs) -> str | None:
        """After a capture: every gradient must have gone into the static tensors (else replays would lose it)."""
        static = {id(param) for param in state.params}
        for param, grad in zip(state.params, state.grads, strict=True):
            if param.grad is not grad:
                return f"program {state.program.name!r}: a parameter's .grad was replaced during the capture"
        for param in self._parameters():
            if param.grad is not None and id(param) not in static:
                return (
                    f"program {state.program.name!r}: a {list(param.shape)} parameter got a gradient in the capture "
                    "but none in the warm-up step"
                )
        return None

    def _capture_action(self, state: _ProgramGraphs, body: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
        """Capture `body` on a side stream (the legacy default stream cannot capture) into the state's pool; None
        when it launched nothing. Not `torch.cuda.graph`: it synchronises the device on entry, which would wait for
        receives whose senders wait for this rank."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.executor.device)  # type: ignore[no-untyped-call]
        stream, main = self._stream, torch.cuda.current_stream(self.executor.device)
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            # thread_local: only this thread's unsafe calls break the capture, not NCCL's watchdog thread
            graph.capture_begin(pool=state.pool, capture_error_mode="thread_local")
            try:
                body()
            except BaseException:
                with contextlib.suppress(Exception):
                    graph.capture_end()
                raise
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                graph.capture_end()
        main.wait_stream(stream)
        empty = False
        for warning in caught:
            if "empty" in str(warning.message).lower():
                empty = True
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        return None if empty else graph

    def _replay(self, state: _ProgramGraphs, plan: _RankPlan, batches: Sequence[Any], loss_scale: float) -> StepOutcome:
        assert state.static is not None
        assert state.sums is not None
        executor = self.executor
        state.static.fill(batches)
        self._prepare(state, loss_scale)
        comm = executor.communicator()
        pending: dict[int, ReceiveHandle] = {}
        for index, (action, entry) in enumerate(zip(plan.actions, state.entries, strict=True)):
            if action.kind.is_compute:
                for receive in entry.waits:
                    pending.pop(receive).wait()
                if entry.graph is not None:
                    with executor.action_range(action):
                        entry.graph.replay()
                executor.deferred_weight_gradients += entry.deferred
                continue
            assert comm is not None
            if entry.buffer is not None:
                pending[index] = comm.recv(entry.buffer, plan.peers[index])
            else:
                assert entry.sent is not None, action
                comm.send(entry.sent.contiguous(), plan.peers[index])
        if comm is not None:
            comm.wait_all()
        self.replays += 1
        self.reason = None
        loss_sum, metric_sums = state.sums.read()
        return StepOutcome(loss_sum=loss_sum, metric_sums=metric_sums)


def _launches_nothing(action: Action) -> bool:
    """The first stage's input-gradient pass does nothing: its weight pass is the whole backward."""
    return action.kind is ActionKind.BACKWARD_INPUT and action.stage == 0
