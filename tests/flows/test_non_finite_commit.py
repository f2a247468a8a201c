"""A training stage never commits a model whose last loss is not finite: the losses the rank program reported (a
NaN survives the JSON lines file) are checked before the stage may commit."""

import logging
import math

import pytest

from d9d.flows.jobs.launch import progress_line
from d9d.flows.jobs.progress import LogProgress
from d9d.flows.jobs.torchrun_stage import NonFiniteLossError, StepTracker, read_losses, require_finite_last_loss


def _report(tmp_path, losses):
    tracker = StepTracker(tmp_path / "losses.jsonl", LogProgress(logging.getLogger("test")), name="pretrain")
    tracker({"event": "started", "step": 0, "total": len(losses)})
    for step, loss in enumerate(losses, start=1):
        assert progress_line({"event": "step", "step": step, "loss": loss})  # what the launcher parses
        tracker({"event": "step", "step": step, "total": len(losses), "loss": loss})
    return read_losses(tmp_path / "losses.jsonl")


def test_a_nan_last_loss_refuses_the_commit_naming_the_step(tmp_path):
    losses = _report(tmp_path, [2.0, 1.5, math.nan])
    assert math.isnan(losses[3])
    with pytest.raises(NonFiniteLossError, match=r"pretrain: the loss of the last step \(3\) is nan"):
        require_finite_last_loss(losses, name="pretrain")


def test_an_earlier_skipped_step_does_not_block_a_finite_end(tmp_path):
    losses = _report(tmp_path, [2.0, math.inf, 1.5])
    require_finite_last_loss(losses, name="pretrain")  # the guard skipped step 2; the model it ends with is sane
