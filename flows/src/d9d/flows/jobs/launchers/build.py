"""`build_launcher`: the launcher a stage's `launcher` setting names."""

from __future__ import annotations

from d9d.flows.jobs.launchers.base import Launcher
from d9d.flows.jobs.launchers.config import (
    AnyLauncherConfig,
    KubernetesLauncherConfig,
    LocalLauncherConfig,
    SlurmLauncherConfig,
)
from d9d.flows.jobs.launchers.local import LocalLauncher
from d9d.flows.jobs.launchers.slurm import SlurmLauncher
from d9d.flows.jobs.topology import RankTopology


def build_launcher(config: AnyLauncherConfig, topology: RankTopology, *, name: str) -> Launcher:
    """The launcher of stage `name` (its section's `launcher`), for ranks laid out as `topology` says."""
    match config:
        case LocalLauncherConfig():
            return LocalLauncher()
        case SlurmLauncherConfig():
            return SlurmLauncher(config, topology, name)
        case KubernetesLauncherConfig():
            from d9d.flows.jobs.launchers.kubernetes import KubernetesLauncher  # the kubernetes client is optional

            return KubernetesLauncher(config, topology, name)
