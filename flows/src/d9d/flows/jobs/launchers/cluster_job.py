"""Multi-node torchrun jobs for clusters: `templates/slurm/*.sbatch.j2` and `templates/k8s/*.yaml.j2` (next to this
module, shipped in the wheel) rendered with Jinja2; the Slurm launcher submits the first, `d9d render-job` prints
either.

A `ClusterJobSpec` says how many nodes and GPUs, which rank program and job file, and where shared storage is; the
templates turn it into an sbatch script (`srun torchrun` on every node, c10d rendezvous on the first node) or a
Kubernetes indexed Job with a headless Service for the rendezvous. Jinja2 (not Prefect's `{{ var }}` job-template
variables) because the output must be a complete, reviewable file that also works without Prefect (`sbatch`,
`kubectl apply`); undefined variables are errors, never empty strings.

Every value that reaches a template is checked against a strict pattern first (a module name, absolute paths of
safe characters, Slurm partition and account names, environment variable names, Kubernetes names; no newlines
anywhere), and the templates quote what they interpolate (`shell_quote`, `json`): a hostile value is refused, not
rendered. Secrets never go into the rendered file: `env` refuses names that look like one (`*_KEY`, `*TOKEN*`,
`*SECRET*`, `*PASSWORD*`); `secret_env` names them instead, read from a Kubernetes Secret (`secretKeyRef`) or, on
Slurm, required from the environment that runs `sbatch` (which Slurm exports to the job).

Stopping: a node runs `python -m d9d.flows.jobs.launch --grace G -- torchrun ...`, which hands the scheduler's stop
signal to the ranks directly (torchrun would SIGKILL them 30 s after forwarding it). Slurm signals the job steps
(`--signal=USR1@G+60`) before the time limit; Kubernetes gives the pod `terminationGracePeriodSeconds` = G+30.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ClusterKind = Literal["slurm", "kubernetes"]
TEMPLATES: dict[ClusterKind, str] = {"slurm": "slurm/torchrun.sbatch.j2", "kubernetes": "k8s/torchrun-job.yaml.j2"}
TEMPLATES_DIR = Path(__file__).parent / "templates"

# NCCL defaults for multi-node jobs: fail loudly on a hung collective instead of waiting forever, and log enough
# at start-up to see which transport (IB, sockets) was chosen. Override per cluster in `env`.
NCCL_ENV: dict[str, str] = {
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    "NCCL_IB_DISABLE": "0",
}


MODULE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
PATH_PATTERN = re.compile(r"^/[A-Za-z0-9._@+/-]*$")
SLURM_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}(,[A-Za-z0-9_.-]{1,64})*$"  # a partition list: gpu,gpu-long
ENV_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
SECRET_NAME_PATTERN = re.compile(r"(_KEY$|API_KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
K8S_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
K8S_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
IMAGE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$"


class SecretRef(BaseModel):
    """A key of a Kubernetes Secret (`secretKeyRef`): the only way a secret reaches a rendered job."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    secret: str = Field(pattern=K8S_SUBDOMAIN_PATTERN, description="the Secret's name")
    key: str = Field(pattern=r"^[-._A-Za-z0-9]{1,253}$", description="the key inside it")


class ClusterJobSpec(BaseModel):
    """One multi-node torchrun job: nodes x GPUs running `python -m module --config config` on every rank."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        default="d9d-pretrain",
        pattern=r"^[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?$",
        description="job name (lowercase letters, digits and dashes: a Kubernetes name)",
    )
    nodes: int = Field(default=2, ge=1)
    gpus_per_node: int = Field(default=8, ge=0, description="GPUs asked per node (0: a CPU job)")
    ranks_per_node: int | None = Field(default=None, ge=1, description="torchrun ranks per node; None: gpus_per_node")
    cpus_per_node: int | None = Field(default=64, ge=1, description="None: the scheduler's default")
    memory: str | None = Field(
        default="512Gi",
        pattern=r"^[1-9][0-9]*(Mi|Gi|Ti)$",
        description="memory per node, e.g. 512Gi (--mem=512G); None: the scheduler's default",
    )
    module: str = Field(
        default="d9d.flows.jobs.pretrain.program", pattern=MODULE_PATTERN, description="the rank program (python -m)"
    )
    config: Path = Field(default=Path("/shared/d9d/jobs/pretrain.yaml"), description="the job file, on shared storage")
    args: tuple[str, ...] | None = Field(
        default=None, description="the rank program's arguments; None: --config CONFIG"
    )
    shared_dir: Path = Field(default=Path("/shared/d9d"), description="workdir, checkpoints and logs: on every node")
    rdzv_port: int = Field(default=29500, ge=1, le=65535)
    max_restarts: int = Field(default=0, ge=0, description="torchrun restarts of the whole group after a failure")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment; overrides the NCCL defaults")
    secret_env: dict[str, SecretRef] = Field(
        default_factory=dict,
        description="secret environment (WANDB_API_KEY, HF_TOKEN): from a Secret on Kubernetes; on Slurm it must be "
        "set where sbatch runs; never written into the job file",
    )
    stop_grace_seconds: int = Field(
        default=300, ge=10, le=3600, description="from the stop signal to SIGKILL: the emergency checkpoint's time"
    )
    # Slurm
    partition: str | None = Field(default=None, pattern=SLURM_NAME_PATTERN)
    account: str | None = Field(default=None, pattern=SLURM_NAME_PATTERN)
    time_limit: str = Field(default="24:00:00", pattern=r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")
    venv: Path | None = Field(default=None, description="a virtualenv on shared storage to activate (Slurm)")
    requeue: bool = Field(
        default=True, description="Slurm may requeue the job after preemption or a node failure; it resumes"
    )
    # Kubernetes
    image: str = Field(default="ghcr.io/d9d/d9d-train:0.1.0", pattern=IMAGE_PATTERN)
    namespace: str = Field(default="default", pattern=K8S_LABEL_PATTERN)
    shared_claim: str = Field(
        default="d9d-shared", pattern=K8S_SUBDOMAIN_PATTERN, description="a ReadWriteMany PVC mounted at shared_dir"
    )

    @field_validator("config", "shared_dir", "venv")
    @classmethod
    def _safe_absolute_path(cls, path: Path | None) -> Path | None:
        return None if path is None else check_safe_path(path)

    @field_validator("env")
    @classmethod
    def _plain_environment(cls, env: dict[str, str]) -> dict[str, str]:
        return check_environment(env)

    @field_validator("args")
    @classmethod
    def _plain_arguments(cls, args: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for arg in args or ():
            if any(character in arg for character in "\n\r\0"):
                raise ValueError(f"args holds {arg!r}, with a newline or NUL character")
        return args

    @model_validator(mode="after")
    def _ranks_on_every_node(self) -> ClusterJobSpec:
        if self.nproc_per_node < 1:
            raise ValueError(
                f"gpus_per_node={self.gpus_per_node} and ranks_per_node={self.ranks_per_node} start no rank on a "
                "node; set ranks_per_node (e.g. 2 for a CPU job) or gpus_per_node >= 1"
            )
        return self

    @property
    def nproc_per_node(self) -> int:
        """torchrun's ranks per node: `ranks_per_node`, or one per GPU."""
        return self.ranks_per_node if self.ranks_per_node is not None else self.gpus_per_node

    @field_validator("secret_env")
    @classmethod
    def _secret_names(cls, secrets: dict[str, SecretRef]) -> dict[str, SecretRef]:
        for name in secrets:
            if not ENV_NAME_PATTERN.fullmatch(name):
                raise ValueError(f"secret_env name {name!r} is not a variable name (letters, digits, _)")
        return secrets

    @property
    def kubernetes_resources(self) -> dict[str, dict[str, int | str]]:
        """A pod's requests and limits: the GPUs (none for a CPU job), CPUs and memory that are set."""
        requests: dict[str, int | str] = {}
        limits: dict[str, int | str] = {}
        if self.gpus_per_node:
            requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = self.gpus_per_node
        if self.cpus_per_node is not None:
            requests["cpu"] = self.cpus_per_node
        if self.memory is not None:
            requests["memory"] = limits["memory"] = self.memory
        return {"requests": requests, "limits": limits}

    @property
    def program_args(self) -> tuple[str, ...]:
        return self.args if self.args is not None else ("--config", str(self.config))

    @property
    def environment(self) -> dict[str, str]:
        return {**NCCL_ENV, "PYTHONUNBUFFERED": "1", "D9D_HOME": str(self.shared_dir / "home"), **self.env}

    @property
    def slurm_signal_seconds(self) -> int:
        """When Slurm sends USR1 before the time limit: the grace period and a minute for the scheduler's lag."""
        return self.stop_grace_seconds + 60

    @property
    def kubernetes_grace_seconds(self) -> int:
        """The pod's terminationGracePeriodSeconds: the node launcher's grace period, and 30 s to exit."""
        return self.stop_grace_seconds + 30


def check_safe_path(path: Path) -> Path:
    """`path` as is, when it is an absolute path of safe characters (it goes into #SBATCH lines and commands)."""
    if not PATH_PATTERN.fullmatch(str(path)):
        raise ValueError(
            f"{str(path)!r} is not an absolute path of letters, digits and ._@+/- (no spaces, quotes, $ or "
            "newlines): it goes into #SBATCH lines and shell commands"
        )
    return path


def check_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` as is, when every name is a variable name that does not look like a secret and no value has a newline."""
    for name, value in env.items():
        if not ENV_NAME_PATTERN.fullmatch(name):
            raise ValueError(f"env name {name!r} is not a variable name (letters, digits, _; not a digit first)")
        if SECRET_NAME_PATTERN.search(name):
            raise ValueError(
                f"env.{name} looks like a secret: it would be written into the job file; name it in "
                f"secret_env instead ({name}: {{secret: SECRET_NAME, key: KEY}})"
            )
        if any(character in value for character in "\n\r\0"):
            raise ValueError(f"env.{name} = {value!r} holds a newline or NUL character")
    return env


def render_cluster_job(kind: ClusterKind, spec: ClusterJobSpec, *, templates: Path = TEMPLATES_DIR) -> str:
    """The job file for `kind` (an sbatch script, or Kubernetes YAML) from the template under `templates`."""
    import jinja2

    path = templates / TEMPLATES[kind]
    if not path.is_file():
        raise FileNotFoundError(f"no {kind} template at {path}; pass a directory with {TEMPLATES[kind]} in it")
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
