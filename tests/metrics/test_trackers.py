"""Trackers in one process: JSON-lines resume semantics, hparam flattening, config selection and its errors, the
main-process-only rule, wandb's disabled mode and the TensorBoard purge on resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError

from d9d.metrics.trackers import (
    AnyTrackerConfig,
    JsonlTracker,
    JsonlTrackerConfig,
    NullTracker,
    TrackerGroup,
    WandbTrackerConfig,
    build_tracker,
    flatten_hparams,
)
from d9d.metrics.trackers.base import require_backend


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_jsonl_resume_drops_records_after_the_checkpoint_and_a_torn_last_line(tmp_path):
    first = JsonlTracker(tmp_path)
    for step in range(1, 8):
        first.log(step, {"loss": 1.0 / step})
    with first.path.open("a") as handle:
        handle.write('{"step": 8, "lo')  # the kill tore the last write
    resumed = JsonlTracker(tmp_path)
    resumed.resume(first.run_id, 5)
    for step in range(6, 10):
        resumed.log(step, {"loss": 2.0})
    assert resumed.path == first.path
    assert _steps(first.path) == list(range(1, 10))


def test_only_the_enabled_tracker_writes(tmp_path):
    JsonlTracker(tmp_path / "rank1", enabled=False).log(1, {"loss": 1.0})
    JsonlTracker(tmp_path / "rank1", enabled=False).resume("abc", 0)
    assert not (tmp_path / "rank1").exists()


def test_hparams_are_flattened_with_dotted_keys():
    flat = flatten_hparams({"model": {"layers": 2, "dims": [4, 8]}, "path": Path("/x"), "lr": 1e-3, "tag": None})
    assert flat == {"model.layers": 2, "model.dims.0": 4, "model.dims.1": 8, "path": "/x", "lr": 1e-3, "tag": None}


def test_config_selects_the_tracker_by_kind_and_rejects_unknown_kinds(tmp_path):
    adapter: TypeAdapter[AnyTrackerConfig] = TypeAdapter(AnyTrackerConfig)
    config = adapter.validate_python({"kind": "jsonl", "directory": str(tmp_path)})
    assert isinstance(config, JsonlTrackerConfig)
    assert isinstance(build_tracker(config, enabled=True), JsonlTracker)
    assert isinstance(build_tracker(adapter.validate_python({"kind": "none"}), enabled=True), NullTracker)
    with pytest.raises(ValidationError, match="'none', 'jsonl', 'tensorboard', 'aim', 'wandb'"):
        adapter.validate_python({"kind": "mlflow"})
    with pytest.raises(ValidationError, match="mode"):
        adapter.validate_python({"kind": "wandb", "directory": str(tmp_path), "mode": "shared"})


def test_a_missing_optional_backend_names_the_extra_to_install():
    with pytest.raises(ImportError, match=r"pip install 'd9d-metrics\[fancy\]'"):
        require_backend("d9d_no_such_backend", "fancy")


def test_a_group_refuses_a_checkpointed_run_id_of_another_shape(tmp_path):
    group = TrackerGroup([JsonlTracker(tmp_path), JsonlTracker(tmp_path)])
    with pytest.raises(ValueError, match="does not list 2 member run ids"):
        group.resume(json.dumps(["only-one"]), 3)


@pytest.mark.isolated
def test_wandb_disabled_mode_logs_nothing_to_disk(tmp_path):
    tracker = build_tracker(WandbTrackerConfig(directory=tmp_path, mode="disabled"), enabled=True)
    tracker.log(1, {"loss": 1.0})
    tracker.checkpointed(1)
    tracker.close()
    assert not list(tmp_path.rglob("*.wandb"))


@pytest.mark.isolated
def test_tensorboard_resume_purges_events_after_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from d9d.metrics.trackers import TensorBoardTracker

    first = TensorBoardTracker(tmp_path)
    for step in range(1, 8):
        first.log(step, {"loss": float(step)})
    first.close()  # as if killed after step 7, its events on disk
    resumed = TensorBoardTracker(tmp_path)
    resumed.resume(first.run_id, 4)
    for step in range(5, 9):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()
    accumulator = EventAccumulator(str(tmp_path / first.run_id))
    accumulator.Reload()
    assert [(event.step, event.value) for event in accumulator.Scalars("loss")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0), (7, 70.0), (8, 80.0),
    ]  # fmt: skip
