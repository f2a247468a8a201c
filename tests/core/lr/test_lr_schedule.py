"""Piecewise LR schedules: warm-up, hold and decay phases with four curves, from code or from config, plotted."""

import itertools
import math
import sys

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from d9d.core.lr import (
    AnyLRScheduleConfig,
    CosineCurve,
    ExponentialCurve,
    LinearCurve,
    PolynomialCurve,
    build_lr_schedule,
    build_lr_scheduler,
    piecewise_schedule,
    plot_schedule,
)

ADAPTER = TypeAdapter(AnyLRScheduleConfig)


@pytest.mark.parametrize(
    ("curve", "middle"),
    [(LinearCurve(), 0.55), (CosineCurve(), 0.55), (PolynomialCurve(2.0), 0.325), (ExponentialCurve(), 0.1**0.5)],
)
def test_curves_join_their_ends(curve, middle):
    assert curve.value(1.0, 0.1, 0.0) == pytest.approx(1.0)
    assert curve.value(1.0, 0.1, 1.0) == pytest.approx(0.1)
    assert curve.value(1.0, 0.1, 0.5) == pytest.approx(middle)


def test_warmup_hold_and_decay_give_the_expected_multipliers():
    schedule = (
        piecewise_schedule(total_steps=100, initial=0.0)
        .for_steps(10, target=1.0)
        .hold(20)
        .until_fraction(0.8, target=0.1, curve=CosineCurve())
        .fill_rest(target=0.0, curve=PolynomialCurve(1.0))
        .build()
    )
    values = schedule.multipliers()
    assert values[0] == 0.0 and values[5] == pytest.approx(0.5) and values[10] == 1.0
    assert values[10:30] == [1.0] * 20
    assert values[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[80] == pytest.approx(0.1) and values[90] == pytest.approx(0.05)
    assert schedule.multiplier(100) == schedule.multiplier(10_000) == 0.0
    assert all(b <= a for a, b in itertools.pairwise(values[10:])), "monotone after the warm-up"


def test_the_scheduler_drives_an_optimizer():
    schedule = piecewise_schedule(10, initial=0.1).for_steps(4, target=1.0).fill_rest(0.0).build()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=2.0)
    scheduler = schedule.scheduler(optimizer)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([2.0 * value for value in schedule.multipliers()])
    state = scheduler.state_dict()
    resumed = schedule.scheduler(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=2.0))
    resumed.load_state_dict(state)
    assert resumed.get_last_lr() == scheduler.get_last_lr()


CONFIG = {
    "kind": "piecewise",
    "initial": 0.0,
    "phases": [
        {"mode": "steps", "steps": 10, "target": 1.0},
        {"mode": "hold", "steps": 20},
        {"mode": "fraction", "until": 0.8, "target": 0.1, "curve": {"type": "cosine"}},
        {"mode": "rest", "target": 0.0, "curve": {"type": "polynomial", "power": 1.0}},
    ],
}


def test_a_config_round_trips_through_json_and_builds_the_same_schedule():
    config = ADAPTER.validate_python(CONFIG)
    assert ADAPTER.validate_json(ADAPTER.dump_json(config)) == config
    from_config = build_lr_schedule(config, 100).multipliers()
    from_code = (
        piecewise_schedule(100)
        .for_steps(10, 1.0)
        .hold(20)
        .until_fraction(0.8, 0.1, CosineCurve())
        .fill_rest(0.0, PolynomialCurve(1.0))
        .build()
        .multipliers()
    )
    assert from_config == from_code
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    assert build_lr_scheduler(config, optimizer, 100).get_last_lr() == [0.0]


@pytest.mark.parametrize(
    ("phases", "total", "complaint"),
    [
        (
            [{"mode": "steps", "steps": 50, "target": 1.0}, {"mode": "fraction", "until": 0.3, "target": 0.5}],
            100,
            r"phases\[1\] \(mode='fraction'\): until_fraction\(0.3\) would end at step 30, .* reaches step 50",
        ),
        ([{"mode": "steps", "steps": 150, "target": 1.0}], 100, r"past total_steps=100"),
        ([{"mode": "rest", "target": 0.0}, {"mode": "hold", "steps": 1}], 100, r"after fill_rest"),
        ([{"mode": "rest", "target": 0.0, "curve": {"type": "exponential"}}], 100, r"exponential curve needs positive"),
    ],
)
def test_phases_that_do_not_fit_name_their_position_and_the_problem(phases, total, complaint):
    config = ADAPTER.validate_python({"kind": "piecewise", "initial": 1.0, "phases": phases})
    with pytest.raises(ValueError, match=complaint):
        build_lr_schedule(config, total)


def test_unknown_keys_and_kinds_are_rejected():
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        ADAPTER.validate_python({**CONFIG, "warmup": 10})
    with pytest.raises(ValidationError, match="'linear', 'cosine', 'polynomial', 'exponential'"):
        ADAPTER.validate_python(
            {"kind": "piecewise", "phases": [{"mode": "rest", "target": 0, "curve": {"type": "step"}}]}
        )


def test_a_schedule_plots_to_png(tmp_path):
    schedule = build_lr_schedule(ADAPTER.validate_python(CONFIG), 100)
    path = plot_schedule(schedule, tmp_path / "lr.png", base_lr=3e-4)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000


def test_plotting_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    schedule = piecewise_schedule(10).fill_rest(1.0).build()
    with pytest.raises(ImportError, match=r"pip install 'd9d-core\[plot\]'"):
        plot_schedule(schedule, tmp_path / "lr.png")
