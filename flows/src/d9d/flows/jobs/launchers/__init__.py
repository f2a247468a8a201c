"""Where a launched stage's ranks run: this machine (`local`), a Slurm job (`slurm`) or a Kubernetes Job
(`kubernetes`), chosen by the stage section's `launcher` setting. No Prefect here."""

from d9d.flows.jobs.launchers.base import ClusterJob, Launcher, observe_cluster_jobs, report_cluster_job
from d9d.flows.jobs.launchers.build import build_launcher
from d9d.flows.jobs.launchers.config import (
    AnyLauncherConfig,
    KubernetesLauncherConfig,
    LocalLauncherConfig,
    SlurmLauncherConfig,
)

__all__ = [
    "AnyLauncherConfig",
    "ClusterJob",
    "KubernetesLauncherConfig",
    "Launcher",
    "LocalLauncherConfig",
    "SlurmLauncherConfig",
    "build_launcher",
    "observe_cluster_jobs",
    "report_cluster_job",
]
