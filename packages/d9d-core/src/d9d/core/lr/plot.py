"""Plot a schedule to a PNG file (needs matplotlib: `pip install d9d-core[plot]`)."""

from __future__ import annotations

from pathlib import Path

from d9d.core.lr.schedule import PiecewiseSchedule


def plot_schedule(
    schedule: PiecewiseSchedule,
    path: Path | str,
    *,
    base_lr: float = 1.0,
    num_steps: int | None = None,
    title: str | None = None,
) -> Path:
    """Write the learning rate (`base_lr` times the multiplier) per step to `path` as a PNG; returns the path.

    Raises:
        ImportError: matplotlib is not installed, naming the extra that installs it.
    """
    try:
        import matplotlib as mpl

        mpl.use("Agg")  # files only; never open a window or need a display
        from matplotlib import pyplot as plt
    except ImportError as error:
        raise ImportError(
            "plotting an LR schedule needs matplotlib; install it with `pip install 'd9d-core[plot]'`"
        ) from error
    steps = schedule.total_steps if num_steps is None else num_steps
    values = [base_lr * value for value in schedule.multipliers(steps)]
    figure, axes = plt.subplots(figsize=(7, 3.5), dpi=100)
    try:
        axes.plot(range(steps), values, linewidth=1.5)
        for phase in schedule.phases[1:]:
            axes.axvline(phase.start_step, color="grey", linewidth=0.5, linestyle=":")
        axes.set_xlabel("step")
        axes.set_ylabel("learning rate" if base_lr != 1.0 else "multiplier")
        axes.set_title(title or f"LR schedule ({len(schedule.phases)} phases, {steps} steps)")
        axes.grid(alpha=0.3)
        figure.tight_layout()
        output = Path(path)
        figure.savefig(output, format="png")
    finally:
        plt.close(figure)
    return output
