"""Work directories written before the StageSpec redesign (design note 0009) keep working: every stage key is the
one the old code computed (so finished stages stay finished and partial checkpoints resume), a model directory
whose parameters.json has no `kind` still initialises pretraining, and a pretrain output committed before the stage
exported `model/` stays finished and says how to get one.

`fixtures/pre_0009_stage_keys.json` was written by `fixtures/stage_key_configs.py` running on the code before the
redesign (commit e237597; the command is in that script)."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from d9d.flows.jobs.contract import StageDirectory, StageManifest, StageReporter
from d9d.flows.jobs.loading import load_job_config
from d9d.flows.jobs.pretrain.stage import RECORDED_PACKAGES, init_checkpoint
from d9d.flows.jobs.progress import NoProgress
from d9d.flows.jobs.stages import STAGES
from d9d.models.catalogue import read_parameters

FIXTURES = Path(__file__).parent / "fixtures"
PRE_0009 = json.loads((FIXTURES / "pre_0009_stage_keys.json").read_text())
sys.path.insert(0, str(FIXTURES))
from stage_key_configs import WORKDIR, stage_key_configs  # noqa: E402

# Stages whose output changed on purpose since then, with the stage version that says so (a bumped version redoes
# the stage, and its CHANGELOG entry says why): evaluate 3 adds task scores, samples and history (design 0017).
CHANGED_ON_PURPOSE = {"evaluate": 3}
PRE_0009_STAGE_VERSIONS = {"evaluate": 2}


@pytest.mark.parametrize("preset", ["tiny", "micro"])
def test_every_stage_key_config_is_the_one_the_code_before_the_redesign_computed(preset):
    now = stage_key_configs(preset)
    kept = {stage: config for stage, config in now.items() if stage not in CHANGED_ON_PURPOSE}
    assert kept == {stage: config for stage, config in PRE_0009[preset].items() if stage not in CHANGED_ON_PURPOSE}
    assert set(now) == set(PRE_0009[preset])


def test_a_stage_whose_key_changed_on_purpose_bumped_its_version():
    from d9d.flows.jobs.evaluate.stage import STAGE_VERSION as EVALUATE_VERSION

    assert {"evaluate": EVALUATE_VERSION} == CHANGED_ON_PURPOSE
    assert all(CHANGED_ON_PURPOSE[stage] > PRE_0009_STAGE_VERSIONS[stage] for stage in CHANGED_ON_PURPOSE)


@pytest.mark.parametrize("preset", ["tiny", "micro"])
def test_the_pretrain_and_finetune_plans_build_those_keys(tmp_path, preset):
    """Through the stages' own plan functions, on a work directory laid out as the old code laid it out."""
    config = load_job_config(preset_name=preset, overrides=[f"workdir={tmp_path}"])
    for upstream in (config.finetune_data_output, config.pretrain_output):  # the manifests fine-tune's key holds
        upstream.mkdir(parents=True)
        (upstream / "manifest.json").write_text("{}")
    pretrain = STAGES["pretrain"].plan(config, NoProgress())
    assert pretrain.key.config == PRE_0009[preset]["pretrain"]
    finetune = STAGES["finetune"].plan(config, NoProgress())
    assert finetune.key.config == PRE_0009[preset]["finetune"]
    assert [fingerprint.name for fingerprint in finetune.key.inputs] == ["pretrain/manifest", "finetune-data/manifest"]


def test_a_convert_output_whose_parameters_have_no_kind_still_initialises_pretraining(tmp_path):
    config = load_job_config(preset_name="micro", overrides=[f"workdir={tmp_path}"])
    checkpoint = config.convert_output / "checkpoint"
    checkpoint.mkdir(parents=True)
    # As the convert stage wrote it before: the parameters' own JSON, without "kind".
    (checkpoint / "parameters.json").write_text(config.pretrain.model.parameters.model_dump_json(indent=2) + "\n")
    assert read_parameters(checkpoint) == config.pretrain.model.parameters
    assert init_checkpoint(config.pretrain, checkpoint) == (checkpoint, f"the convert output {checkpoint}")


def test_a_pretrain_output_from_before_the_model_export_stays_finished_and_says_how_to_get_the_model(tmp_path):
    config = load_job_config(preset_name="micro", overrides=[f"workdir={tmp_path}"])
    spec = STAGES["pretrain"]
    plan = spec.plan(config, NoProgress())
    # Commit an output the way the stage did before it exported model/: its files and statistics, no model/.
    directory = StageDirectory(config.pretrain_output)
    partial = directory.open_partial(plan.key)
    (partial.root / "checkpoints" / "step-00000008").mkdir(parents=True)
    (partial.root / "checkpoints" / "step-00000008" / "COMPLETE").write_text("")
    (partial.root / "job.yaml").write_text(yaml.safe_dump({"steps": 8}))
    (partial.root / "losses.jsonl").write_text('{"step": 8, "loss": 5.9}\n')
    (partial.root / "launch.log").write_text("")
    tracker = {"kind": "jsonl", "run_id": "r1", "location": str(config.pretrain_output / "tracker" / "r1.jsonl")}
    statistics = {"steps": 8, "final_loss": 5.9, "ranks": 2, "init": "random initialisation", "tracker": tracker}
    old_files = ["job.yaml", "losses.jsonl", "launch.log", "checkpoints/step-00000008/COMPLETE"]
    StageReporter("pretrain", RECORDED_PACKAGES, lambda output, stats: {}).commit(
        directory, partial, plan.key, plan.output, outputs=old_files, statistics=statistics
    )
    assert "model" not in StageManifest.read(config.pretrain_output).statistics

    completeness = spec.check(directory, spec.plan(config, NoProgress()))
    assert completeness.complete  # the same key: nothing is trained again
    result = spec.skipped(plan, completeness)
    assert result.status == "skipped"
    assert result.artifacts["model"] == (
        "none: this output was written before the pretrain stage exported its model; to get "
        f"{config.pretrain_output / 'model'}, delete {config.pretrain_output} and run the stage again (its training "
        "repeats)"
    )
    assert result.artifacts["checkpoints"] == str(config.pretrain_output / "checkpoints")


def test_the_fixture_was_made_for_the_workdir_the_script_names():
    # The finetune-data key holds the tokenizer's path under the workdir: the fixture is for that workdir only.
    tokenizer = PRE_0009["micro"]["finetune-data"]["tokenizer"]["path"]
    assert tokenizer == f"{WORKDIR}/data/tokenizer.json"


def test_a_pipelined_pretrain_output_from_before_the_pipelined_export_says_how_to_get_the_model(tmp_path):
    """Committed at pp > 1 before the stage gathered the stages (statistics `"model": None`): the key is the same
    (the degrees are not in it), so it stays finished; its summary points at the checkpoints and at a rerun."""
    from d9d.flows.jobs.pretrain.stage import model_artifact

    output = tmp_path / "pretrain"
    assert model_artifact(output, {"steps": 8, "model": None}) == (
        "none: this output was trained with pipeline parallelism before the pretrain stage exported pipelined "
        f"models; the model is in {output / 'checkpoints'} (its newest step); to get {output / 'model'}, delete "
        f"{output} and run the stage again (its training repeats)"
    )
    assert model_artifact(output, {"steps": 8, "model": "model"}) == str(output / "model")


def test_model_fields_added_since_count_in_the_key_once_set():
    plain = load_job_config(preset_name="micro", overrides=["workdir=/w"]).pretrain.key_config()
    assert "compile_model" not in plain["model"]["decoder"]
    compiled = load_job_config(
        preset_name="micro", overrides=["workdir=/w", "pretrain.model.decoder.compile_model=true"]
    ).pretrain.key_config()
    assert compiled["model"]["decoder"]["compile_model"] is True
