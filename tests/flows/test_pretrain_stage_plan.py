"""The pretrain stage's plan: what is in its key, when it starts from the convert output, and how a partial
directory's checkpoints are kept or cleared. No processes, no Prefect."""

import json

from d9d.flows.jobs.contract import PartialStage
from d9d.flows.jobs.loading import load_job_config
from d9d.flows.jobs.pretrain.stage import CHECKPOINTS_DIR, MODEL_DIR, plan_pretrain, prepare_partial, rank_config


def _plan(tmp_path, *overrides):
    config = load_job_config(preset_name="micro", overrides=list(overrides), base=tmp_path)
    train = tmp_path / "train"
    train.mkdir(exist_ok=True)
    (train / "index.json").write_text("{}")
    return plan_pretrain(config.pretrain, config.pretrain_output, train, tmp_path / "model" / "checkpoint")


def test_rank_count_and_placement_stay_out_of_the_key_but_training_settings_do_not(tmp_path):
    base = _plan(tmp_path).key.digest
    assert _plan(tmp_path, "pretrain.nproc_per_node=4", "pretrain.grace_seconds=5").key.digest == base
    assert _plan(tmp_path, "pretrain.steps=9").key.digest != base
    assert _plan(tmp_path, "pretrain.optimizer.lr=0.001").key.digest != base


def test_a_pipelined_run_exports_its_model_too_under_the_same_key(tmp_path):
    """At pp > 1 the ranks gather their stages into model/ (tests/flows/test_pipelined_exports.py); the degrees stay
    out of the key, so a pp=1 output and a pp=2 one are the same stage output."""
    flat, pipelined = _plan(tmp_path), _plan(tmp_path, "pretrain.degrees.pp=2")
    assert pipelined.key.digest == flat.key.digest
    checkpoints = tmp_path / ".pretrain.partial" / CHECKPOINTS_DIR
    assert rank_config(pipelined, checkpoints).model_output == checkpoints.parent / MODEL_DIR


def test_starts_from_the_convert_output_only_when_its_parameters_equal_the_model(tmp_path):
    plan = _plan(tmp_path)
    assert plan.init_from is None and "does not exist" in plan.init_note
    checkpoint = tmp_path / "model" / "checkpoint"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    parameters = plan.config.model.parameters.model_dump(mode="json")
    (checkpoint / "parameters.json").write_text(json.dumps({**parameters, "hidden_size": 64}))
    plan = _plan(tmp_path)
    assert plan.init_from is None
    assert "qwen3_dense with vocab_size=512, hidden_size=64; pretrain.model is a qwen3_dense" in plan.init_note
    (checkpoint / "parameters.json").write_text(json.dumps(parameters))
    plan = _plan(tmp_path)
    assert plan.init_from == checkpoint
    assert any(entry.name == "init/model.safetensors" for entry in plan.key.inputs)  # its weights are an input
    assert _plan(tmp_path, "pretrain.init_from=random").init_from is None


def test_partial_checkpoints_are_kept_for_the_same_key_and_cleared_for_another(tmp_path):
    partial = PartialStage(tmp_path / ".pretrain.partial")
    plan = _plan(tmp_path)
    assert prepare_partial(partial, plan.key) == "a fresh run"
    step = partial.root / CHECKPOINTS_DIR / "step-00000004"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    assert prepare_partial(partial, plan.key) == "resuming from step-00000004"
    assert prepare_partial(partial, _plan(tmp_path, "pretrain.steps=9").key) == "a fresh run"
    assert not step.exists()


def test_a_configured_tracker_directory_resolves_against_the_working_directory(tmp_path):
    config = load_job_config(
        preset_name="micro",
        overrides=["pretrain.tracker.kind=tensorboard", "pretrain.tracker.directory=tb"],
        base=tmp_path,
    )
    assert config.pretrain.tracker is not None
    assert config.pretrain.tracker.model_dump()["directory"] == tmp_path / "tb"
