"""FSDP under a split backward: a stage's gradients are reduce-scattered once, after its last weight gradient.

FSDP2 reduce-scatters a module's gradients in its post-backward hook, which autograd fires when the gradient
reaches the module's inputs. In a split backward that is the input pass (`I`): the weight gradients do not exist
yet (the weight pass, `W`, comes later and never reaches the module inputs, so no hook fires for it). So for the
stages whose program splits backward the executor switches the stage's FSDP roots to accumulation for the step
(`set_requires_gradient_sync(False)`, `set_reshard_after_backward(False)`, `set_is_last_backward(False)`: `I` and
`W` add into the unsharded parameters' `.grad`), and right after the stage's last backward action of the step it
switches them back and runs FSDP's post-backward of every parameter group (reduce-scatter into the sharded
gradients, then reshard) and the root's final callback (wait for the reductions) itself, as
`torch.distributed.pipelining` does after a stage's last backward.

Per micro-batch, for such a stage: `F` all-gathers the parameters and (with `reshard_after_forward`, the default)
reshards them after; `I` all-gathers them again (it needs the weights for the input gradients) and keeps them
unsharded until the next `F` reshards; `W` needs no parameter (only saved activations and captured gradients)
and adds into the unsharded gradients. No reduce-scatter until the stage's last `W`: one per step instead of one
per micro-batch, at the memory of one unsharded gradient of the stage.

This reaches into FSDP2's state (`fully_shard.state`, its parameter groups' `post_backward`, the root's final
callback): the only way to run the post-backward outside autograd, and what torch's own pipelining does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard


def fsdp_roots(module: nn.Module) -> list[FSDPModule]:
    """The outermost FSDP modules in `module` (`module` itself when it is one)."""
    roots: list[FSDPModule] = []

    def visit(node: nn.Module) -> None:
        if isinstance(node, FSDPModule):
            roots.append(node)
            return
        for child in node.children():
            visit(child)

    visit(module)
    return roots


def _param_groups(state: Any) -> Iterator[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.8: a list
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)  # earlier: one group or None
        groups = [group] if group is not None else []
    yield from groups


class DeferredReduction:
    """Switches a stage's FSDP roots to accumulation for a step (`begin`) and reduces once at the end (`finish`)."""

    def __init__(self, roots: list[FSDPModule]) -> None:
        self.roots = roots
        self.active = False

    def begin(self) -> None:
        for root in self.roots:
            root.set_is_last_backward(False)
            root.set_reshard_after_backward(False)
            root.set_requires_gradient_sync(False)
        self.active = True

    def _restore(self) -> None:
        for root in self.roots:
            root.set_is_last_backward(True)
            root.set_reshard_after_backward(True)
            root.set_requires_gradient_sync(True)
        self.active = False

    def finish(self) -> None:
        """Reduce-scatter the accumulated gradients into the sharded ones and reshard (after the stage's last W)."""
        self._restore()
        for root in self.roots:
            state = fully_shard.state(root)  # type: ignore[attr-defined]
            for inner in state._state_ctx.all_states:
                for group in _param_groups(inner):
                    group.post_backward()
            state._root_post_backward_final_callback()

    def abandon(self) -> None:
        """A step that failed part-way: restore FSDP's defaults without reducing."""
        if self.active:
            self._restore()
