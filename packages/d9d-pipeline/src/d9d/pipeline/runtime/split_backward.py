"""Backward in two halves: input gradients now (`I`), weight gradients later (`W`), through autograd's graph.

The executor's fallback split (`split_backward="graph"`, `D9D_PIPELINE_SPLIT_BACKWARD=graph`); the default is the
weight-gradient store (runtime/weight_store.py, design note 0024), whose `I` is one ordinary backward and whose `W`
runs queued matmuls. This walk costs host time per micro-batch (on a 4-layer anchor stage on an H100 each of `I` and
`W` took a full backward's 11.7 ms of host time, the stage being host-bound) but defers every weight gradient the
graph holds, tensor-parallel (DTensor) linears, expert-parallel experts and the loss head included, which the store
computes in `I`.

`backward_input` runs `torch.autograd.grad` from the stage outputs to the stage inputs only. Before it does, it
walks the graph once and finds the *intermediates*: nodes on the path to the inputs with an edge into a
*weight side* (a part of the graph that leads to parameters but not to the inputs: a matmul's transpose and
accumulator, a norm's weight). Pre-hooks capture the gradients flowing into them. Built-in backward formulas
compute only the gradients someone asked for, so the matmuls' weight halves are skipped here.

`backward_weight` later runs autograd from the intermediates (as `GradientEdge`s seeded with the captured
gradients) to the parameters of their weight sides, and must not redo the input half. Autograd computes an edge
of a node when the edge leads to a requested parameter; rooted at every intermediate with every parameter
requested, each intermediate's edge towards the input would lead to the earlier layers' weights, so one call
recomputed the whole input-gradient chain (every activation and attention backward, the input half of every
matmul): `W` cost a full backward. Instead the intermediates are sorted into *levels*, antichains of the order
"reaches through the input path": an intermediate's level is the most intermediates above it on one path. One
`torch.autograd.backward` per level, rooted at that level's intermediates and asking for the parameters of their
weight sides only, needs no input-path edge: no intermediate of the level reaches another one of it. A stage of L
decoder layers takes about 7L calls (q/k/v, their norms, o, the post-attention norm, gate/up, down), each a short
C++ walk, and runs only the weight halves; `bench/pipeline_split_backward.py` counts both. A parameter reached
from several levels (a weight used twice) gets each level's share once: in that case the other levels'
intermediates are muted (their incoming gradients replaced by None) for the call, so a recomputed path adds
nothing twice. Gradients accumulate into `.grad` through autograd's own accumulators (no extra add or copy).

Custom `autograd.Function`s need no change: they run as intermediates and may compute both halves (correct, only
slower; autograd drops the half nobody asked for); those that read `current_backward_phase()` skip it.

Graph ownership: the executor drops a stage's outputs once `I` has run, so the work must own the graph itself. The
Python object of a built-in node owns its C++ node. That of a custom `autograd.Function` node (every Triton kernel,
the chunked loss, the MoE aux-loss attachment) holds it only through a `weak_ptr` in torch 2.11, the GPU image's
version (2.13 made it an owning pointer): with nothing else holding the graph, `W` met a freed node ("Attribute
'register_prehook' is invalid for this instance of _C._FunctionBase"). `WeightGradientWork.graph_owners` holds each
output's built-in node, or the output itself when its node is a custom one; everything the weight pass visits hangs
below those. That keeps no more than `W` needs anyway: the topmost intermediate reaches almost every node of a stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

from d9d.pipeline.runtime.phase import BackwardPhase, backward_phase


def _node_of(tensor: torch.Tensor) -> Node | None:
    """The node a gradient for `tensor` flows into: its grad_fn, or its (lazily created) accumulator."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if not tensor.requires_grad:
        return None
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


@dataclass
class WeightLevel:
    """One autograd call of the weight pass: roots (seeded edges) and the parameters their weight sides reach."""

    edges: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)  # the intermediates rooted here


@dataclass
class WeightGradientWork:
    """What `I` leaves for `W`: the levels of captured gradients (or the outputs, for a first stage)."""

    levels: list[WeightLevel] = field(default_factory=list)
    whole: bool = False  # a first stage: the weight pass is an ordinary backward (every gradient is used)
    shared: bool = False  # a parameter is reached from several levels: mute the other levels' intermediates
    graph_owners: list[object] = field(default_factory=list)  # keep the nodes above alive until `W` (module doc)

    @property
    def num_calls(self) -> int:
        return sum(1 for level in self.levels if level.edges)


# The node class of every custom `autograd.Function` (and of custom ops' autograd); typed `type` because torch's
# stubs declare it unrelated to `Node`, which it is at run time.
_CUSTOM_FUNCTION_NODE: type = torch.autograd.function.BackwardCFunction


def _graph_owner(tensor: torch.Tensor) -> object:
    """What keeps `tensor`'s autograd graph alive: its node when that is a built-in one (its Python object owns the
    C++ node), the tensor itself otherwise (a custom function's node object does not own it in torch 2.11)."""
    node = tensor.grad_fn
    if node is None or isinstance(node, _CUSTOM_FUNCTION_NODE):
        return tensor
    return node


@dataclass
class _Graph:
    """One walk of the graph below the outputs: children, a post-order, which nodes reach the inputs, and which
    parameters each node off the input path reaches."""

    children: dict[Node, list[Node]]
    post_order: list[Node]
    on_input_path: set[Node]
    params_below: dict[Node, frozenset[Node]]  # only for nodes off the input path
    weight_side: dict[Node, frozenset[Node]]  # the intermediates: the parameters their edges off the path reach


# A leaf's gradient accumulator (its `variable` is the leaf); untyped in torch's stubs.
_ACCUMULATE_GRAD: type = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]


def _walk(roots: Sequence[Node], input_nodes: set[Node], param_ids: set[int] | None) -> _Graph:
    """The walk; a parameter is a leaf's accumulator off the input path (any, or one of `param_ids`), recognised
    by its `variable` (looking up each parameter's accumulator instead costs a view per parameter and
    micro-batch, and under FSDP the graph's leaves are the unsharded parameters, not the module's sharded ones)."""
    children: dict[Node, list[Node]] = {}
    post_order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(root, False) for root in reversed(roots)]
    while stack:  # iterative post-order: the graphs of deep stages overflow Python's recursion
        node, expanded = stack.pop()
        if expanded:
            post_order.append(node)
            continue
        if node in children:
            continue
        below = children[node] = [child for child, _ in node.next_functions if child is not None]
        stack.append((node, True))
        stack.extend((child, False) for child in below if child not in children)
    on_input_path: set[Node] = set()
    params_below: dict[Node, frozenset[Node]] = {}
    weight_side: dict[Node, frozenset[Node]] = {}
    empty: frozenset[Node] = frozenset()
    for node in post_order:
        below = children[node]
        reached = empty
        for child in below:  # the parameters reached through children off the input path
            off_path = params_below.get(child)
            if off_path:
                reached = reached | off_path
        if node in input_nodes or any(child in on_input_path for child in below):
            on_input_path.add(node)
            if reached:
                weight_side[node] = reached
            continue
        if isinstance(node, _ACCUMULATE_GRAD) and (param_ids is None or id(node.variable) in param_ids):  # type: ignore[attr-defined]
            reached = reached | {node}
        params_below[node] = reached
    return _Graph(children, post_order, on_input_path, params_below, weight_side)


def _levels(graph: _Graph) -> dict[Node, int]:
    """Each intermediate's level: the most intermediates strictly above it on one path of the input path (the
    reverse post-order is a topological order, outputs first). An intermediate reaching another has a lower one."""
    above: dict[Node, int] = {}
    level_of: dict[Node, int] = {}
    for node in reversed(graph.post_order):
        if node not in graph.on_input_path:
            continue
        depth = above.get(node, 0)
        if node in graph.weight_side:
            level_of[node] = depth
            depth += 1
        for child in graph.children[node]:
            if child in graph.on_input_path and above.get(child, -1) < depth:
                above[child] = depth
    return level_of


def _first_stage_work(
    outputs: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor], params: Sequence[torch.Tensor] | None
) -> WeightGradientWork:
    """No stage input: the weight pass is the whole backward, one ordinary call (every gradient is used)."""
    work = WeightGradientWork(graph_owners=[_graph_owner(tensor) for tensor in outputs], whole=True)
    level = WeightLevel(params=list(params) if params is not None else [])
    for tensor, seed in zip(outputs, seeds, strict=True):
        if (node := _node_of(tensor)) is not None:
            level.edges.append(GradientEdge(node, tensor.output_nr))
            level.grads.append(seed)
    work.levels.append(level)
    return work


def _fill_levels(
    work: WeightGradientWork,
    graph: _Graph,
    level_of: dict[Node, int],
    captured: dict[Node, tuple[torch.Tensor | None, ...]],
    seeded_outputs: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Each level's roots (the captured gradients), and the parameters its weight sides reach."""
    reached_by: dict[Node, set[int]] = {}
    for node, index in level_of.items():
        work.levels[index].nodes.append(node)
        for param_node in graph.weight_side[node]:
            reached_by.setdefault(param_node, set()).add(index)
    for node, node_grads in captured.items():
        level = work.levels[level_of[node]]
        for index, grad in enumerate(node_grads):
            if grad is not None:
                level.edges.append(GradientEdge(node, index))
                level.grads.append(grad)
    # Outputs whose graph never meets an input (e.g. a loss term of parameters only) start the weight pass too;
    # they reach no intermediate, so the first level can take them.
    for tensor, seed in seeded_outputs:
        root = _node_of(tensor)
        if root is not None and root not in graph.on_input_path and graph.params_below.get(root):
            work.levels[0].edges.append(GradientEdge(root, tensor.output_nr))
            work.levels[0].grads.append(seed)
            for param_node in graph.params_below[root]:
                reached_by.setdefault(param_node, set()).add(0)
    for param_node, levels in reached_by.items():
        for index in levels:
            work.levels[index].params.append(param_node.variable)  # type: ignore[attr-defined]
    work.shared = any(len(levels) > 1 for levels in reached_by.values())


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor | None], WeightGradientWork]:
    """Gradients of `inputs` (None where not reached) and the work `backward_weight` needs.

    `params`: the parameters whose gradients the weight pass accumulates; None (what the executor passes) means
    every leaf the outputs reach besides `inputs`, exactly what a full backward would accumulate into, and the only
    choice under FSDP, whose graph holds the unsharded parameters instead of the module's sharded ones.
    """
    seeds = [
        grad if grad is not None else torch.ones_like(out) for out, grad in zip(outputs, grad_outputs, strict=True)
    ]
    input_nodes = {node for node in map(_node_of, inputs) if node is not None}
    if not input_nodes:
        return [None] * len(inputs), _first_stage_work(outputs, seeds, params)
    roots = [node for node in map(_node_of, outputs) if node is not None]
    graph = _walk(roots, input_nodes, None if params is None else {id(param) for param in params})
    level_of = _levels(graph)
    work = WeightGradientWork(graph_owners=[_graph_owner(tensor) for tensor in outputs])
    work.levels = [WeightLevel() for _ in range(max(level_of.values(), default=0) + 1)]
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def capture(node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            captured[node] = grads

        return hook

    handles = [node.register_prehook(capture(node)) for node in level_of]
    try:
        wanted = [tensor for tensor in inputs if tensor.requires_grad]
        with backward_phase(BackwardPhase.INPUT):
            grads = torch.autograd.grad(list(outputs), wanted, seeds, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    _fill_levels(work, graph, level_of, captured, list(zip(outputs, seeds, strict=True)))
    by_input = dict(zip(map(id, wanted), grads, strict=True))
    return [by_input.get(id(tensor)) for tensor in inputs], work


# `torch.autograd.backward` checks every seed against its root (shape, dtype, device: Python-level symbolic-shape
# comparisons, ~0.1-0.3 ms a call) before it calls the engine through this function. The weight pass makes ~7 calls
# per decoder layer and per micro-batch with seeds autograd itself produced, so it calls the engine directly; the
# public function is the fallback where a torch lacks it (it has existed since 2.4, the GPU image runs 2.11).
_ENGINE_RUN_BACKWARD: Callable[..., object] | None = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _run_engine(level: WeightLevel, *, retain_graph: bool) -> None:
    """Accumulate one level's weight gradients into `.grad` (autograd's accumulators: no extra add or copy)."""
    if _ENGINE_RUN_BACKWARD is None:
        torch.autograd.backward(level.edges, level.grads, inputs=level.params or None, retain_graph=retain_graph)
        return
    _ENGINE_RUN_BACKWARD(
        tuple(level.edges),
        tuple(level.grads),
        retain_graph,
        False,  # noqa: FBT003 - create_graph, positional in the engine's signature
        tuple(level.params),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _mute(grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    return tuple(None for _ in grads)


def backward_weight(work: WeightGradientWork, params: Sequence[torch.Tensor] | None = None) -> None:
    """Accumulate the weight gradients into the parameters' `.grad` (the second half of `backward_input`).

    `params` is ignored (each level knows the parameters it reaches; kept so both halves take the same
    arguments); a parameter a micro-batch never reached (an expert no token chose) keeps its gradient.
    """
    del params
    levels = [level for level in work.levels if level.edges and (level.params or work.whole)]
    with backward_phase(BackwardPhase.FULL if work.whole else BackwardPhase.WEIGHT):
        for index, level in enumerate(levels):
            handles = []
            if work.shared:
                handles = [
                    node.register_prehook(_mute) for other in levels if other is not level for node in other.nodes
                ]
            try:
                _run_engine(level, retain_graph=index < len(levels) - 1)
            finally:
                for handle in handles:
                    handle.remove()
    work.levels.clear()
    work.graph_owners.clear()
