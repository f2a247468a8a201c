"""The finetune-data and finetune stages' plans and preflight, and the convert stage's random base following the
pretrain model: what is in the keys, what the rank program is told, which inputs must exist. No processes, no Prefect.
"""

import json

import pytest

from d9d.flows.jobs.contract import MANIFEST_FILENAME
from d9d.flows.jobs.convert import ConvertConfig, convert_model
from d9d.flows.jobs.data_prep import FileTokenizer
from d9d.flows.jobs.finetune.stage import inputs_of, plan_finetune, rank_config
from d9d.flows.jobs.finetune.stage import preflight as preflight_finetune
from d9d.flows.jobs.loading import JobConfigError, load_job_config
from d9d.flows.jobs.pretrain.stage import init_checkpoint
from d9d.flows.jobs.stage_spec import PreflightError
from d9d.flows.jobs.stages import PIPELINE, STAGES, require_inputs


def _config(tmp_path, *overrides):
    return load_job_config(preset_name="micro", overrides=[f"workdir={tmp_path}", *overrides], base=tmp_path)


def _plan(tmp_path, *overrides):
    config = _config(tmp_path, *overrides)
    for stage_output in (config.pretrain_output, config.finetune_data_output):  # stand-ins for complete stages
        if not (stage_output / MANIFEST_FILENAME).is_file():
            stage_output.mkdir(parents=True, exist_ok=True)
            (stage_output / MANIFEST_FILENAME).write_text(json.dumps({"stage": stage_output.name}))
    return plan_finetune(config.finetune, inputs_of(config), config.finetune_output)


def test_the_pipeline_fine_tunes_between_pretrain_and_evaluate():
    assert PIPELINE == ("data-prep", "finetune-data", "convert", "pretrain", "finetune", "evaluate")


def test_finetune_data_uses_the_data_prep_tokenizer_file_and_its_end_of_document_token(tmp_path):
    config = _config(tmp_path)
    prep = config.finetune_data_prep
    assert prep.tokenizer == FileTokenizer(path=tmp_path / "data" / "tokenizer.json", eos_token="<|endoftext|>")
    assert prep.output == tmp_path / "finetune-data"
    assert prep.corpus.model_dump() == {"kind": "embedded", "name": "milton", "limit": 3}
    assert prep.allow_tokenizer_change  # a retrained pretrain tokenizer retokenizes the fine-tune corpus too


def test_finetune_key_holds_what_is_trained_and_its_inputs_but_not_where_it_runs(tmp_path):
    base = _plan(tmp_path).key
    assert {entry.name for entry in base.inputs} == {"pretrain/manifest", "finetune-data/manifest"}
    assert _plan(tmp_path, "finetune.nproc_per_node=4", "finetune.device=auto").key.digest == base.digest
    assert _plan(tmp_path, "finetune.steps=5").key.digest != base.digest
    assert _plan(tmp_path, "finetune.peft.params.r=4").key.digest != base.digest
    assert _plan(tmp_path, "pretrain.seq_len=32").key.digest != base.digest  # fine-tuning uses pretrain's rows
    (tmp_path / "pretrain" / MANIFEST_FILENAME).write_text(json.dumps({"stage": "pretrain", "again": True}))
    assert _plan(tmp_path).key.digest != base.digest  # a new pretrained base means fine-tuning again


def test_rank_program_starts_from_the_pretrain_checkpoints_and_keeps_adapter_only_checkpoints(tmp_path):
    plan = _plan(tmp_path)
    config = rank_config(plan, tmp_path / ".finetune.partial")
    assert config.base == tmp_path / "pretrain" / "checkpoints"
    assert config.model == plan.inputs.model and config.seq_len == 64
    assert config.stage is plan.config  # the job's section, embedded unchanged
    assert config.train_shards == tmp_path / "finetune-data" / "train"
    assert config.validation_shards == tmp_path / "finetune-data" / "validation"
    assert config.checkpoints == tmp_path / ".finetune.partial" / "checkpoints"
    assert config.stage.peft.kind == "lora"
    assert config.stage.peft.module_name_pattern.fullmatch("model.layers.1.mlp.down_proj")
    assert config.stage.peft.module_name_pattern.fullmatch("model.layers.0.self_attn.q_proj")
    assert config.tracker.model_dump()["directory"] == tmp_path / ".finetune.partial" / "tracker"


def test_finetune_preflight_names_the_fields_of_a_batch_that_cannot_be_split(tmp_path):
    with pytest.raises(PreflightError, match=r"finetune.global_batch_rows=6 .* finetune.microbatch_rows=2 .* of 4"):
        preflight_finetune(_config(tmp_path, "finetune.global_batch_rows=6"))
    preflight_finetune(_config(tmp_path))


def test_a_schedule_longer_than_the_run_fails_before_launch_naming_the_fields(tmp_path):
    from d9d.flows.jobs.pretrain.stage import preflight as preflight_pretrain

    warm_up = (
        "{kind: piecewise, initial: 0.1, phases: [{mode: steps, steps: 20, target: 1.0}, {mode: rest, target: 0.1}]}"
    )
    with pytest.raises(
        PreflightError, match=r"pretrain.lr_schedule does not fit pretrain.steps=10: .*raise pretrain.steps"
    ):
        preflight_pretrain(_config(tmp_path, f"pretrain.lr_schedule={warm_up}", "pretrain.steps=10"))
    preflight_pretrain(_config(tmp_path, f"pretrain.lr_schedule={warm_up}", "pretrain.steps=30"))


def test_finetune_needs_pretrain_and_finetune_data_unless_they_run_first(tmp_path):
    config = _config(tmp_path)
    require_inputs(config, STAGES["finetune"], PIPELINE)
    with pytest.raises(PreflightError, match=r"finetune reads the output of pretrain at .*; run `d9d run pretrain`"):
        require_inputs(config, STAGES["finetune"], ["finetune"])
    with pytest.raises(PreflightError, match=r"evaluate reads the output of finetune-data"):
        require_inputs(config, STAGES["evaluate"], ["data-prep", "pretrain", "finetune", "evaluate"])
    require_inputs(_config(tmp_path, "evaluate.finetune=false"), STAGES["evaluate"], ["data-prep", "pretrain"])


def test_a_finetune_from_its_own_base_does_not_need_pretrain_and_takes_the_bases_model(tmp_path):
    from d9d.models.random_checkpoint import write_random_hf_checkpoint

    config = _config(tmp_path)
    hf = write_random_hf_checkpoint(
        tmp_path / "hf", config.pretrain.model.parameters.model_copy(update={"num_layers": 3})
    )
    with pytest.raises(PreflightError, match=r"finetune.base=.*hf: cannot tell which model it holds .*base_mapping"):
        preflight_finetune(_config(tmp_path, f"finetune.base={hf}"))
    own = _config(tmp_path, f"finetune.base={hf}", "finetune.base_mapping=qwen3-hf-to-d9d")
    preflight_finetune(own)
    assert STAGES["finetune"].reads(own) == {"finetune-data": own.finetune_data_output}
    inputs = inputs_of(own)
    assert inputs.base == hf and inputs.base_manifest is None and inputs.model.parameters.num_layers == 3


def test_the_random_base_follows_the_pretrain_model_so_pretraining_starts_from_it(tmp_path):
    config = _config(tmp_path)
    output = config.convert_output
    result = convert_model(config.convert, output, architecture=config.pretrain.model.parameters)
    assert result.status == "ran" and result.statistics["mapping"] == "qwen3-hf-to-d9d"
    init_from, note = init_checkpoint(config.pretrain, output / "checkpoint")
    assert init_from == output / "checkpoint", note
    # Another model makes a new random source (and so a new conversion), which pretraining then starts from.
    wider = _config(tmp_path, "pretrain.model.parameters.hidden_size=64", "pretrain.model.parameters.head_dim=16")
    again = convert_model(wider.convert, output, architecture=wider.pretrain.model.parameters, replace=True)
    assert again.status == "ran" and "inputs changed" in again.reason
    assert init_checkpoint(wider.pretrain, output / "checkpoint")[0] == output / "checkpoint"
    assert convert_model(wider.convert, output, architecture=wider.pretrain.model.parameters).status == "skipped"


def test_a_configured_source_needs_a_mapping(tmp_path):
    with pytest.raises(JobConfigError, match=r"convert: .*needs a mapping: set convert.mapping to one of qwen3-hf"):
        _config(tmp_path, f"convert.source={tmp_path}")
    assert ConvertConfig(source=tmp_path, mapping="qwen3-hf-to-d9d").mapping == "qwen3-hf-to-d9d"
