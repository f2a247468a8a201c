"""Multi-node torchrun jobs for clusters: `infra/slurm/*.sbatch.j2` and `infra/k8s/*.yaml.j2` rendered with Jinja2.

A `ClusterJobSpec` says how many nodes and GPUs, which rank program and job file, and where shared storage is; the
templates turn it into an sbatch script (`srun torchrun` on every node, c10d rendezvous on the first node) or a
Kubernetes indexed Job with a headless Service for the rendezvous. Jinja2 (not Prefect's `{{ var }}` job-template
variables) because the output must be a complete, reviewable file that also works without Prefect (`sbatch`,
`kubectl apply`); undefined variables are errors, never empty strings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ClusterKind = Literal["slurm", "kubernetes"]
TEMPLATES: dict[ClusterKind, str] = {"slurm": "slurm/torchrun.sbatch.j2", "kubernetes": "k8s/torchrun-job.yaml.j2"}

# NCCL defaults for multi-node jobs: fail loudly on a hung collective instead of waiting forever, and log enough
# at start-up to see which transport (IB, sockets) was chosen. Override per cluster in `env`.
NCCL_ENV: dict[str, str] = {
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    "NCCL_IB_DISABLE": "0",
}


class ClusterJobSpec(BaseModel):
    """One multi-node torchrun job: nodes x GPUs running `python -m module --config config` on every rank."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        default="d9d-pretrain",
        pattern=r"^[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?$",
        description="job name (lowercase letters, digits and dashes: a Kubernetes name)",
    )
    nodes: int = Field(default=2, ge=1)
    gpus_per_node: int = Field(default=8, ge=1)
    cpus_per_node: int = Field(default=64, ge=1)
    memory: str = Field(
        default="512Gi", pattern=r"^[1-9][0-9]*(Mi|Gi|Ti)$", description="memory per node, e.g. 512Gi (--mem=512G)"
    )
    module: str = Field(default="d9d.flows.jobs.pretrain.program", description="the rank program (python -m)")
    config: Path = Field(default=Path("/shared/d9d/jobs/pretrain.yaml"), description="the job file, on shared storage")
    shared_dir: Path = Field(default=Path("/shared/d9d"), description="workdir, checkpoints and logs: on every node")
    rdzv_port: int = Field(default=29500, ge=1, le=65535)
    max_restarts: int = Field(default=0, ge=0, description="torchrun restarts of the whole group after a failure")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment; overrides the NCCL defaults")
    # Slurm
    partition: str | None = None
    account: str | None = None
    time_limit: str = Field(default="24:00:00", pattern=r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")
    venv: Path | None = Field(default=None, description="a virtualenv on shared storage to activate (Slurm)")
    # Kubernetes
    image: str = "ghcr.io/d9d/d9d-train:0.1.0"
    namespace: str = "default"
    shared_claim: str = Field(default="d9d-shared", description="a ReadWriteMany PVC mounted at shared_dir")

    @property
    def environment(self) -> dict[str, str]:
        return {**NCCL_ENV, "PYTHONUNBUFFERED": "1", "D9D_HOME": str(self.shared_dir / "home"), **self.env}


def render_cluster_job(kind: ClusterKind, spec: ClusterJobSpec, *, templates: Path) -> str:
    """The job file for `kind` (an sbatch script, or Kubernetes YAML) from the template under `templates`."""
    import jinja2

    path = templates / TEMPLATES[kind]
    if not path.is_file():
        raise FileNotFoundError(f"no {kind} template at {path}; pass the repository's infra/ directory")
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        # Shell and YAML, not HTML: values are quoted by the templates' shell_quote and json filters instead.
        autoescape=False,  # noqa: S701
    )
    environment.filters["shell_quote"] = _shell_quote
    environment.filters["json"] = _json
    return environment.get_template(TEMPLATES[kind]).render(spec=spec, env=spec.environment)


def _shell_quote(value: object) -> str:
    import shlex

    return shlex.quote(str(value))


def _json(value: object) -> str:
    import json

    # JSON strings are valid YAML scalars: the safe way to put any value into a YAML template.
    return json.dumps(value if isinstance(value, int | float | bool | list | dict) else str(value))
