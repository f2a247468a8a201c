"""Bad input to `d9d run` fails at once (before Prefect starts), naming what is wrong and how to fix it."""

import sys

import pytest
import yaml
from flows_corpora import small_job

from d9d.flows.cli import EXIT_BAD_INPUT, main
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.data_prep import prepare_data


def _error(capsys, argv):
    assert main(argv) == EXIT_BAD_INPUT
    return capsys.readouterr().err


@pytest.fixture(autouse=True)
def _prefect_stays_unimported():
    was_imported = "prefect" in sys.modules
    yield
    if not was_imported:
        assert "prefect" not in sys.modules, "bad input must be reported before Prefect is imported"


def test_unknown_set_key(capsys):
    err = _error(capsys, ["run", "pipeline", "--preset", "micro", "--set", "data_prep.tokeniser.kind=file"])
    assert "d9d: error: unknown --set key 'data_prep.tokeniser.kind'" in err
    assert "valid fields: corpus, tokenizer" in err


def test_missing_corpus_path(capsys, tmp_path):
    err = _error(
        capsys,
        [
            "run",
            "data-prep",
            "--preset",
            "micro",
            "--set",
            "data_prep.corpus.kind=files",
            "--set",
            f"data_prep.corpus.paths=[{tmp_path}/missing.txt]",
        ],
    )
    assert f"data_prep.corpus.paths.0 = {tmp_path}/missing.txt: no such file or directory" in err


def test_unreadable_corpus_file(capsys, tmp_path):
    (tmp_path / "rows.parquet").write_bytes(b"PAR1 garbage")
    err = _error(
        capsys,
        [
            "run",
            "data-prep",
            "--set",
            "data_prep.corpus.kind=files",
            "--set",
            f"data_prep.corpus.paths=[{tmp_path / 'rows.parquet'}]",
        ],
    )
    assert f"corpus file {tmp_path / 'rows.parquet'} is not a readable parquet file" in err


def test_missing_config_file(capsys, tmp_path):
    err = _error(capsys, ["run", "data-prep", "--config", str(tmp_path / "job.yaml")])
    assert f"config file {tmp_path / 'job.yaml'} does not exist" in err


def test_tokenizer_mismatch_with_an_existing_shard_set(capsys, tmp_path, corpus_dir):
    job = small_job(tmp_path, corpus_dir)
    config = JobConfig.model_validate(job).resolved(tmp_path)
    prepare_data(config.data_prep, config.data_prep_output)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job), encoding="utf-8")
    err = _error(capsys, ["run", "data-prep", "--config", str(job_file), "--set", "data_prep.tokenizer.vocab_size=400"])
    assert f"tokenizer mismatch with the existing shard set at {config.data_prep_output}" in err
    assert "--set data_prep.allow_tokenizer_change=true" in err


def test_show_config_prints_the_resolved_job(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["show-config", "--preset", "tiny", "--set", "data_prep.workers=1"]) == 0
    out = capsys.readouterr().out
    assert f"workdir: {tmp_path}/runs/tiny" in out
    assert "workers: 1" in out


def test_pretrain_vocabulary_smaller_than_the_tokenizer(capsys):
    err = _error(capsys, ["run", "pipeline", "--preset", "micro", "--set", "data_prep.tokenizer.vocab_size=1024"])
    assert "pretrain.model.parameters.vocab_size=512 is smaller than data_prep.tokenizer.vocab_size=1024" in err


def test_pretrain_global_batch_that_does_not_split_over_the_ranks(capsys):
    err = _error(capsys, ["run", "pretrain", "--preset", "micro", "--set", "pretrain.global_batch_rows=6"])
    assert "pretrain.global_batch_rows=6 cannot be split into micro-batches of pretrain.microbatch_rows=2" in err
    assert "make it a multiple of 4" in err


def test_evaluate_rows_per_step_not_a_multiple_of_the_ranks(capsys):
    err = _error(capsys, ["run", "evaluate", "--preset", "micro", "--set", "evaluate.rows_per_step=3"])
    assert "evaluate.rows_per_step=3 is not a multiple of the data-parallel size 2 (evaluate.nproc_per_node=2" in err


def test_evaluate_compare_with_must_be_an_evaluation_report(capsys, tmp_path):
    (tmp_path / "not-a-report.json").write_text('{"loss": 1.0}')
    for path, says in [("missing.json", "cannot read an evaluation report there"), ("not-a-report.json", "no 'checkp")]:
        argv = ["run", "evaluate", "--preset", "micro", "--set", f"evaluate.compare_with={tmp_path / path}"]
        err = _error(capsys, argv)
        assert f"evaluate.compare_with={tmp_path / path}: " in err and says in err


def test_a_stage_alone_needs_the_outputs_it_reads(capsys, tmp_path):
    err = _error(capsys, ["run", "evaluate", "--preset", "micro", "--set", f"workdir={tmp_path}"])
    assert f"evaluate reads the output of data-prep at {tmp_path / 'data'}, which is not complete" in err
    assert "run `d9d run data-prep` (or the pipeline) first" in err


def test_an_empty_workdir_is_refused(capsys):
    err = _error(capsys, ["run", "pipeline", "--preset", "micro", "--set", "workdir="])
    assert "workdir" in err and "workdir is empty; name a directory for the stage outputs" in err


def test_a_workdir_under_a_file_names_the_file(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    err = _error(capsys, ["run", "pipeline", "--preset", "micro", "--set", f"workdir={tmp_path}/notes.txt/run"])
    assert f"workdir={tmp_path}/notes.txt/run is under {tmp_path}/notes.txt, which is a file" in err


@pytest.mark.parametrize("target", ["pipeline", "pretrain"])  # `d9d run pretrain`: the issue's own command
def test_a_run_shorter_than_the_presets_warm_up_fails_before_launch(capsys, tmp_path, target):
    err = _error(
        capsys, ["run", target, "--preset", "tiny", "--set", f"workdir={tmp_path}", "--set", "pretrain.steps=10"]
    )
    assert "d9d: error: pretrain.lr_schedule does not fit pretrain.steps=10" in err
    assert "raise pretrain.steps" in err


def test_the_console_drops_prefects_run_tracebacks_but_keeps_other_records():
    import logging

    from d9d.flows.cli import _NoRunTracebacks

    def record(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, "Encountered exception during execution", None, None)

    keep = _NoRunTracebacks().filter
    assert not keep(record("prefect.flow_runs", logging.ERROR))  # d9d prints the cause itself, in one message
    assert not keep(record("prefect.task_runs", logging.ERROR))
    assert keep(record("prefect.flow_runs", logging.WARNING))
    assert keep(record("prefect.server", logging.ERROR))


def test_a_workdir_holding_a_foreign_folder_is_refused_and_the_folder_kept(capsys, tmp_path):
    """`--set workdir=/shared` where /shared/data is not d9d's: refused before anything runs, nothing touched."""
    shared = tmp_path / "shared"
    (shared / "data" / "raw").mkdir(parents=True)
    (shared / "data" / "raw" / "corpus.txt").write_text("years of collected text\n", encoding="utf-8")
    before = sorted(str(path.relative_to(shared)) for path in shared.rglob("*"))
    err = _error(capsys, ["run", "pipeline", "--preset", "micro", "--set", f"workdir={shared}"])
    assert f"d9d: error: {shared / 'data'} exists and is not a d9d stage output" in err
    assert "raw/" in err and "--set replace_outputs=true" in err
    assert sorted(str(path.relative_to(shared)) for path in shared.rglob("*")) == before
    assert (shared / "data" / "raw" / "corpus.txt").read_text(encoding="utf-8") == "years of collected text\n"


def test_the_last_line_says_how_to_see_the_flow_run(monkeypatch):
    from d9d.flows.cli import flow_run_pointer

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", "/home/me/.d9d/prefect")
    assert flow_run_pointer("abc") == (
        "Prefect flow run abc; to see it: PREFECT_HOME=/home/me/.d9d/prefect prefect flow-run inspect abc"
    )
    monkeypatch.setenv("PREFECT_API_URL", "http://scheduler:4200/api")
    assert flow_run_pointer("abc") == "Prefect flow run abc: http://scheduler:4200/runs/flow-run/abc"
