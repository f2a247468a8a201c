"""`--set pretrain.optimizer.lr` from the command line to the optimizer, the stops docs/flows.md lists: validated once
by the command's loader, carried as the same object into the plan and the rank config, validated once more by the
rank's loader, and read there by `build_stage_trainer`'s optimizer."""

import pytest
import yaml

from d9d.core.config import load_config
from d9d.core.optim import build_optimizer
from d9d.flows.jobs.loading import load_job_config
from d9d.flows.jobs.pretrain.config import PretrainRankConfig
from d9d.flows.jobs.pretrain.stage import rank_config
from d9d.flows.jobs.progress import NoProgress
from d9d.flows.jobs.stages import STAGES


def test_the_learning_rate_travels_unchanged_through_one_validation_per_process(tmp_path):
    import torch

    # Stops 1-3: the command line through the one loader (the validation in the command's process).
    config = load_job_config(preset_name="micro", overrides=[f"workdir={tmp_path}", "pretrain.optimizer.lr=0.00123"])
    # Stops 4-6: the same objects, never validated again: the plan holds the section, the rank config embeds it.
    plan = STAGES["pretrain"].plan(config, NoProgress())
    assert plan.config is config.pretrain
    job = rank_config(plan, tmp_path / "checkpoints")
    assert job.stage is config.pretrain
    # Stop 7: job.yaml as launch_training writes it, read by the rank's loader (the validation on each rank).
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
    on_rank = load_config(PretrainRankConfig, job_file)
    assert on_rank == job and on_rank.stage.optimizer.lr == pytest.approx(0.00123)
    # Stop 8: the optimizer the rank builds from its section.
    optimizer = build_optimizer(on_rank.stage.optimizer, [torch.nn.Parameter(torch.zeros(2))])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.00123)
