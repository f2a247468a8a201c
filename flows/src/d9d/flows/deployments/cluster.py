"""The cluster job spec and its templates, for `d9d render-job`: they live with the launchers that submit them
(`d9d.flows.jobs.launchers.cluster_job`), re-exported here under their earlier name."""

from d9d.flows.jobs.launchers.cluster_job import (
    NCCL_ENV,
    TEMPLATES,
    TEMPLATES_DIR,
    ClusterJobSpec,
    ClusterKind,
    SecretRef,
    render_cluster_job,
)

__all__ = [
    "NCCL_ENV",
    "TEMPLATES",
    "TEMPLATES_DIR",
    "ClusterJobSpec",
    "ClusterKind",
    "SecretRef",
    "render_cluster_job",
]
