"""The `launcher` setting of the launched stages: parsing, errors naming the field, the stage key it stays out of,
the sbatch script the Slurm launcher submits, and how it reads Slurm's answers. No Slurm here (see
test_slurm_launcher.py for the real one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from d9d.flows.jobs.launch import LaunchSpec
from d9d.flows.jobs.launchers import LocalLauncherConfig, SlurmLauncherConfig, build_launcher
from d9d.flows.jobs.launchers.cluster_job import render_cluster_job
from d9d.flows.jobs.launchers.local import LocalLauncher
from d9d.flows.jobs.launchers.slurm import SlurmJobState, SlurmLauncher, end_state_error, parse_scontrol_job
from d9d.flows.jobs.loading import JobConfigError, load_job_config
from d9d.flows.jobs.stage_spec import PreflightError
from d9d.flows.jobs.stages import preflight


def test_the_default_is_local_and_where_ranks_run_is_not_in_the_stage_key() -> None:
    local = load_job_config(preset_name="micro")
    assert isinstance(local.pretrain.launcher, LocalLauncherConfig)
    assert isinstance(local.evaluate.launcher, LocalLauncherConfig)
    assert isinstance(build_launcher(local.pretrain.launcher, local.pretrain, name="pretrain"), LocalLauncher)
    slurm = load_job_config(
        preset_name="micro", overrides=["pretrain.launcher.kind=slurm", "pretrain.launcher.nodes=4"]
    )
    assert isinstance(slurm.pretrain.launcher, SlurmLauncherConfig)
    # A stage started on a workstation resumes on the cluster from the same checkpoints.
    assert slurm.pretrain.key_config() == local.pretrain.key_config()


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("pretrain.launcher.kind=mesos", "pretrain.launcher"),
        ("pretrain.launcher.partition=gpu;reboot", "partition"),
        ("pretrain.launcher.shared_dir=/shared dir", "shared_dir"),
        ("pretrain.launcher.time_limit=forever", "time_limit"),
    ],
)
def test_a_bad_launcher_value_names_the_field(override: str, named: str) -> None:
    kind = [] if "kind=" in override else ["pretrain.launcher.kind=slurm"]
    with pytest.raises(JobConfigError, match=named):
        load_job_config(preset_name="micro", overrides=[*kind, override])


def test_a_secret_in_the_launchers_env_is_refused() -> None:
    with pytest.raises(JobConfigError, match=r"WANDB_API_KEY looks like a secret"):
        load_job_config(
            preset_name="micro", overrides=["pretrain.launcher.kind=slurm", "pretrain.launcher.env.WANDB_API_KEY=x"]
        )


def test_preflight_refuses_a_workdir_the_nodes_cannot_see(tmp_path: Path) -> None:
    config = load_job_config(
        preset_name="micro",
        overrides=[f"workdir={tmp_path}/run", "pretrain.launcher.kind=slurm", "pretrain.launcher.shared_dir=/shared"],
    )
    with pytest.raises(PreflightError, match=r"not under pretrain.launcher.shared_dir=/shared"):
        preflight(config, ["pretrain"])


def test_the_sbatch_script_of_a_cpu_stage(tmp_path: Path) -> None:
    config = load_job_config(
        preset_name="micro",
        overrides=[
            "pretrain.launcher.kind=slurm", "pretrain.launcher.nodes=2", f"pretrain.launcher.shared_dir={tmp_path}",
            "pretrain.launcher.partition=cpu", "pretrain.launcher.secret_env=[HF_TOKEN]",
        ],
    )  # fmt: skip
    launcher = build_launcher(config.pretrain.launcher, config.pretrain, name="pretrain")
    assert isinstance(launcher, SlurmLauncher)
    spec = LaunchSpec(
        module="d9d.flows.jobs.pretrain.program",
        args=["--config", str(tmp_path / "run it" / "job.yaml")],
        nproc_per_node=2,
        log_file=tmp_path / "launch.log",
    )
    script = render_cluster_job("slurm", launcher.job_spec(spec))
    assert "#SBATCH --nodes=2" in script and "#SBATCH --partition=cpu" in script
    assert "--gpus-per-node" not in script and "--mem=" not in script  # a CPU job asks for no GPU
    assert "#SBATCH --requeue" in script and "#SBATCH --open-mode=append" in script
    assert "--nproc-per-node 2" in script
    assert f"-m d9d.flows.jobs.pretrain.program --config '{tmp_path}/run it/job.yaml'" in script  # quoted
    assert "HF_TOKEN:?" in script  # required from the environment of sbatch, never written


def test_scontrol_output_and_end_states() -> None:
    line = (
        "JobId=42 JobName=d9d-pretrain UserId=root(0) JobState=TIMEOUT Reason=TimeLimit Dependency=(null) "
        "Requeue=1 Restarts=0 BatchFlag=1 ExitCode=0:15 NodeList=gpu[01-02] StdOut=/shared/logs/d9d-pretrain-42.out"
    )
    state = parse_scontrol_job(line)
    assert state == SlurmJobState(
        state="TIMEOUT",
        exit_code="0:15",
        nodes="gpu[01-02]",
        reason="TimeLimit",
        log="/shared/logs/d9d-pretrain-42.out",
    )
    assert parse_scontrol_job("slurm_load_jobs error: Invalid job id specified") is None
    message = str(end_state_error("42", state, name="pretrain", log="/shared/logs/x.out"))
    assert "slurm job 42 (pretrain) on gpu[01-02] reached its time limit" in message
    assert "raise pretrain.launcher.time_limit" in message and "resumes from its newest complete checkpoint" in message
    failed = str(end_state_error("7", SlurmJobState(state="FAILED", exit_code="1:0"), name="evaluate", log="x"))
    assert "failed with exit code 1:0" in failed
