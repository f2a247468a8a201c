"""The evaluate stage's loss curves: an axis that fits the training curve, far-off held-out losses in a panel of their
own, distinct colours and a legend outside the data (a real PNG through matplotlib)."""

import pytest

from d9d.flows.jobs.evaluate.plot import COLOURS, plot_loss_curve, split_held_out

FINETUNE = {step: 4.6 - 0.004 * step for step in range(1, 101)}  # a fine-tune curve from 4.6 down to 4.2


def test_a_base_loss_far_above_the_curve_gets_its_own_panel_and_the_rest_stay_on_the_curves_axis():
    inside, outside = split_held_out(FINETUNE, {"base": 8.3, "pretrain": 4.5, "finetune": 4.25})
    assert outside == {"base": 8.3}
    assert inside == {"pretrain": 4.5, "finetune": 4.25}


def test_the_png_has_two_panels_with_distinct_colours_and_the_legend_beside_the_data(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    captured = []
    original = plt.close
    plt.close = lambda figure=None: captured.append(figure)  # keep the figure to inspect it
    try:
        path = plot_loss_curve(FINETUNE, {"base": 8.3, "pretrain": 4.5, "finetune": 4.25}, tmp_path / "curve.png")
    finally:
        plt.close = original
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (figure,) = captured
    top, axes = figure.axes
    assert axes.get_ylim()[1] < 5.0  # the fine-tune curve fills its axis; 8.3 is not on it
    assert top.get_ylim()[0] < 8.3 < top.get_ylim()[1]
    colours = [line.get_color() for line in (*axes.get_lines(), *top.get_lines())]
    assert len(set(colours)) == 4 and set(colours) <= set(COLOURS)
    (legend,) = figure.legends
    box = legend.get_window_extent(figure.canvas.get_renderer())
    for panel in (top, axes):
        assert box.x0 >= panel.get_window_extent().x1  # beside the data, never over it
    original(figure)
