"""Describing outputs that are pure rearrangements of input regions, so they can be assembled in place.

Fusing q/k/v or stacking experts moves bytes and computes nothing. A region plan that says so, as a list of
`Copy`s, lets the reader read each input region straight into its place in the output buffer: no input tensors, no
`torch.stack`/`torch.cat` copy, and memory for the outputs only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from d9d.states.meta import Box, box_numel


@dataclass(frozen=True)
class Copy:
    """The elements of `source[source_box]` are those of `target[target_box]`, in the same row-major order.

    Both boxes have the same shape once their size-1 dimensions are dropped, and the remaining dimensions correspond
    in order: a copy may add or drop unit dimensions (stack, squeeze), never reorder (transpose) or reshape.
    """

    source: str
    source_box: Box
    target: str
    target_box: Box

    def renamed(self, *, source: str | None = None, target: str | None = None) -> Copy:
        return replace(self, source=source or self.source, target=target or self.target)


def _paired_dims(first: Box, second: Box) -> list[tuple[int, int]]:
    a = [dim for dim, (start, stop) in enumerate(first) if stop - start != 1]
    b = [dim for dim, (start, stop) in enumerate(second) if stop - start != 1]
    if len(a) != len(b) or any(
        first[i][1] - first[i][0] != second[j][1] - second[j][0] for i, j in zip(a, b, strict=True)
    ):
        raise ValueError(f"boxes {first} and {second} are not the same elements in the same order")
    return list(zip(a, b, strict=True))


def compose(first: Copy, second: Copy) -> Copy | None:
    """The part of `first.source` that lands in `second.target` via `first.target` (`== second.source`)."""
    middle = tuple(
        (max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(first.target_box, second.source_box, strict=True)
    )
    if any(stop <= start for start, stop in middle):
        return None
    source_box = list(first.source_box)
    for a, b in _paired_dims(first.source_box, first.target_box):
        offset = first.source_box[a][0] - first.target_box[b][0]
        source_box[a] = (middle[b][0] + offset, middle[b][1] + offset)
    target_box = list(second.target_box)
    for b, c in _paired_dims(second.source_box, second.target_box):
        offset = second.target_box[c][0] - second.source_box[b][0]
        target_box[c] = (middle[b][0] + offset, middle[b][1] + offset)
    return Copy(first.source, tuple(source_box), second.target, tuple(target_box))


def covers(copies: Iterable[Copy], wanted: Mapping[str, Box]) -> bool:
    """Whether `copies` fill exactly the `wanted` boxes (by element count; copies never overlap by construction)."""
    filled = dict.fromkeys(wanted, 0)
    for copy in copies:
        if copy.target not in filled:
            return False
        filled[copy.target] += box_numel(copy.target_box)
    return all(filled[name] == box_numel(box) for name, box in wanted.items())
