"""The loss-curve PNG of the evaluate stage (matplotlib is optional: `pip install 'd9d-core[plot]'`).

Read at a glance: the training loss and each checkpoint's held-out loss in distinct colours, the legend beside the
plot (never over the data), and an axis that fits the training curve. A held-out loss far outside it (the untrained
base model's 8.3 against a fine-tune curve near 4) goes into a narrow panel of its own above, so it neither squashes
the curve nor disappears.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b")  # tab10, training first


class PlotUnavailable(ImportError):
    """matplotlib is not installed (names the extra that installs it)."""


def split_held_out(
    losses: Mapping[int, float], held_out: Mapping[str, float], *, margin: float = 0.25
) -> tuple[dict[str, float], dict[str, float]]:
    """The held-out losses that fit the training curve's range (widened by `margin` of it), and the others."""
    if not losses:
        return dict(held_out), {}
    low, high = min(losses.values()), max(losses.values())
    slack = margin * max(high - low, 0.1 * abs(high), 1e-6)
    inside = {name: loss for name, loss in held_out.items() if low - slack <= loss <= high + slack}
    return inside, {name: loss for name, loss in held_out.items() if name not in inside}


def plot_loss_curve(
    losses: Mapping[int, float], held_out: Mapping[str, float], path: Path, *, title: str = "pretrain loss"
) -> Path:
    """Training loss per step, with each evaluated checkpoint's held-out loss as a horizontal line."""
    try:
        import matplotlib as mpl

        mpl.use("Agg")  # files only; never a window or a display
        from matplotlib import pyplot as plt
    except ImportError as error:
        raise PlotUnavailable(
            "drawing the loss curve needs matplotlib; install it with `pip install 'd9d-core[plot]'`"
        ) from error
    inside, outside = split_held_out(losses, held_out)
    colours = dict(zip(held_out, COLOURS[1:] * 2, strict=False))
    if outside:
        figure, (top, axes) = plt.subplots(
            2, 1, sharex=True, figsize=(8.5, 4.2), dpi=100, gridspec_kw={"height_ratios": [1, 4], "hspace": 0.08}
        )
    else:
        figure, axes = plt.subplots(figsize=(8.5, 3.6), dpi=100)
    try:
        steps = sorted(losses)
        axes.plot(steps, [losses[step] for step in steps], linewidth=1.4, color=COLOURS[0], label="training loss")
        for name, loss in inside.items():
            axes.axhline(loss, linestyle="--", linewidth=1.3, color=colours[name], label=f"{name}: held-out {loss:.3f}")
        axes.set_xlabel("step")
        axes.set_ylabel("loss (nats per token)")
        axes.grid(alpha=0.3)
        handles, labels = axes.get_legend_handles_labels()
        if outside:
            for name, loss in outside.items():
                top.axhline(
                    loss, linestyle="--", linewidth=1.3, color=colours[name], label=f"{name}: held-out {loss:.3f}"
                )
            values = list(outside.values())
            pad = max(0.05 * max(abs(value) for value in values), 0.05)
            top.set_ylim(min(values) - pad, max(values) + pad)
            top.grid(alpha=0.3)
            top.set_title(title)
            top.spines["bottom"].set_visible(False)
            axes.spines["top"].set_visible(False)
            top.tick_params(bottom=False)
            more_handles, more_labels = top.get_legend_handles_labels()
            handles, labels = handles + more_handles, labels + more_labels
        else:
            axes.set_title(title)
        figure.legend(handles, labels, loc="upper left", bbox_to_anchor=(0.77, 0.9), fontsize="small", frameon=False)
        figure.subplots_adjust(left=0.08, right=0.76, bottom=0.13, top=0.9)
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
    return path
