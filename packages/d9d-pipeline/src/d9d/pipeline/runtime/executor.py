"""The executor: runs one rank's program of a step on its stage modules.

It is an interpreter over `Action`s (a `match` per kind) and the only code that communicates. Activations received
from another rank become leaf tensors that require grad, so backward ends at the stage boundary and their `.grad`
(full backward) or the input gradient of a split backward is what goes back. Consecutive stages on one rank hand
tensors over directly. Sends and receives are posted without blocking; a compute waits only for its own input.

Split backward (`BACKWARD_INPUT` / `BACKWARD_WEIGHT`) runs through the weight-gradient store by default
(runtime/weight_store.py, design note 0024): the forwards of the split micro-batches of stages with an input are
marked so the deferrable ops record their deferrable node, `I` is one ordinary backward and `W` runs the queue.
`split_backward="graph"` (or `D9D_PIPELINE_SPLIT_BACKWARD=graph`) selects the graph-walk split instead
(runtime/split_backward.py), which also defers what the store cannot (tensor-parallel linears, expert-parallel
experts) at the host cost of walking the graph. The first stage has no input gradient to send: under both its `I`
does nothing and its `W` is the whole backward, which also takes stage 1's gradient (waits for it) only then.

`cuda_graphs=True` replays the compute actions of training steps as CUDA graphs after a warm-up step and a capture
step (runtime/cuda_graphs.py, design note 0028); what it cannot capture runs this interpreter with a logged reason.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import nn

from d9d.core.loop.protocols import LossResult
from d9d.pipeline.program import Action, ActionKind, Program, StageLayout
from d9d.pipeline.runtime.action_timing import ActionTimer
from d9d.pipeline.runtime.cuda_graphs import ActionGraphs, StaticSums
from d9d.pipeline.runtime.fsdp_reduction import DeferredReduction, fsdp_roots
from d9d.pipeline.runtime.outcome import StepOutcome
from d9d.pipeline.runtime.p2p import Communicator, ReceiveHandle
from d9d.pipeline.runtime.split_backward import WeightGradientWork, backward_input, backward_weight
from d9d.pipeline.runtime.weight_store import (
    WeightGradientStore,
    deferring_weight_gradients,
    store_backward_input,
    store_backward_weight,
)
from d9d.pipeline.stage import PipelineStage
from d9d.pipeline.task import PipelineTask

Key = tuple[int, int]  # (stage, micro-batch)
_BACKWARDS = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT})
SplitBackward = Literal["store", "graph"]
SPLIT_BACKWARD_ENV = "D9D_PIPELINE_SPLIT_BACKWARD"


def resolve_split_backward(value: str | None = None) -> SplitBackward:
    """`value`, else `$D9D_PIPELINE_SPLIT_BACKWARD`, else "store"; anything else is refused naming the choices."""
    source = "split_backward"
    if value is None:
        value, source = os.environ.get(SPLIT_BACKWARD_ENV, "store"), SPLIT_BACKWARD_ENV
    for choice in get_args(SplitBackward):
        if value == choice:
            return choice  # type: ignore[no-any-return]
    raise ValueError(f"{source}={value!r} is not a split backward; valid: {', '.join(get_args(SplitBackward))}")


def check_channel_groups(backend: str, device: torch.device, *, separate: bool) -> None:
    """Refuse one group for both directions (`separate=False`) where the pipeline group's `backend` runs `device`'s
    messages on NCCL: programs order each channel (sender -> receiver) on its own, and NCCL would run a pair's two
    channels on one stream in issue order, which can deadlock (design note 0026). gloo matches each direction on its
    own, so it may share."""
    if separate or device.type == "cpu" or "nccl" not in backend.lower():
        return
    raise ValueError(
        f"PipelineExecutor: upstream_group=None (or the pipeline group itself) on a pipeline group with backend "
        f"{backend!r} on device {device}: NCCL needs a second group over the same ranks for the messages to lower "
        "pipeline ranks (d9d.pipeline.pipeline_upstream_group(ctx); build_pipeline_schedule passes it), since programs "
        "order each direction between two ranks on its own (design note 0026)"
    )


@dataclass(frozen=True)
class _RankPlan:
    """What a step derives from its program for this rank, computed once per program (callers reuse a program per
    (schedule, shape); `PipelineSchedule` caches them)."""

    actions: tuple[Action, ...]
    split: frozenset[Key]  # the (stage, micro-batch)s whose backward the program splits
    reductions: Mapping[int, int]  # action index -> the FSDP stage whose deferred reduction finishes there
    peers: tuple[int, ...]  # per action, the pipeline rank of a communication's peer (-1 for compute)


_PLANS_KEPT = 8  # programs whose plans an executor keeps (training, evaluation, a few batch shapes)


@dataclass
class _Step:
    batches: Sequence[Any]
    loss_scale: float | torch.Tensor  # a device scalar when captured (runtime/cuda_graphs.py)
    training: bool
    outcome: StepOutcome = field(default_factory=StepOutcome)
    # The losses summed on the device: a `float()` per micro-batch would wait for the GPU each time and let the
    # host fall behind the kernels it should be queueing; read once at the end of the step.
    loss_total: torch.Tensor | None = None
    inputs: dict[Key, torch.Tensor | None] = field(default_factory=dict)  # stage inputs (leaves when received)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # activation, or the scaled loss on the last
    received: dict[tuple[str, int, int], tuple[torch.Tensor, ReceiveHandle]] = field(default_factory=dict)
    input_grads: dict[Key, torch.Tensor | None] = field(default_factory=dict)  # gradient of a stage's input
    weight_work: dict[Key, WeightGradientWork | WeightGradientStore] = field(default_factory=dict)
    split: frozenset[Key] = frozenset()  # the (stage, micro-batch)s whose backward this program splits
    sums: StaticSums | None = None  # CUDA graphs: the loss and metric sums on the device, instead of the above

    def snapshot(self) -> tuple[dict[Any, Any], ...]:
        """The per-key state an action pops or sets (shallow copies), for rerunning an action whose capture failed."""
        return (
            dict(self.inputs),
            dict(self.outputs),
            dict(self.received),
            dict(self.input_grads),
            dict(self.weight_work),
        )

    def restore(self, snapshot: tuple[dict[Any, Any], ...]) -> None:
        self.inputs, self.outputs, self.received, self.input_grads, self.weight_work = (dict(d) for d in snapshot)


class PipelineExecutor:
    """Runs programs for one pipeline rank holding `modules` (global stage -> module) of `layout`."""

    def __init__(
        self,
        modules: Mapping[int, nn.Module],
        layout: StageLayout,
        *,
        pipeline_rank: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        split_backward: SplitBackward | None = None,
        upstream_group: dist.ProcessGroup | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        expected = set(layout.stages_of(pipeline_rank))
        if set(modules) != expected:
            raise ValueError(
                f"pipeline rank {pipeline_rank} of {layout} must hold stages {sorted(expected)}, got {sorted(modules)}"
            )
        if layout.pp > 1 and group is None:
            raise ValueError(f"pp={layout.pp} needs the pipeline process group")
        self.modules, self.layout, self.rank, self.device = dict(modules), layout, pipeline_rank, device
        self.group = group
        # Messages to lower pipeline ranks travel on `upstream_group` (the same ranks as `group`; runtime/p2p.py,
        # `build.pipeline_upstream_group`), so each channel has its own communicator: programs order each channel's
        # operations, not a pair's (design 0026). Without one, both directions share `group`: gloo matches each
        # direction on its own, but NCCL would run a pair's two channels on one stream in issue order and could
        # deadlock, so it is refused there.
        if group is not None:
            check_channel_groups(str(dist.get_backend(group)), device, separate=upstream_group not in (None, group))
        self._upstream = upstream_group if upstream_group is not None else group
        self.split_backward = resolve_split_backward(split_backward)
        self.deferred_weight_gradients = 0  # work items the store's weight passes ran, over the executor's life
        self._fsdp = {
            stage: DeferredReduction(roots) for stage, module in modules.items() if (roots := fsdp_roots(module))
        }
        self._stages = tuple(PipelineStage(stage, layout.num_stages) for stage in range(layout.num_stages))
        self._plans: dict[int, tuple[Program, _RankPlan]] = {}  # id(program) -> (program, plan); holds the program
        # Training steps replayed as CUDA graphs (runtime/cuda_graphs.py); None: every step runs the interpreter.
        self.graphs = ActionGraphs(self) if cuda_graphs else None
        # Each compute action inside a profiler range named `pp:KIND:sSTAGE:mMICROBATCH`, replayed or not, so a trace
        # shows which action launched which kernels (bench/pipeline_trace.py). Off by default: a range per action
        # costs host time even with no profiler running.
        self.annotate_actions = False

    @property
    def fsdp_stages(self) -> tuple[int, ...]:
        """The stages whose module holds FSDP units."""
        return tuple(sorted(self._fsdp))

    def stage_info(self, stage: int) -> PipelineStage:
        return self._stages[stage]

    def _plan(self, program: Program) -> _RankPlan:
        cached = self._plans.get(id(program))
        if cached is not None and cached[0] is program:
            return cached[1]
        actions = program.for_rank(self.rank)
        split = frozenset(
            (action.stage, action.microbatch) for action in actions if action.kind is ActionKind.BACKWARD_INPUT
        )
        peers = tuple(-1 if action.kind.is_compute else self.layout.rank_of(action.peer_stage()) for action in actions)
        plan = _RankPlan(actions=actions, split=split, reductions=self._reduction_points(actions), peers=peers)
        if len(self._plans) >= _PLANS_KEPT:
            del self._plans[next(iter(self._plans))]
        self._plans[id(program)] = (program, plan)
        return plan

    def forget(self, program: Program) -> None:
        """Drop what this executor keeps for `program` (its rank plan, its CUDA graphs and their memory pool), for a
        program that will not run again (`PipelineSchedule.replan`)."""
        cached = self._plans.get(id(program))
        if cached is not None and cached[0] is program:
            del self._plans[id(program)]
        if self.graphs is not None:
            self.graphs.forget(program)

    def programs_held(self) -> tuple[Program, ...]:
        """The programs this executor keeps state for (rank plans, CUDA graphs)."""
        held = [program for program, _ in self._plans.values()]
        if self.graphs is not None:
            held += [program for program in self.graphs.programs() if all(program is not p for p in held)]
        return tuple(held)

    def run(
        self,
        program: Program,
        task: PipelineTask[Any],
        batches: Sequence[Any],
        *,
        loss_scale: float,
        timer: ActionTimer | None = None,
    ) -> StepOutcome:
        """Run `program`'s actions for this rank. With `timer`, every compute action is timed (`measure_stage_costs`)
        and the step runs the interpreter even where CUDA graphs are on."""
        if len(batches) != program.num_microbatches:
            raise ValueError(
                f"program {program.name!r} is for {program.num_microbatches} micro-batches, got {len(batches)}"
            )
        plan = self._plan(program)
        if self.graphs is not None and program.training and timer is None:
            outcome = self.graphs.run(program, plan, task, batches, loss_scale)
            if outcome is not None:
                return outcome
        return self.run_eager(plan, task, batches, loss_scale=loss_scale, training=program.training, timer=timer)

    def run_eager(
        self,
        plan: _RankPlan,
        task: PipelineTask[Any],
        batches: Sequence[Any],
        *,
        loss_scale: float,
        training: bool,
        timer: ActionTimer | None = None,
    ) -> StepOutcome:
        """The interpreter: every action of `plan` in order."""
        step = _Step(batches=batches, loss_scale=loss_scale, training=training, split=plan.split)
        comm = self.communicator()
        deferred = {index: self._fsdp[stage] for index, stage in plan.reductions.items()} if training else {}
        try:
            for reduction in deferred.values():
                reduction.begin()
            for index, action in enumerate(plan.actions):
                if action.kind.is_compute:
                    with self.action_range(action):
                        if timer is not None:
                            self._timed_compute(action, task, step, timer)
                        else:
                            self._compute(action, task, step)
                else:
                    assert comm is not None, f"{action} in a single-rank program"
                    self._communicate(action, task, step, comm, plan.peers[index])
                if index in deferred:
                    deferred.pop(index).finish()
        finally:
            for reduction in deferred.values():
                reduction.abandon()
        if comm is not None:
            comm.wait_all()
        if step.loss_total is not None:
            step.outcome.loss_sum = float(step.loss_total)
        return step.outcome

    def new_step(self, batches: Sequence[Any], loss_scale: torch.Tensor, plan: _RankPlan, *, sums: StaticSums) -> _Step:
        """A training step's state whose scale and sums live on the device (what captured actions read and write)."""
        return _Step(batches=batches, loss_scale=loss_scale, training=True, split=plan.split, sums=sums)

    def action_range(self, action: Action) -> AbstractContextManager[object]:
        """The profiler range of a compute action under `annotate_actions`, else nothing."""
        if not self.annotate_actions:
            return nullcontext()
        return torch.profiler.record_function(f"pp:{action.kind.name}:s{action.stage}:m{action.microbatch}")

    def communicator(self) -> Communicator | None:
        if self.group is None:
            return None
        assert self._upstream is not None
        return Communicator(self.group, self._upstream)

    def receives_of(self, action: Action) -> tuple[tuple[str, int, int], ...]:
        """The received messages (`_Step.received` keys) a compute action reads."""
        stage, mb = action.stage, action.microbatch
        if action.kind is ActionKind.FORWARD and stage > 0 and self.layout.rank_of(stage - 1) != self.rank:
            return (("F", stage, mb),)
        # A first stage's gradient is read by its W (`_compute`), every other stage's by its I or B.
        reading = (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT if stage == 0 else ActionKind.BACKWARD_INPUT)
        if action.kind in reading and stage != self.layout.last_stage and self.layout.rank_of(stage + 1) != self.rank:
            return (("B", stage, mb),)
        return ()

    def _reduction_points(self, actions: Sequence[Action]) -> dict[int, int]:
        """For each FSDP stage whose backward is split in `actions`: the index of its last backward action, where
        its gradients are reduced (runtime/fsdp_reduction.py). Stages with full backwards reduce as FSDP does."""
        split = {action.stage for action in actions if action.kind is ActionKind.BACKWARD_WEIGHT}
        last: dict[int, int] = {}
        for index, action in enumerate(actions):
            if action.stage in split and action.kind in _BACKWARDS:
                last[action.stage] = index
        return {index: stage for stage, index in last.items() if stage in self._fsdp}

    # Communication -------------------------------------------------------------------------------------------------

    def _communicate(
        self, action: Action, task: PipelineTask[Any], step: _Step, comm: Communicator, peer: int
    ) -> torch.Tensor:
        """Post a send or a receive. Returns what a replay repeats the message over (runtime/cuda_graphs.py): the
        tensor a send reads (a gradient before `.contiguous()`, which a replay applies again), or the buffer a
        receive writes."""
        key = (action.stage, action.microbatch)
        match action.kind:
            case ActionKind.SEND_ACTIVATION:
                activation = step.outputs[key].detach()
                comm.send(activation, peer)
                return activation
            case ActionKind.SEND_GRADIENT:
                grad = step.input_grads.pop(key)
                if grad is None:
                    raise RuntimeError(f"{action}: stage {action.stage}'s input got no gradient (is it used?)")
                comm.send(grad.contiguous(), peer)
                return grad
            case ActionKind.RECV_ACTIVATION:
                spec = task.activation_spec(step.batches[action.microbatch], stage=self.stage_info(action.stage - 1))
                buffer = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
                step.received[("F", *key)] = (buffer, comm.recv(buffer, peer))
                return buffer
            case ActionKind.RECV_GRADIENT:
                buffer = torch.empty_like(step.outputs[key])
                step.received[("B", *key)] = (buffer, comm.recv(buffer, peer))
                return buffer
            case _:
                raise AssertionError(action)

    def _take_received(self, step: _Step, direction: str, key: Key) -> torch.Tensor:
        buffer, pending = step.received.pop((direction, *key))
        pending.wait()
        return buffer

    # Compute -------------------------------------------------------------------------------------------------------

    def wait_received(self, action: Action, step: _Step) -> tuple[tuple[str, int, int], ...]:
        """Wait (on the device stream) for the messages compute `action` reads, ahead of the action itself; returns
        their keys. A timed action's time is then its own, and a capture never waits on NCCL's events."""
        needed = self.receives_of(action)
        for key in needed:
            step.received[key][1].wait()
        return needed

    def _timed_compute(self, action: Action, task: PipelineTask[Any], step: _Step, timer: ActionTimer) -> None:
        """`_compute` bracketed by `timer`, its received inputs waited for first so the time is the action's own."""
        self.wait_received(action, step)
        timer.start(action)
        self._compute(action, task, step)
        timer.stop(action)

    def _compute(self, action: Action, task: PipelineTask[Any], step: _Step) -> None:
        key = (action.stage, action.microbatch)
        match action.kind:
            case ActionKind.FORWARD:
                self._forward(action, task, step)
            case ActionKind.BACKWARD:
                root, grad = self._backward_root(action, step)
                torch.autograd.backward([root], [grad] if grad is not None else None)
                leaf = step.inputs.pop(key)
                self._hand_back(action, step, leaf.grad if leaf is not None else None)
            case ActionKind.BACKWARD_INPUT if action.stage == 0:
                # Nothing to differentiate: the W runs the whole backward and takes stage 1's gradient itself, so no
                # action between the two waits for that message (the replay models it so: program/replay.py).
                step.inputs.pop(key)
            case ActionKind.BACKWARD_INPUT:
                root, grad = self._backward_root(action, step)
                leaf = step.inputs.pop(key)
                if self.split_backward == "store" and leaf is not None:
                    grads, store = store_backward_input([root], [grad], [leaf])
                    step.weight_work[key] = store
                else:  # the graph walk
                    grads, work = backward_input([root], [grad], [leaf] if leaf is not None else [])
                    step.weight_work[key] = work
                self._hand_back(action, step, grads[0] if grads else None)
            case ActionKind.BACKWARD_WEIGHT if action.stage == 0:
                root, grad = self._backward_root(action, step)
                _, work = backward_input([root], [grad], [])  # a first stage's: the whole backward, no walk
                backward_weight(work)
            case ActionKind.BACKWARD_WEIGHT:
                pending = step.weight_work.pop(key)
                if isinstance(pending, WeightGradientStore):
                    self.deferred_weight_gradients += store_backward_weight(pending)
                else:
                    backward_weight(pending)
            case _:
                raise AssertionError(action)

    def _forward(self, action: Action, task: PipelineTask[Any], step: _Step) -> None:
        stage, mb = action.stage, action.microbatch
        hidden: torch.Tensor | None = None
        if stage > 0:
            if self.layout.rank_of(stage - 1) == self.rank:
                hidden = step.outputs[(stage - 1, mb)].detach()
            else:
                hidden = self._take_received(step, "F", (stage, mb))
            if step.training:
                hidden = hidden.requires_grad_()
        step.inputs[(stage, mb)] = hidden
        # Deferrable ops record their deferrable node only where the store will split this backward.
        defer = self.split_backward == "store" and hidden is not None and (stage, mb) in step.split
        with torch.set_grad_enabled(step.training), deferring_weight_gradients() if defer else nullcontext():
            result = task.forward_stage(
                self.modules[stage], step.batches[mb], stage=self.stage_info(stage), hidden=hidden
            )
        if stage == self.layout.last_stage:
            if not isinstance(result, LossResult):
                raise TypeError(f"the last stage's forward_stage must return a LossResult, got {type(result).__name__}")
            loss = result.loss_sum.detach().to(torch.float64)
            if step.sums is not None:  # captured: no host sync inside a graph
                step.sums.add(loss, result.metrics)
            else:
                step.loss_total = loss if step.loss_total is None else step.loss_total + loss
                for name, value in result.metrics.items():
                    step.outcome.metric_sums[name] = step.outcome.metric_sums.get(name, 0.0) + float(value)
            if step.training:
                step.outputs[(stage, mb)] = result.loss_sum * step.loss_scale
        else:
            if not isinstance(result, torch.Tensor):
                raise TypeError(
                    f"stage {stage}'s forward_stage must return the activation tensor, got {type(result).__name__}"
                )
            step.outputs[(stage, mb)] = result

    def _backward_root(self, action: Action, step: _Step) -> tuple[torch.Tensor, torch.Tensor | None]:
        stage, mb = action.stage, action.microbatch
        root = step.outputs.pop((stage, mb))
        if stage == self.layout.last_stage:
            return root, None
        if self.layout.rank_of(stage + 1) == self.rank:
            grad = step.input_grads.pop((stage + 1, mb))
            if grad is None:
                raise RuntimeError(f"{action}: stage {stage + 1}'s input got no gradient")
            return root, grad
        return root, self._take_received(step, "B", (stage, mb))

    def _hand_back(self, action: Action, step: _Step, grad: torch.Tensor | None) -> None:
        if action.stage > 0:
            step.input_grads[(action.stage, action.microbatch)] = grad
