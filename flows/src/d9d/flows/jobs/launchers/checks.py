"""What a stage's launcher setting means before anything starts: whether it can run here (preflight), and how many
of the `gpus` concurrency limit's slots the stage holds while it runs."""

from __future__ import annotations

import shutil
from pathlib import Path

from d9d.flows.jobs.launchers.config import (
    AnyLauncherConfig,
    KubernetesLauncherConfig,
    LocalLauncherConfig,
    SlurmLauncherConfig,
)
from d9d.flows.jobs.stage_spec import PreflightError
from d9d.flows.jobs.topology import RankTopology


def launcher_of(section: object) -> AnyLauncherConfig | None:
    """The `launcher` of a launched stage's section (pretrain, finetune, evaluate); None for the other stages."""
    launcher = getattr(section, "launcher", None)
    return (
        launcher if isinstance(launcher, LocalLauncherConfig | SlurmLauncherConfig | KubernetesLauncherConfig) else None
    )


def gpu_slots(section: object) -> int:
    """The `gpus` slots a stage holds while it runs: its nodes x GPUs per node (0 for a CPU stage, or no launcher)."""
    launcher = launcher_of(section)
    if launcher is None or not isinstance(section, RankTopology):
        return 0
    return launcher.slots(section)


def check_launcher(section_name: str, section: object, output: Path) -> None:
    """A cluster launcher needs its output on the shared storage and (Slurm) the Slurm commands on PATH."""
    launcher = launcher_of(section)
    match launcher:
        case None | LocalLauncherConfig():
            return
        case SlurmLauncherConfig() | KubernetesLauncherConfig():
            shared = launcher.shared_dir
            if not output.resolve().is_relative_to(shared.resolve()):
                raise PreflightError(
                    f"{section_name} writes to {output}, which is not under {section_name}.launcher.shared_dir="
                    f"{shared}: the {launcher.kind} nodes would not see its job file and checkpoints; set workdir "
                    f"(or {section_name}.output) to a directory under {shared}"
                )
    if isinstance(launcher, SlurmLauncherConfig) and shutil.which("sbatch") is None:
        raise PreflightError(
            f"{section_name}.launcher.kind=slurm but sbatch is not on PATH here: run d9d on a Slurm login node "
            f"(or a worker that can submit), or set {section_name}.launcher.kind=local"
        )
