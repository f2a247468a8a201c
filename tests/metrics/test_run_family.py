"""The evaluate program logs its results as a new run of the training run's family: the same aim experiment, at
the evaluated checkpoint's step, read back through aim's SDK."""

from __future__ import annotations

import json
import math

import pytest

from d9d.flows.jobs.evaluate.config import EvaluateConfig
from d9d.flows.jobs.evaluate.program import EvaluationReport, log_report
from d9d.metrics.trackers import AimTrackerConfig, build_tracker

TINY_DENSE = {
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
}  # fmt: skip


@pytest.mark.isolated
def test_evaluation_joins_the_training_runs_aim_experiment_at_the_checkpoint_step(tmp_path):
    from aim import Repo
    from aim.sdk.index_manager import RepoIndexManager
    from aim.storage.context import Context

    config = AimTrackerConfig(repo=tmp_path / "aim", experiment="family")
    training = build_tracker(config, enabled=True, hparams={"lr": 0.1}, name="pretrain")
    for step in (1, 2, 3):
        training.log(step, {"loss": 4.0 - step})
    training.close()
    checkpoint = tmp_path / "checkpoints" / "step-00000003"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 3}))  # what the Trainer writes there

    evaluate = EvaluateConfig.model_validate(
        {"model": {"kind": "qwen3_dense", "parameters": TINY_DENSE}, "shards": str(tmp_path), "seq_len": 16,
         "output": str(tmp_path / "eval"), "tracker": config.model_dump(mode="json")}
    )  # fmt: skip
    report = EvaluationReport(
        checkpoint=str(checkpoint), loss=2.0, perplexity=math.exp(2.0), bits_per_byte=0.7, tokens=9
    )
    log_report(report, evaluate)

    repo = Repo.from_path(str(tmp_path / "aim"))
    for run_hash in repo.list_all_runs():
        RepoIndexManager.get_index_manager(repo).index(run_hash)
    runs = {run.name: run for run in repo.iter_runs()}
    assert sorted(runs) == ["evaluate", "pretrain"]
    assert {run.experiment for run in runs.values()} == {"family"}
    steps, (values, *_) = runs["evaluate"].get_metric("evaluate/loss", Context({})).data.items_list()
    assert (steps, values) == ([3], [2.0])
    assert runs["evaluate"]["hparams"]["seq_len"] == 16  # the evaluate config, flattened
