"""The stage flows against a real Prefect API: the embedded local one, started once for the whole session.

These run in the `isolated` pytest invocation: Prefect starts threads, and the forking multi-rank tests refuse to
fork while other threads run.
"""

import json
import math
import shutil

import pytest
import yaml
from flows_corpora import small_job

from d9d.core.checkpoint import latest_complete
from d9d.flows.cli import EXIT_BAD_INPUT, EXIT_FAILED, main
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.contract import StageManifest
from d9d.flows.jobs.evaluate.config import DEFAULT_PROMPTS, DEFAULT_TASKS
from d9d.flows.jobs.faults import FAULT_ENV
from d9d.flows.jobs.presets import preset
from d9d.models.catalogue import read_parameters

pytestmark = pytest.mark.isolated


def _flow_runs(workdir, name="data-prep"):
    """The runs of flow `name` that the Prefect API recorded for jobs under `workdir`, oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[name])), sort=FlowRunSort.START_TIME_ASC
        )
    return [run for run in runs if run.parameters["job"]["workdir"] == str(workdir)]


def test_pipeline_runs_then_skips_then_redoes_what_was_deleted(prefect_api, tmp_path, capsys):
    argv = ["run", "pipeline", "--preset", "micro", "--set", f"workdir={tmp_path}"]
    output = tmp_path / "data"

    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "data-prep: ran" in out
    assert "finetune-data: ran" in out
    # A random HF checkpoint of the pretrain model's architecture through the matching named mapping: the base.
    assert "convert: ran" in out
    assert StageManifest.read(tmp_path / "model").statistics["mapping"] == "qwen3-hf-to-d9d"
    for path in (output, output / "tokenizer.json", output / "train", output / "validation", output / "manifest.json"):
        assert str(path) in out
    _check_finetune_data(tmp_path)
    _check_pretrain_and_evaluate(tmp_path, out)
    _check_finetune(tmp_path, out)
    created = StageManifest.read(output).created_at
    pretrained = StageManifest.read(tmp_path / "pretrain").created_at
    shard_times = {path: path.stat().st_mtime_ns for path in output.rglob("*.d9dtok")}

    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "data-prep: skipped (up to date: manifest matches config and inputs)" in out
    assert "convert: skipped" in out
    for stage in ("finetune-data", "pretrain", "finetune", "evaluate"):
        assert f"{stage}: skipped (up to date" in out
    assert StageManifest.read(output).created_at == created
    assert {path: path.stat().st_mtime_ns for path in output.rglob("*.d9dtok")} == shard_times

    shutil.rmtree(output / "validation")  # a partial output: never taken as complete
    assert main(argv) == 0
    assert "data-prep: ran (" in capsys.readouterr().out
    assert (output / "validation" / "index.json").is_file()

    shutil.rmtree(output)
    assert main(argv) == 0
    assert f"data-prep: ran ({output} does not exist)" in capsys.readouterr().out

    runs = _flow_runs(tmp_path)
    assert [run.state_type.value for run in runs] == ["COMPLETED"] * 4
    assert len(_flow_runs(tmp_path, name="pipeline")) == 4
    # Data prep redone from the same corpus gives the same shards: pretraining (keyed on their checksums) skipped.
    assert StageManifest.read(tmp_path / "pretrain").created_at == pretrained
    assert [run.state_type.value for run in _flow_runs(tmp_path, name="pretrain")] == ["COMPLETED"] * 4

    # A one-off override next to the finished run: refused before training, naming what replacing it would delete.
    checkpoints = sorted(path.name for path in (tmp_path / "pretrain" / "checkpoints").iterdir())
    once = ["run", "pretrain", "--preset", "micro", "--set", f"workdir={tmp_path}", "--set", "pretrain.steps=9"]
    assert main(once) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"{tmp_path / 'pretrain'} holds a complete pretrain output" in err
    assert "config changed (steps)" in err and "checkpoints/" in err
    assert sorted(path.name for path in (tmp_path / "pretrain" / "checkpoints").iterdir()) == checkpoints
    assert StageManifest.read(tmp_path / "pretrain").created_at == pretrained

    # The nightly comparison: evaluating again (other sample lengths) finds the first report in the history and
    # shows the deltas; the same checkpoints on the same data score the same.
    again = ["run", "evaluate", "--preset", "micro", "--set", f"workdir={tmp_path}", "--set", "replace_outputs=true"]
    assert main([*again, "--set", "evaluate.max_new_tokens=6"]) == 0
    out = capsys.readouterr().out
    history = sorted((tmp_path / "evaluation-history").glob("*.json"))
    assert len(history) == 2
    previous = json.loads((tmp_path / "evaluation" / "evaluation.json").read_text())["previous"]
    assert previous["path"] == str(history[0]) and previous["comparison"]["comparable"]
    for name, compared in previous["comparison"]["checkpoints"].items():
        assert len(compared["scores"]) == 4 + 6, name  # loss and bits/byte on 2 splits; 6 task metrics
        assert all(abs(entry["delta"]) < 1e-6 for entry in compared["scores"].values()), name
    assert "vs previous report     finetune vs the previous report" in out
    assert "## Compared with the previous report" in (tmp_path / "evaluation" / "evaluation.md").read_text()


def _check_pretrain_and_evaluate(workdir, out):
    """The first run's pretrain and evaluate outputs, its report, and the artifacts the Prefect API holds."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    assert "pretrain: ran" in out and "evaluate: ran" in out
    statistics = StageManifest.read(workdir / "pretrain").statistics
    assert statistics["init"] == f"the convert output {workdir / 'model' / 'checkpoint'}"
    assert statistics["steps"] == 8 and statistics["ranks"] == 2
    assert latest_complete(workdir / "pretrain" / "checkpoints").name == "step-00000008"
    model = workdir / "pretrain" / "model"  # the trained model, self-describing
    expected = JobConfig.model_validate(preset("micro")).pretrain.model.parameters  # (test_pretrain_program.py
    assert read_parameters(model) == expected  # converts such a directory to transformers, same logits)
    assert f"model              {model}" in out
    losses = [json.loads(line) for line in (workdir / "pretrain" / "losses.jsonl").read_text().splitlines()]
    assert [record["step"] for record in losses] == list(range(1, 9))
    tracker = statistics["tracker"]  # the default tracker: JSONL in the stage output, named in the summary
    assert tracker["kind"] == "jsonl" and tracker["location"] == str(
        workdir / "pretrain" / "tracker" / f"{tracker['run_id']}.jsonl"
    )
    tracked = [
        json.loads(line)
        for line in (workdir / "pretrain" / "tracker" / f"{tracker['run_id']}.jsonl").read_text().splitlines()
    ]
    assert [record["step"] for record in tracked if "loss" in record] == list(range(1, 9))
    assert f"jsonl {tracker['run_id']}: {tracker['location']}" in out
    report = json.loads((workdir / "evaluation" / "evaluation.json").read_text())
    checkpoints = report["checkpoints"]
    assert list(checkpoints) == ["base", "pretrain", "finetune"]
    for name, splits in checkpoints.items():
        assert list(splits) == ["pretrain-data", "finetune-data"], name
    pretrain, base = checkpoints["pretrain"]["pretrain-data"], checkpoints["base"]["pretrain-data"]
    assert pretrain["checkpoint"].endswith("step-00000008") and base["checkpoint"].endswith("model/checkpoint")
    assert checkpoints["finetune"]["finetune-data"]["checkpoint"].endswith("finetune/merged")
    assert pretrain["perplexity"] == pytest.approx(math.exp(pretrain["loss"]))
    assert pretrain["loss"] < math.log(512)  # below a uniform guess over the 512 tokens: it learned something
    assert pretrain["loss"] < base["loss"]  # and it learned it from the converted base
    for name in ("loss_curve.png", "finetune_loss_curve.png"):
        assert (workdir / "evaluation" / name).read_bytes()[:4] == b"\x89PNG"
        assert str(workdir / "evaluation" / name) in out
    for name, splits in checkpoints.items():  # the report printed at the end: loss, perplexity, bits/byte
        for split, numbers in splits.items():
            row = f"{numbers['loss']:8.4f} {numbers['perplexity']:11.2f} {numbers['bits_per_byte']:10.4f}"
            assert f"{name:10} {split:14} {row}" in out
    compared = report["comparison"]
    assert compared["pretrain"] == checkpoints["pretrain"]["finetune-data"]["loss"]
    assert compared["finetune"] == checkpoints["finetune"]["finetune-data"]["loss"]
    verdict = "lower" if compared["lower"] else "NOT lower"
    numbers = f"{compared['finetune']:.4f} vs pretrained {compared['pretrain']:.4f}"
    assert f"{numbers} held-out loss on finetune-data: {verdict}\n" in out
    _check_evaluation_runs(workdir, report, out)
    markdown = (workdir / "evaluation" / "evaluation.md").read_text()
    assert "| finetune | finetune-data |" in markdown and "| base | pretrain-data |" in markdown
    _check_tasks_and_samples(workdir, report, markdown, out)
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["evaluation-report", "evaluation-table"]))
        )
    kinds = {artifact.type for artifact in artifacts if str(workdir) in (artifact.description or "")}
    assert kinds == {"markdown", "table"}


SPLIT = "finetune-data"


def _check_tasks_and_samples(workdir, report, markdown, out):
    """Base, pretrain and fine-tune side by side: loss and bits per byte on both splits, the four local tasks scored
    by lm_eval's evaluator, greedy continuations of the prompts; the fine-tuned model beats the base on Milton."""
    names = ["base", "pretrain", "finetune"]
    assert list(report["tasks"]) == names and list(report["samples"]) == names
    for name in names:
        assert sorted(report["tasks"][name]) == sorted(DEFAULT_TASKS)
        for task, result in report["tasks"][name].items():
            assert result["documents"] == 40, (name, task)  # the section's limit
            metrics = ["acc", "perplexity"] if task.startswith("d9d_cloze") else ["acc"]
            assert sorted(result["metrics"]) == metrics and 0 <= result["metrics"]["acc"] <= 1
        prompts = [sample["prompt"] for sample in report["samples"][name]]
        assert prompts == list(DEFAULT_PROMPTS)
        assert all(sample["continuation"] for sample in report["samples"][name]), name
    # The Milton cloze word's perplexity: the fine-tuned model (pretrained on Shakespeare, LoRA on Milton) is better
    # than the untrained base. Accuracies of models this small stay near chance and are not asserted on.
    milton = {name: report["tasks"][name]["d9d_cloze_milton"]["metrics"]["perplexity"] for name in names}
    assert milton["finetune"] < milton["base"], milton
    assert report["tasks"]["finetune"]["d9d_cloze_milton"]["higher_is_better"] == {"acc": True, "perplexity": False}
    assert "| score | base | pretrain | finetune |" in markdown
    for score in [
        *(f"{measure}/{split}" for measure in ("loss", "bits_per_byte") for split in ("pretrain-data", SPLIT)),
        *(f"{task}/acc" for task in DEFAULT_TASKS),
        "d9d_cloze_shakespeare/perplexity",
        "d9d_cloze_milton/perplexity",
    ]:
        (row,) = [line for line in markdown.splitlines() if line.startswith(f"| {score} (")]
        assert row.count("|") == 5 and "—" not in row, row  # a number for each of the three checkpoints
    assert markdown.count("- **finetune**: …") == len(DEFAULT_PROMPTS)
    assert f"evaluation report      {workdir / 'evaluation' / 'evaluation.md'}" in out
    assert f"evaluation report json {workdir / 'evaluation' / 'evaluation.json'}" in out
    assert "tasks finetune         d9d_next_line_shakespeare acc" in out
    assert len(list((workdir / "evaluation-history").glob("*.json"))) == 1


def _check_evaluation_runs(workdir, report, out):
    """Every checkpoint x split is a run of the pretrain run's family: a JSONL file next to the training run's,
    named (in its hparams) after the checkpoint and split, at the evaluated checkpoint's step, with the report's
    numbers."""
    family = workdir / "pretrain" / "tracker"
    training = StageManifest.read(workdir / "pretrain").statistics["tracker"]["run_id"]
    tracker = StageManifest.read(workdir / "evaluation").statistics["tracker"]
    assert tracker["kind"] == "jsonl" and tracker["family"] == str(family)
    names = [f"{checkpoint}.{split}" for checkpoint, splits in report["checkpoints"].items() for split in splits]
    assert sorted(tracker["runs"]) == sorted(names) and len(names) == 6
    run_ids = {run["run_id"] for run in tracker["runs"].values()}
    assert len(run_ids) == 6 and training not in run_ids
    assert {path.name for path in family.glob("*.jsonl")} == {f"{run}.jsonl" for run in {training, *run_ids}}
    for name, run in tracker["runs"].items():
        checkpoint, split = name.split(".", 1)
        assert run["location"] == str(family / f"{run['run_id']}.jsonl")
        hparams = json.loads((family / f"{run['run_id']}.hparams.json").read_text())
        assert hparams["run_name"] == f"evaluate {name}" == run["name"]
        (record,) = [json.loads(line) for line in (family / f"{run['run_id']}.jsonl").read_text().splitlines()]
        numbers = report["checkpoints"][checkpoint][split]
        # The task scores go into the run of the checkpoint's first split (they do not depend on the split).
        tasks = report["tasks"][checkpoint] if split == "pretrain-data" else {}
        assert record == {
            "step": 8 if checkpoint == "pretrain" else 0,  # a job checkpoint's step; converted/merged weights: 0
            "evaluate/loss": numbers["loss"],
            "evaluate/perplexity": numbers["perplexity"],
            "evaluate/bits_per_byte": numbers["bits_per_byte"],
        } | {
            f"evaluate/{task}/{metric}": value
            for task, result in tasks.items()
            for metric, value in result["metrics"].items()
        }
    assert f"jsonl, 6 runs (checkpoint x split): {family}" in out


def _check_finetune_data(workdir):
    """The fine-tune corpus, tokenized with the pretrain data's tokenizer into its own train/validation split."""
    statistics = StageManifest.read(workdir / "finetune-data").statistics
    assert statistics["tokenizer"]["sha256"] == StageManifest.read(workdir / "data").statistics["tokenizer"]["sha256"]
    assert statistics["splits"]["train"]["documents"] == 2 and statistics["splits"]["validation"]["documents"] == 1
    assert (workdir / "finetune-data" / "validation" / "index.json").is_file()


def _check_finetune(workdir, out):
    """LoRA from the pretrain stage's last checkpoint: adapter-only job checkpoints, adapter and merged weights."""
    assert "finetune: ran" in out
    statistics = StageManifest.read(workdir / "finetune").statistics
    assert statistics["steps"] == 4 and statistics["method"] == "lora"
    assert statistics["base"] == str(workdir / "pretrain" / "checkpoints" / "step-00000008")
    assert 0 < statistics["trainable_parameters"] < statistics["total_parameters"]
    assert latest_complete(workdir / "finetune" / "checkpoints").name == "step-00000004"
    for name in ("merged/model.safetensors.index.json", "adapter/model.safetensors.index.json", "peft.json"):
        assert (workdir / "finetune" / name).is_file(), name
    losses = [json.loads(line) for line in (workdir / "finetune" / "losses.jsonl").read_text().splitlines()]
    assert [record["step"] for record in losses] == [1, 2, 3, 4]
    tracker = statistics["tracker"]
    assert f"jsonl {tracker['run_id']}: {workdir / 'finetune' / 'tracker'}" in out


def test_failed_run_then_fixed_completes_without_redoing_finished_work(prefect_api, tmp_path, capsys, monkeypatch):
    # The data-prep stage alone: the pipeline would go on to train and evaluate, which other tests cover.
    argv = ["run", "data-prep", "--preset", "micro", "--set", f"workdir={tmp_path}", "--set", "data_prep.retries=0"]
    monkeypatch.setenv(FAULT_ENV, "data_prep.items:2")  # fail after two of the four units are tokenized
    assert main(argv) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "injected failure at data_prep.items" in err
    assert "run the same command to continue" in err
    partial = tmp_path / ".data.partial"
    pieces = [json.loads(path.read_text()) for path in (partial / ".pieces").glob("*.json")]
    finished = {file["name"]: (partial / file["name"]).stat().st_mtime_ns for p in pieces for file in p["files"]}
    assert "tokenizer.json" in finished
    assert len(pieces) >= 3  # the tokenizer and at least the two units before the failure
    assert not (tmp_path / "data").exists()

    monkeypatch.delenv(FAULT_ENV)  # the fix
    assert main(argv) == 0
    assert "data-prep: ran" in capsys.readouterr().out
    output = tmp_path / "data"
    statistics = StageManifest.read(output).statistics
    assert statistics["tokenizer"]["reused"] is True
    assert statistics["tokenization"]["units_reused"] == len(pieces) - 1
    for name, mtime in finished.items():
        assert (output / name).stat().st_mtime_ns == mtime, f"{name} was redone"
    assert [run.state_type.value for run in _flow_runs(tmp_path)] == ["FAILED", "COMPLETED"]


def test_failed_stage_is_retried_as_configured_and_the_retry_keeps_finished_work(
    prefect_api, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv(FAULT_ENV, "data_prep.items:1:1")  # fail once, after the first unit
    argv = ["run", "data-prep", "--preset", "micro", "--set", f"workdir={tmp_path}", "--set", "data_prep.retries=1"]
    assert main(argv) == 0
    capsys.readouterr()
    assert StageManifest.read(tmp_path / "data").statistics["tokenization"]["units_reused"] >= 1
    (run,) = _flow_runs(tmp_path)
    assert run.state_type.value == "COMPLETED"
    assert run.run_count == 2


def test_stage_runs_from_a_job_file_with_overrides(prefect_api, tmp_path, capsys, corpus_dir):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(small_job(tmp_path, corpus_dir)), encoding="utf-8")
    assert main(["run", "data-prep", "--config", str(job_file), "--set", "data_prep.seed=3"]) == 0
    assert "data-prep: ran" in capsys.readouterr().out
    created = StageManifest.read(tmp_path / "run" / "data").created_at
    changed = ["run", "data-prep", "--config", str(job_file), "--set", "data_prep.seed=4"]
    assert main(changed) == EXIT_BAD_INPUT  # a complete output for another config: kept, and the run refused
    assert "holds a complete data-prep output" in capsys.readouterr().err
    assert StageManifest.read(tmp_path / "run" / "data").created_at == created
    assert main([*changed, "--set", "replace_outputs=true"]) == 0
    assert "data-prep: ran (config changed (seed))" in capsys.readouterr().out
    assert StageManifest.read(tmp_path / "run" / "data").statistics["documents"] == 10


def test_a_failing_rank_is_reported_by_its_own_error_without_a_prefect_stack(prefect_api, tmp_path, capsys, corpus_dir):
    """A failure only the ranks can see (the flash_attn package is not installed here: preflight cannot know which
    machine the ranks run on) reaches the user as that rank's own error, not Prefect's traceback or "see the log"."""
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(small_job(tmp_path, corpus_dir)), encoding="utf-8")
    job = ["--preset", "micro", "--config", str(job_file)]
    assert main(["run", "data-prep", *job]) == 0
    capsys.readouterr()
    flash = ["--set", "pretrain.model.decoder.attention.kind=flash_attn_2", "--set", "pretrain.retries=0"]
    assert main(["run", "pretrain", *job, *flash]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "d9d: pretrain failed after" in err and "pretrain: a rank failed:" in err
    assert "the attention backend 'flash_attn_2' needs the flash_attn package" in err  # the rank's own exception
    assert f"(full log: {tmp_path / 'run' / '.pretrain.partial' / 'launch.log'})" in err
    # The rank's last traceback lines only: no traceback header, no frame of Prefect's engine or of torchrun.
    for stack in ("Traceback", "site-packages/prefect", "flow_engine", "ChildFailedError", "Encountered exception"):
        assert stack not in err, err
    assert "pretrain: done in" not in err  # the bar never started (no step ran): no end line at all
