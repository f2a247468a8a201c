"""`data_parallel.offload=true` from the command line: accepted for FSDP/HSDP training stages, refused before any
rank starts (before Prefect is imported) where it cannot run, naming the field, its value and the fix."""

import sys

import pytest

from d9d.flows.cli import EXIT_BAD_INPUT, main
from d9d.flows.jobs.loading import load_job_config
from d9d.flows.jobs.stages import PIPELINE, preflight
from d9d.parallel import FsdpConfig, HsdpConfig


@pytest.fixture(autouse=True)
def _prefect_stays_unimported():
    was_imported = "prefect" in sys.modules
    yield
    if not was_imported:
        assert "prefect" not in sys.modules, "a refused offload must be reported before Prefect is imported"


def _error(capsys, tmp_path, stage: str, *overrides: str) -> str:
    argv = ["run", stage, "--preset", "micro", "--set", f"workdir={tmp_path}"]
    for override in overrides:
        argv += ["--set", override]
    assert main(argv) == EXIT_BAD_INPUT
    assert not any(tmp_path.iterdir()), "nothing may be written for a refused run"
    return capsys.readouterr().err


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
@pytest.mark.parametrize("kind", ["fsdp", "hsdp"])
def test_offload_passes_the_preflight_of_training_stages(stage, kind, tmp_path):
    overrides = [f"workdir={tmp_path}", f"{stage}.data_parallel.kind={kind}", f"{stage}.data_parallel.offload=true"]
    config = load_job_config(preset_name="micro", config_file=None, overrides=overrides)
    data_parallel = getattr(config, stage).data_parallel
    assert data_parallel == (FsdpConfig if kind == "fsdp" else HsdpConfig)(offload=True)
    preflight(config, PIPELINE)  # no error (the whole pipeline: the stages before write the inputs)


def test_offload_with_the_fused_triton_optimizer_step(capsys, tmp_path):
    err = _error(
        capsys, tmp_path, "pretrain", "pretrain.data_parallel.offload=true",
        "pretrain.optimizer={kind: stochastic_adamw, lr: 0.003, fused: true}",
    )  # fmt: skip
    assert "pretrain.optimizer.fused=true (kind=stochastic_adamw) runs d9d-kernels' Triton step on CUDA" in err
    assert "pretrain.data_parallel.offload=true keeps the parameters" in err
    assert "set pretrain.optimizer.fused=false" in err


def test_offload_with_pipeline_stages(capsys, tmp_path):
    err = _error(capsys, tmp_path, "finetune", "finetune.data_parallel.offload=true", "finetune.degrees.pp=2")
    assert "finetune.data_parallel.offload=true with finetune.degrees.pp=2 is not supported yet" in err
    assert "set finetune.data_parallel.offload=false or finetune.degrees.pp=1" in err


def test_offload_in_the_evaluate_stage(capsys, tmp_path):
    err = _error(capsys, tmp_path, "evaluate", "evaluate.data_parallel.offload=true")
    assert "evaluate.data_parallel.offload=true: offload moves gradients and optimizer state to CPU memory" in err
    assert "set evaluate.data_parallel.offload=false" in err


@pytest.mark.parametrize("kind", ["single", "replicate"])
def test_offload_with_a_kind_that_has_no_fsdp_units(capsys, tmp_path, kind):
    # One key at a time: the loader knows which kind has the field.
    err = _error(
        capsys, tmp_path, "pretrain", "pretrain.nproc_per_node=1", f"pretrain.data_parallel.kind={kind}",
        "pretrain.data_parallel.offload=true",
    )  # fmt: skip
    assert "unknown --set key 'pretrain.data_parallel.offload'" in err
    assert "'offload' belongs to kind='fsdp': set pretrain.data_parallel.kind=fsdp first" in err
    # The whole section at once (as a YAML job file has it): the config itself says why and what to use.
    err = _error(
        capsys, tmp_path, "pretrain", "pretrain.nproc_per_node=1",
        f"pretrain.data_parallel={{kind: {kind}, offload: true}}",
    )  # fmt: skip
    assert "pretrain.data_parallel" in err
    assert f"kind={kind!r} cannot offload (got offload=True)" in err
    assert "use kind='fsdp'" in err


def test_offloaded_adamw_takes_the_fused_cpu_kernel_unless_told_otherwise():
    from d9d.core.optim import AdamWConfig, StochasticAdamWConfig
    from d9d.flows.jobs.offload_checks import offloaded_optimizer

    offloaded = FsdpConfig(offload=True)
    assert offloaded_optimizer(AdamWConfig(), offloaded) == AdamWConfig(fused=True)
    assert offloaded_optimizer(AdamWConfig(fused=False), offloaded) == AdamWConfig(fused=False)  # asked for: kept
    assert offloaded_optimizer(AdamWConfig(foreach=True), offloaded) == AdamWConfig(foreach=True)
    assert offloaded_optimizer(AdamWConfig(), FsdpConfig()) == AdamWConfig()  # no offload: PyTorch's default
    assert offloaded_optimizer(StochasticAdamWConfig(), offloaded) == StochasticAdamWConfig()
