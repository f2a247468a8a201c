"""The evaluate stage's plan and rank config: its evaluations join the pretrain stage's tracker family, one named run
per checkpoint x split, without the tracker entering the key. No processes, no Prefect (the micro pipeline test in
test_flows_prefect.py checks the runs it writes)."""

import json

import pytest

from d9d.flows.jobs.contract import MANIFEST_FILENAME
from d9d.flows.jobs.evaluate.stage import plan_evaluate, suite_config, tracker_runs
from d9d.flows.jobs.loading import load_job_config
from d9d.metrics.trackers import AimTrackerConfig, JsonlTrackerConfig, NoTrackerConfig, TensorBoardTrackerConfig


def _config(tmp_path, *overrides):
    return load_job_config(preset_name="micro", overrides=[f"workdir={tmp_path}", *overrides], base=tmp_path)


def _plan(tmp_path, *overrides):
    """The evaluate plan of the micro job, over stand-ins for the complete stages it reads."""
    config = _config(tmp_path, *overrides)
    for output in (config.pretrain_output, config.finetune_output):
        output.mkdir(parents=True, exist_ok=True)
        (output / MANIFEST_FILENAME).write_text(json.dumps({"stage": output.name}))
    for split in (config.data_prep_output / "validation", config.finetune_data_output / "validation"):
        split.mkdir(parents=True, exist_ok=True)
        (split / "index.json").write_text("{}")
    # No converted checkpoint here: no `base` candidate.
    return plan_evaluate(config.evaluate, config.evaluate_inputs(), config.evaluate_output)


def test_evaluations_log_into_the_pretrain_runs_default_jsonl_directory(tmp_path):
    plan = _plan(tmp_path)
    family = JsonlTrackerConfig(directory=tmp_path / "pretrain" / "tracker")  # where pretrain's run is committed
    suite = suite_config(plan, tmp_path / "partial")
    assert suite.tracker == family
    singles = {candidate.name: suite.single(candidate) for candidate in suite.candidates}
    assert sorted(singles) == [
        "finetune.finetune-data", "finetune.pretrain-data", "pretrain.finetune-data", "pretrain.pretrain-data",
    ]  # fmt: skip
    for name, single in singles.items():
        assert single.tracker == family
        assert single.run_name == f"evaluate {name}"  # which checkpoint, which split
        assert single.output == tmp_path / "partial" / name


@pytest.mark.parametrize(
    "overrides",
    [
        ("pretrain.tracker.kind=tensorboard", "pretrain.tracker.directory=tb"),
        ("pretrain.tracker.kind=aim", "pretrain.tracker.repo=aim", "pretrain.tracker.experiment=family"),
    ],
)
def test_a_configured_pretrain_tracker_is_the_evaluations_tracker_and_stays_out_of_the_key(tmp_path, overrides):
    plan = _plan(tmp_path, *overrides)
    expected = {
        "tensorboard": TensorBoardTrackerConfig(directory=tmp_path / "tb"),
        "aim": AimTrackerConfig(repo=tmp_path / "aim", experiment="family"),
    }[plan.inputs.tracker.kind]
    assert plan.inputs.tracker == expected
    assert suite_config(plan, tmp_path / "partial").tracker == expected
    assert plan.key.digest == _plan(tmp_path).key.digest  # another tracker evaluates nothing again


def test_the_statistics_name_each_run_and_where_it_is(tmp_path):
    family = JsonlTrackerConfig(directory=tmp_path / "tracker")
    recorded = tracker_runs(family, {"pretrain.pretrain-data": "abc123"})
    assert recorded == {
        "kind": "jsonl",
        "family": str(tmp_path / "tracker"),
        "runs": {
            "pretrain.pretrain-data": {
                "name": "evaluate pretrain.pretrain-data",
                "run_id": "abc123",
                "location": str(tmp_path / "tracker" / "abc123.jsonl"),
            }
        },
    }
    aim = tracker_runs(AimTrackerConfig(repo=tmp_path / "aim", experiment="family"), {"base.pretrain-data": "f00d"})
    assert (
        aim["family"]
        == aim["runs"]["base.pretrain-data"]["location"]
        == (f"aim repository {tmp_path / 'aim'}, experiment family")
    )
    assert tracker_runs(NoTrackerConfig(), {"pretrain.pretrain-data": "x"}) == {
        "kind": "none",
        "family": "none",
        "runs": {},
    }


def test_tasks_and_prompts_run_once_per_checkpoint_with_the_data_prep_tokenizer(tmp_path):
    plan = _plan(tmp_path, "evaluate.limit=7", "evaluate.prompts=[Hail]")
    suite = suite_config(plan, tmp_path / "partial", tmp_path / "partial" / "tasks")
    downstream = suite.downstream
    assert downstream is not None
    assert downstream.tokenizer == tmp_path / "data" / "tokenizer.json"
    assert downstream.tasks_dir == tmp_path / "partial" / "tasks" and downstream.limit == 7
    assert downstream.prompts == ["Hail"] and downstream.max_length == plan.seq_len
    # The scores do not depend on the split: only each checkpoint's first split runs them.
    singles = {candidate.name: suite.single(candidate) for candidate in suite.candidates}
    assert {name for name, single in singles.items() if single.downstream is not None} == {
        "pretrain.pretrain-data", "finetune.pretrain-data",
    }  # fmt: skip
    assert _plan(tmp_path, "evaluate.limit=7").key.digest != _plan(tmp_path).key.digest  # in the key
    nothing = _plan(tmp_path, "evaluate.tasks=[]", "evaluate.prompts=[]")
    assert suite_config(nothing, tmp_path / "partial").downstream is None
