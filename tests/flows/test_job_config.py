"""The job config: presets, YAML files and --set overrides, with errors that name the key, value and valid choices."""

from pathlib import Path

import pytest

from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.data_prep import EmbeddedCorpus, FilesCorpus, FileTokenizer, TrainBpeTokenizer
from d9d.flows.jobs.loading import JobConfigError, load_job_config
from d9d.flows.jobs.presets import preset_names


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_validates(name, tmp_path):
    config = load_job_config(preset_name=name, base=tmp_path)
    assert config.workdir == tmp_path / "runs" / name
    assert config.data_prep.output == tmp_path / "runs" / name / "data"
    assert isinstance(config.data_prep.corpus, EmbeddedCorpus)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(JobConfigError, match=r"unknown preset 'huge'; presets are: micro, micro-moe, tiny"):
        load_job_config(preset_name="huge")


def test_set_parses_values_as_yaml(tmp_path):
    config = load_job_config(
        preset_name="micro",
        overrides=[
            "data_prep.workers=3",
            "data_prep.validation_fraction=0.5",
            "data_prep.corpus.limit=null",
            "data_prep.tokenizer.special_tokens=[<s>, </s>]",
            "data_prep.tokenizer.eos_token=</s>",
        ],
        base=tmp_path,
    )
    assert config.data_prep.workers == 3
    assert config.data_prep.validation_fraction == 0.5
    assert config.data_prep.corpus == EmbeddedCorpus(name="shakespeare", limit=None)
    assert isinstance(config.data_prep.tokenizer, TrainBpeTokenizer)
    assert config.data_prep.tokenizer.special_tokens == ["<s>", "</s>"]


def test_unknown_set_key_names_the_key_and_the_valid_fields():
    with pytest.raises(JobConfigError) as error:
        load_job_config(preset_name="micro", overrides=["data_prep.worker=2"])
    message = str(error.value)
    assert "unknown --set key 'data_prep.worker'" in message
    assert "data_prep has no field 'worker'" in message
    assert "workers" in message


def test_set_key_of_another_kind_says_which_kind_has_it():
    with pytest.raises(JobConfigError, match=r"'path' belongs to kind='file': set data_prep.tokenizer.kind=file"):
        load_job_config(preset_name="micro", overrides=["data_prep.tokenizer.path=tok.json"])


def test_switching_kind_starts_the_section_from_that_kind(tmp_path):
    config = load_job_config(
        preset_name="micro",
        overrides=["data_prep.tokenizer.kind=file", "data_prep.tokenizer.path=tok.json"],
        base=tmp_path,
    )
    assert config.data_prep.tokenizer == FileTokenizer(path=tmp_path / "tok.json")


def test_set_into_a_plain_value_is_refused():
    with pytest.raises(JobConfigError, match=r"workdir is a value, not a section"):
        load_job_config(preset_name="micro", overrides=["workdir.name=x"])


def test_set_without_equals_is_refused():
    with pytest.raises(JobConfigError, match=r"--set expects KEY=VALUE"):
        load_job_config(preset_name="micro", overrides=["data_prep.workers"])


def test_invalid_values_name_the_key_the_value_and_what_is_valid():
    with pytest.raises(JobConfigError) as error:
        load_job_config(
            preset_name="micro",
            overrides=[
                "data_prep.validation_fraction=1.5",
                "data_prep.corpus.name=bible",
                "data_prep.tokenizer.vocab_size=100",
            ],
        )
    message = str(error.value)
    assert "data_prep.validation_fraction = 1.5: Input should be less than 1" in message
    assert "data_prep.corpus.name = 'bible': Input should be 'shakespeare' or 'milton'" in message
    assert "data_prep.tokenizer.vocab_size = 100: Value error, too small" in message


def test_config_file_is_applied_over_the_preset(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        "workdir: out\ndata_prep:\n  corpus: {kind: files, paths: [texts]}\n  workers: 1\n", encoding="utf-8"
    )
    config = load_job_config(preset_name="tiny", config_file=job, base=tmp_path)
    assert config.workdir == tmp_path / "out"
    assert config.data_prep.corpus == FilesCorpus(paths=[tmp_path / "texts"])
    assert isinstance(config.data_prep.tokenizer, TrainBpeTokenizer)
    assert config.data_prep.tokenizer.vocab_size == 4096  # from the preset


def test_unknown_key_in_a_config_file_lists_the_valid_fields(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("data_prep:\n  tokenizer: {kind: file, path: t.json, vocab: 5}\n", encoding="utf-8")
    with pytest.raises(JobConfigError) as error:
        load_job_config(config_file=job)
    assert "data_prep.tokenizer.vocab: unknown field; valid fields: kind, path, eos_token" in str(error.value)


@pytest.mark.parametrize(
    ("content", "expected"),
    [(None, "does not exist"), ("a: [1,\n", "is not valid YAML"), ("- 1\n- 2\n", "must hold a mapping")],
)
def test_bad_config_files_are_named(tmp_path, content, expected):
    job = tmp_path / "job.yaml"
    if content is not None:
        job.write_text(content, encoding="utf-8")
    with pytest.raises(JobConfigError, match=f"config file {job} {expected}"):
        load_job_config(config_file=job)


def test_execution_settings_do_not_enter_the_stage_key():
    base = JobConfig().data_prep
    changed = base.model_copy(update={"workers": 7, "retries": 5, "output": Path("/elsewhere")})
    assert base.stage_key_config() == changed.stage_key_config()
    assert base.stage_key_config() != base.model_copy(update={"seed": 1}).stage_key_config()


@pytest.mark.parametrize("raw", [".inf", "1e999"])
def test_a_non_finite_learning_rate_is_refused_naming_the_field(raw):
    # (nan is refused too, earlier: the lr field's `ge=0` fails for nan with the same key named.)
    with pytest.raises(JobConfigError, match=r"pretrain\.optimizer\.lr=inf"):
        load_job_config(preset_name="micro", overrides=[f"pretrain.optimizer.lr={raw}"])
