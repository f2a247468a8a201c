"""The loss-curve PNG of the evaluate stage (matplotlib is optional: `pip install 'd9d-core[plot]'`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


class PlotUnavailable(ImportError):
    """matplotlib is not installed (names the extra that installs it)."""


def plot_loss_curve(
    losses: Mapping[int, float], held_out: Mapping[str, float], path: Path, *, title: str = "pretrain loss"
) -> Path:
    """Training loss per step, with each evaluated checkpoint's held-out loss as a dashed horizontal line."""
    try:
        import matplotlib as mpl

        mpl.use("Agg")  # files only; never a window or a display
        from matplotlib import pyplot as plt
    except ImportError as error:
        raise PlotUnavailable(
            "drawing the loss curve needs matplotlib; install it with `pip install 'd9d-core[plot]'`"
        ) from error
    figure, axes = plt.subplots(figsize=(7, 3.5), dpi=100)
    try:
        steps = sorted(losses)
        axes.plot(steps, [losses[step] for step in steps], linewidth=1.2, label="training loss")
        for (name, loss), style in zip(held_out.items(), ("--", ":", "-.", "--"), strict=False):
            axes.axhline(loss, linestyle=style, linewidth=1.0, color="grey", label=f"{name}: held-out {loss:.3f}")
        axes.set_xlabel("step")
        axes.set_ylabel("loss (nats per token)")
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend(loc="upper right", fontsize="small")
        figure.tight_layout()
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
    return path
