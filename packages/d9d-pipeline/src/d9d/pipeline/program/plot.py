"""Draw simulated timelines to a PNG (needs matplotlib: `pip install 'd9d-pipeline[plot]'`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from d9d.pipeline.program.actions import ActionKind
from d9d.pipeline.program.replay import Timeline

COLOURS = {
    ActionKind.FORWARD: "#4c78a8",
    ActionKind.BACKWARD: "#f58518",
    ActionKind.BACKWARD_INPUT: "#e45756",
    ActionKind.BACKWARD_WEIGHT: "#54a24b",
}


def plot_timelines(timelines: Sequence[tuple[str, Timeline]], path: Path | str) -> Path:
    """One row of bars per rank and one panel per (title, timeline); the bubble fraction in each title.

    Raises:
        ImportError: matplotlib is not installed, naming the extra that installs it.
    """
    try:
        import matplotlib as mpl

        mpl.use("Agg")  # files only; never a window
        from matplotlib import pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError("plotting timelines needs matplotlib; `pip install 'd9d-pipeline[plot]'`") from error
    figure, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.1 + 0.42 * sum(len(t.ranks) for _, t in timelines)))
    panels = axes if len(timelines) > 1 else [axes]
    for axis, (title, timeline) in zip(panels, timelines, strict=True):
        for rank, items in timeline.ranks.items():
            for item in items:
                axis.barh(
                    rank, item.end - item.start, left=item.start, color=COLOURS[item.action.kind], edgecolor="white"
                )
                width = item.end - item.start
                if width >= 0.3:
                    axis.text(
                        item.start + width / 2,
                        rank,
                        str(item.action.microbatch),
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white",
                    )
        axis.set_yticks(sorted(timeline.ranks), [f"rank {rank}" for rank in sorted(timeline.ranks)])
        axis.invert_yaxis()
        axis.set_xlim(0, timeline.makespan)
        axis.set_title(f"{title}: bubble {timeline.bubble_fraction:.1%}", fontsize=9, loc="left")
    panels[-1].set_xlabel("time (forward of a whole rank's layers = 1)")
    legend = [Patch(color=colour, label=kind.name.lower().replace("_", " ")) for kind, colour in COLOURS.items()]
    figure.legend(handles=legend, loc="upper right", ncol=4, fontsize=7)
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
