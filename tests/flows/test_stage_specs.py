"""The stage registry: one `StageSpec` per stage, the dependency graph written once (and in pipeline order), and
one Prefect flow per spec reachable by its module path (what deployments name)."""

import importlib

import pytest

from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.stages import PIPELINE, PIPELINE_SPECS, STAGES


def test_each_stage_has_one_spec_naming_a_section_of_the_job_config():
    assert PIPELINE == ("data-prep", "finetune-data", "convert", "pretrain", "finetune", "evaluate")
    assert len(STAGES) == len(PIPELINE_SPECS)
    for spec in PIPELINE_SPECS:
        assert spec.section in JobConfig.model_fields, spec.name
        assert spec.summary


@pytest.mark.parametrize("overrides", [{}, {"evaluate": {"finetune": False}}, {"finetune": {"base": "/models/b"}}])
def test_a_stage_reads_only_stages_that_run_before_it(overrides):
    config = JobConfig.model_validate(overrides)
    for index, spec in enumerate(PIPELINE_SPECS):
        assert set(spec.reads(config)) <= set(PIPELINE[:index]), spec.name
        for name, path in spec.reads(config).items():
            assert path == STAGES[name].output(config)  # a stage reads exactly where the other one commits


def test_a_finetune_from_its_own_base_reads_no_pretrain_output():
    config = JobConfig.model_validate({"finetune": {"base": "/models/b"}})
    assert "pretrain" not in STAGES["finetune"].reads(config)
    assert "pretrain" in STAGES["finetune"].reads(JobConfig())


@pytest.mark.isolated
def test_every_stage_flow_is_reachable_by_its_module_path():
    from d9d.flows.stage_flow import FLOWS

    for name, flow in FLOWS.items():
        module = importlib.import_module(flow.__module__)
        assert getattr(module, flow.__name__) is flow
        assert flow.name == name
        assert flow.__name__ == f"{STAGES[name].section}_flow"
