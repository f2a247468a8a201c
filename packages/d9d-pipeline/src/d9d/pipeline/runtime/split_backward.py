"""Backward in two halves: input gradients now (`I`), weight gradients later (`W`), through autograd's graph.

`backward_input` runs `torch.autograd.grad` from the stage outputs to the stage inputs only. Before it does, it
finds the *intermediates*: graph nodes on the path to the inputs that also have an edge into a part of the graph
that leads to parameters but not to the inputs. Pre-hooks capture the gradients flowing into those nodes. Built-in
backward formulas compute only the gradients someone asked for, so the matmuls' weight halves are skipped here.

`backward_weight` later runs `torch.autograd.grad` from those nodes (as `GradientEdge`s, seeded with the captured
gradients) to the parameters. An intermediate may also sit downstream of another; a pre-hook then *replaces* what
flows into it by its captured gradient, so nothing is counted twice. Custom `autograd.Function`s need no change:
they run in both passes and may compute both halves (correct, only slower); those that read
`current_backward_phase()` skip the half nobody uses.

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


def _reaching(roots: Sequence[Node], targets: set[Node]) -> set[Node]:
    """Nodes reachable from `roots` from which some node of `targets` is reachable (targets included)."""
    memo: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:  # iterative post-order: the graphs of deep stages overflow Python's recursion
        node, expanded = stack.pop()
        if node in memo and not expanded:
            continue
        children = [child for child, _ in node.next_functions if child is not None]
        if expanded:
            memo[node] = node in targets or any(memo.get(child, False) for child in children)
            continue
        memo.setdefault(node, False)
        stack.append((node, True))
        stack.extend((child, False) for child in children if child not in memo)
    return {node for node, reaches in memo.items() if reaches}


@dataclass
class WeightGradientWork:
    """What `I` leaves for `W`: captured gradients at the intermediates (or the outputs, for a first stage)."""

    edges: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    replace: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    whole: bool = False  # a first stage: the weight pass is an ordinary backward (every gradient is used)
    graph_owners: list[object] = field(default_factory=list)  # keep the nodes above alive until `W` (module doc)


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


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradientWork]:
    """Gradients of `inputs` (None where not reached) and the work `backward_weight` needs for `params`."""
    roots = [node for node in map(_node_of, outputs) if node is not None]
    input_nodes = {node for node in map(_node_of, inputs) if node is not None}
    param_nodes = {node for node in map(_node_of, params) if node is not None}
    work = WeightGradientWork(graph_owners=[_graph_owner(tensor) for tensor in outputs])
    if not input_nodes:  # a first stage: no input gradient; the weight pass is the whole backward
        work.whole = True
        work.edges = [GradientEdge(node, tensor.output_nr) for tensor in outputs if (node := _node_of(tensor))]
        work.grads = [
            grad if grad is not None else torch.ones_like(tensor)
            for tensor, grad in zip(outputs, grad_outputs, strict=True)
        ]
        return [None] * len(inputs), work
    on_input_path = _reaching(roots, input_nodes)
    to_params = _reaching(roots, param_nodes)
    intermediates = [
        node
        for node in on_input_path
        if any(
            child is not None and child in to_params and child not in on_input_path for child, _ in node.next_functions
        )
    ]
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def capture(node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            captured[node] = grads

        return hook

    handles = [node.register_prehook(capture(node)) for node in intermediates]
    try:
        seeds = [
            grad if grad is not None else torch.ones_like(out) for out, grad in zip(outputs, grad_outputs, strict=True)
        ]
        wanted = [tensor for tensor in inputs if tensor.requires_grad]
        with backward_phase(BackwardPhase.INPUT):
            grads = torch.autograd.grad(list(outputs), wanted, seeds, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    by_input = dict(zip(map(id, wanted), grads, strict=True))
    for node, node_grads in captured.items():
        for index, grad in enumerate(node_grads):
            if grad is not None:
                work.edges.append(GradientEdge(node, index))
                work.grads.append(grad)
        work.replace[node] = node_grads
    # Outputs whose graph never meets an input (e.g. a loss term of parameters only) start the weight pass too.
    for tensor, seed in zip(outputs, seeds, strict=True):
        node = _node_of(tensor)
        if node is not None and node not in on_input_path and node in to_params:
            work.edges.append(GradientEdge(node, tensor.output_nr))
            work.grads.append(seed)
    return [by_input.get(id(tensor)) for tensor in inputs], work


def backward_weight(work: WeightGradientWork, params: Sequence[torch.Tensor]) -> None:
    """Accumulate the weight gradients of `params` into `.grad` (the second half of `backward_input`)."""
    if not work.edges:
        return
    wanted = [param for param in params if param.requires_grad]
    handles = [node.register_prehook(lambda _incoming, fixed=fixed: fixed) for node, fixed in work.replace.items()]
    try:
        # allow_unused: a parameter this micro-batch never reached (an expert no token chose) gets None
        with backward_phase(BackwardPhase.FULL if work.whole else BackwardPhase.WEIGHT):
            grads: Sequence[torch.Tensor | None] = torch.autograd.grad(
                work.edges, wanted, work.grads, allow_unused=True
            )
    finally:
        for handle in handles:
            handle.remove()
    for param, grad in zip(wanted, grads, strict=True):
        if grad is None:
            continue
        if param.grad is None:
            param.grad = grad
        else:
            param.grad += grad
    work.edges.clear()
    work.grads.clear()
    work.replace.clear()
    work.graph_owners.clear()
