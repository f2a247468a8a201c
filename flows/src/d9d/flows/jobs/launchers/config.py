"""Where a launched stage's ranks run: the `launcher` setting of the pretrain, finetune and evaluate sections.

- `local` (the default): `torchrun` on this machine, as before this setting existed.
- `slurm`: an sbatch job (`templates/slurm/torchrun.sbatch.j2`) of `nodes` nodes, followed to its end.
- `kubernetes`: an indexed Job and a headless Service (one pod per node), followed to its end.

The rank layout on a node (`nproc_per_node`, the mesh degrees, the device) stays in the section's `RankTopology`;
a launcher says how many nodes, what to ask the scheduler for and what the job's environment is. None of it changes
what is computed, so none of it is in the stage's key: a stage started locally resumes on Slurm from the same
checkpoints. No Prefect here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from d9d.flows.jobs.launch import STACKS_ENV, LaunchSpec
from d9d.flows.jobs.launchers.cluster_job import (
    ENV_NAME_PATTERN,
    IMAGE_PATTERN,
    K8S_LABEL_PATTERN,
    K8S_SUBDOMAIN_PATTERN,
    SLURM_NAME_PATTERN,
    SecretRef,
    check_environment,
    check_safe_path,
)
from d9d.flows.jobs.topology import RankTopology


class LocalLauncherConfig(BaseModel):
    """`torchrun` on this machine with `nproc_per_node` ranks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["local"] = "local"
    gpu_slots: int | None = Field(
        default=None,
        ge=0,
        description="slots this stage holds in the `gpus` concurrency limit while it runs; None: nproc_per_node "
        "when the ranks use GPUs (device cuda, or auto with CUDA here), else 0",
    )

    def slots(self, topology: RankTopology) -> int:
        if self.gpu_slots is not None:
            return self.gpu_slots
        if topology.device == "cuda":
            return topology.nproc_per_node
        if topology.device == "auto":
            import torch

            return topology.nproc_per_node if torch.cuda.is_available() else 0
        return 0


class _ClusterLauncherConfig(BaseModel):
    """What a Slurm and a Kubernetes job share: the nodes, what each asks for, shared storage and environment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: int = Field(default=1, ge=1, description="nodes (one torchrun of nproc_per_node ranks on each)")
    gpus_per_node: int | None = Field(
        default=None, ge=0, description="GPUs asked per node; None: nproc_per_node, or 0 with device=cpu"
    )
    cpus_per_node: int | None = Field(default=None, ge=1, description="CPUs asked per node; None: the default")
    memory: str | None = Field(
        default=None, pattern=r"^[1-9][0-9]*(Mi|Gi|Ti)$", description="memory per node (e.g. 512Gi); None: default"
    )
    shared_dir: Path = Field(
        default=Path("/shared/d9d"),
        description="storage every node and this machine see at the same path: the workdir must be under it",
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the ranks (no secrets)")
    stop_grace_seconds: int = Field(
        default=300, ge=10, le=3600, description="from the scheduler's stop signal to SIGKILL: the checkpoint's time"
    )
    rdzv_port: int = Field(default=29500, ge=1, le=65535, description="the c10d rendezvous port on the first node")
    poll_seconds: float = Field(default=5.0, gt=0, le=300, description="how often the job's state is asked")

    @field_validator("shared_dir")
    @classmethod
    def _safe_shared_dir(cls, path: Path) -> Path:
        return check_safe_path(path)

    @field_validator("env")
    @classmethod
    def _plain_env(cls, env: dict[str, str]) -> dict[str, str]:
        return check_environment(env)

    def gpus(self, topology: RankTopology) -> int:
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        return 0 if topology.device == "cpu" else topology.nproc_per_node

    def slots(self, topology: RankTopology) -> int:
        return self.nodes * self.gpus(topology)

    def common_job_fields(self, topology: RankTopology, spec: LaunchSpec) -> dict[str, Any]:
        """The job values every cluster launcher takes alike from this config and the stage's launch (the rest, a
        name, how secrets travel and the cluster's own fields, each launcher adds)."""
        return {
            "nodes": self.nodes,
            "gpus_per_node": self.gpus(topology),
            "ranks_per_node": spec.nproc_per_node,
            "cpus_per_node": self.cpus_per_node,
            "memory": self.memory,
            "module": spec.module,
            "args": tuple(spec.args),
            "shared_dir": self.shared_dir,
            "rdzv_port": self.rdzv_port,
            "env": {STACKS_ENV: str(spec.log_file.parent / "stacks"), **spec.env, **self.env},
            "stop_grace_seconds": self.stop_grace_seconds,
        }


class SlurmLauncherConfig(_ClusterLauncherConfig):
    """An sbatch job: `nodes` nodes, one `srun` task each running the d9d node launcher over torchrun."""

    kind: Literal["slurm"] = "slurm"
    partition: str | None = Field(default=None, pattern=SLURM_NAME_PATTERN)
    account: str | None = Field(default=None, pattern=SLURM_NAME_PATTERN)
    time_limit: str = Field(default="24:00:00", pattern=r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$", description="[D-]HH:MM:SS")
    requeue: bool = Field(
        default=True, description="let Slurm requeue the job after preemption or a node failure (it resumes)"
    )
    venv: Path | None = Field(default=None, description="a virtualenv on shared storage the job activates")
    secret_env: tuple[str, ...] = Field(
        default=(),
        description="secret variables (WANDB_API_KEY, HF_TOKEN) the job needs: never written into the script; "
        "they must be set where d9d runs (sbatch exports them to the job)",
    )

    @field_validator("venv")
    @classmethod
    def _safe_venv(cls, path: Path | None) -> Path | None:
        return None if path is None else check_safe_path(path)

    @field_validator("secret_env")
    @classmethod
    def _secret_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            if not ENV_NAME_PATTERN.fullmatch(name):
                raise ValueError(f"secret_env name {name!r} is not a variable name (letters, digits, _)")
        return names


class KubernetesLauncherConfig(_ClusterLauncherConfig):
    """An indexed batch/v1 Job (one pod per node) and a headless Service for the rendezvous on pod 0."""

    kind: Literal["kubernetes"] = "kubernetes"
    namespace: str = Field(default="default", pattern=K8S_LABEL_PATTERN)
    image: str = Field(default="ghcr.io/d9d/d9d-train:0.1.0", pattern=IMAGE_PATTERN)
    shared_claim: str = Field(
        default="d9d-shared", pattern=K8S_SUBDOMAIN_PATTERN, description="a ReadWriteMany PVC mounted at shared_dir"
    )
    secret_env: dict[str, SecretRef] = Field(
        default_factory=dict, description="secret variables from Secrets (secretKeyRef), never in the manifest"
    )
    service_account: str | None = Field(default=None, pattern=K8S_SUBDOMAIN_PATTERN)

    @field_validator("secret_env")
    @classmethod
    def _secret_names(cls, secrets: dict[str, SecretRef]) -> dict[str, SecretRef]:
        for name in secrets:
            if not ENV_NAME_PATTERN.fullmatch(name):
                raise ValueError(f"secret_env name {name!r} is not a variable name (letters, digits, _)")
        return secrets


def _launcher_kind(value: object) -> str:
    """The launcher kind of a config or its data; `local` when unnamed, so `--set pretrain.launcher.gpu_slots=2`
    sets a field of the default launcher instead of failing to tell which launcher is meant."""
    if isinstance(value, dict):
        return str(value.get("kind", "local"))
    return str(getattr(value, "kind", "local"))


AnyLauncherConfig = Annotated[
    Annotated[LocalLauncherConfig, Tag("local")]
    | Annotated[SlurmLauncherConfig, Tag("slurm")]
    | Annotated[KubernetesLauncherConfig, Tag("kubernetes")],
    Discriminator(_launcher_kind),
]


def launcher_nodes(launcher: AnyLauncherConfig) -> int:
    """The nodes a stage's ranks run on under `launcher` (`nproc_per_node` ranks on each)."""
    return 1 if isinstance(launcher, LocalLauncherConfig) else launcher.nodes
