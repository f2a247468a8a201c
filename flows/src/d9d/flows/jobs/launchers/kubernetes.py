"""The `kubernetes` launcher: an indexed batch/v1 Job (one pod per node, its completion index the node rank) and a
headless Service (pod 0's DNS name hosts the c10d rendezvous), built with the official client's models, submitted
through `BatchV1Api`/`CoreV1Api`, followed to its end, and deleted when the stage is stopped.

- Follow: the Job's status and its pods (phase, node) every `poll_seconds`; pod 0's log (rank 0 prints the progress
  records) is streamed from the moment it runs, through the same line dispatch as a local torchrun's pipe.
- End: the Job's `Complete` condition returns; `Failed` (a pod failed: `backoffLimit` is 0, torchrun's group
  cannot go on without a node) raises a `LaunchError` with the failed pods' reasons and their last log lines.
- Stop: SIGINT/SIGTERM (a Prefect worker cancelling the flow run) or a crash deletes the Job (foreground: its pods
  get SIGTERM, which each pod's d9d node launcher hands to its ranks; they checkpoint within the grace period) and
  the Service; on a stop the launcher waits until the Job is gone, then raises `LaunchCancelled`.

The client is optional (`pip install d9d-flows[kubernetes]`); it is imported when a stage asks for this launcher.
The connection comes from the kubeconfig (or the in-cluster service account), or from `api_client` (tests).
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from d9d.flows.jobs.launch import LaunchCancelled, LaunchError, LaunchSpec
from d9d.flows.jobs.launchers.base import (
    ClusterJob,
    LineCallback,
    LineSink,
    ProgressCallback,
    StopSignals,
    report_cluster_job,
)
from d9d.flows.jobs.launchers.cluster_job import ClusterJobSpec
from d9d.flows.jobs.launchers.config import KubernetesLauncherConfig
from d9d.flows.jobs.topology import RankTopology

CONTAINER = "torchrun"
SHM_PATH = "/dev/shm"  # noqa: S108 - the pod's own memory volume: NCCL needs more than the default 64 MiB
FINISHED_TTL_SECONDS = 24 * 3600  # a finished Job (and its pods' logs) stays a day for inspection


class KubernetesJobError(LaunchError):
    """The Kubernetes Job failed, or the API refused it (the message names the pods and their reasons)."""


def job_name(stage: str) -> str:
    """A fresh Job name for a launch of `stage`: a retry never collides with the Job of an earlier attempt."""
    return f"d9d-{stage}-{secrets.token_hex(3)}"


def build_manifests(job: ClusterJobSpec, *, service_account: str | None = None) -> tuple[Any, Any]:
    """The headless Service and the indexed Job for `job` (validated values), as `kubernetes.client` models."""
    from kubernetes import client

    labels = {"app.kubernetes.io/name": "d9d", "d9d/job": job.name}
    service = client.V1Service(
        api_version="v1",
        kind="Service",
        metadata=client.V1ObjectMeta(name=job.name, namespace=job.namespace, labels=labels),
        spec=client.V1ServiceSpec(
            cluster_ip="None",
            publish_not_ready_addresses=True,  # the rendezvous is needed before any pod is ready
            selector={"job-name": job.name},
            ports=[client.V1ServicePort(name="rendezvous", port=job.rdzv_port)],
        ),
    )
    command = [
        "python", "-m", "d9d.flows.jobs.launch", f"--grace={job.stop_grace_seconds}", "--",
        "torchrun", f"--nnodes={job.nodes}", f"--nproc-per-node={job.nproc_per_node}",
        "--node-rank=$(JOB_COMPLETION_INDEX)", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=$(MASTER_ADDR):{job.rdzv_port}", f"--rdzv-id={job.name}",
        f"--max-restarts={job.max_restarts}", "-m", job.module, *job.program_args,
    ]  # fmt: skip
    env = [
        client.V1EnvVar(
            name="JOB_COMPLETION_INDEX",
            value_from=client.V1EnvVarSource(
                field_ref=client.V1ObjectFieldSelector(
                    field_path="metadata.annotations['batch.kubernetes.io/job-completion-index']"
                )
            ),
        ),
        client.V1EnvVar(name="MASTER_ADDR", value=f"{job.name}-0.{job.name}.{job.namespace}.svc"),
        client.V1EnvVar(name="OMP_NUM_THREADS", value="1"),
        *(client.V1EnvVar(name=name, value=value) for name, value in job.environment.items()),
        *(
            client.V1EnvVar(
                name=name,
                value_from=client.V1EnvVarSource(
                    secret_key_ref=client.V1SecretKeySelector(name=ref.secret, key=ref.key)
                ),
            )
            for name, ref in job.secret_env.items()
        ),
    ]
    resources = job.kubernetes_resources
    container = client.V1Container(
        name=CONTAINER,
        image=job.image,
        command=command,
        env=env,
        ports=[client.V1ContainerPort(name="rendezvous", container_port=job.rdzv_port)],
        resources=client.V1ResourceRequirements(
            requests={name: str(value) for name, value in resources["requests"].items()} or None,
            limits={name: str(value) for name, value in resources["limits"].items()} or None,
        ),
        volume_mounts=[
            client.V1VolumeMount(name="shared", mount_path=str(job.shared_dir)),
            client.V1VolumeMount(name="dshm", mount_path=SHM_PATH),
        ],
    )
    pod = client.V1PodSpec(
        restart_policy="Never",
        subdomain=job.name,  # pods are <job>-<index>.<service>: pod 0 hosts the rendezvous
        termination_grace_period_seconds=job.kubernetes_grace_seconds,
        service_account_name=service_account,
        containers=[container],
        volumes=[
            client.V1Volume(
                name="shared",
                persistent_volume_claim=client.V1PersistentVolumeClaimVolumeSource(claim_name=job.shared_claim),
            ),
            client.V1Volume(name="dshm", empty_dir=client.V1EmptyDirVolumeSource(medium="Memory")),
        ],
    )
    batch_job = client.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=client.V1ObjectMeta(name=job.name, namespace=job.namespace, labels=labels),
        spec=client.V1JobSpec(
            completion_mode="Indexed",
            completions=job.nodes,
            parallelism=job.nodes,
            backoff_limit=0,  # one failed pod fails the group: a rerun resumes from the newest checkpoint
            ttl_seconds_after_finished=FINISHED_TTL_SECONDS,
            template=client.V1PodTemplateSpec(metadata=client.V1ObjectMeta(labels=labels), spec=pod),
        ),
    )
    return service, batch_job


@dataclass(frozen=True, kw_only=True)
class JobProgress:
    state: str  # Pending, Running, Complete, Failed
    pods: dict[str, tuple[str, str]]  # pod name -> (phase, node)
    reason: str = ""


@dataclass
class KubernetesLauncher:
    config: KubernetesLauncherConfig
    topology: RankTopology
    name: str
    api_client: Any | None = None  # a kubernetes.client.ApiClient; None: the kubeconfig or in-cluster config
    _log_lines: queue.Queue[str | None] = field(default_factory=queue.Queue, init=False)

    def job_spec(self, spec: LaunchSpec, name: str) -> ClusterJobSpec:
        config = self.config
        return ClusterJobSpec(
            **config.common_job_fields(self.topology, spec),
            name=name,
            secret_env=config.secret_env,
            image=config.image,
            namespace=config.namespace,
            shared_claim=config.shared_claim,
        )

    def _apis(self) -> tuple[Any, Any]:
        from kubernetes import client, config

        api_client = self.api_client
        if api_client is None:
            try:
                config.load_kube_config()  # type: ignore[no-untyped-call]
            except config.ConfigException:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
            api_client = client.ApiClient()
        return client.BatchV1Api(api_client), client.CoreV1Api(api_client)

    def run(
        self,
        spec: LaunchSpec,
        *,
        on_progress: ProgressCallback | None = None,
        on_line: LineCallback | None = None,
        note: LineCallback | None = None,
    ) -> None:
        from kubernetes.client.exceptions import ApiException

        job = self.job_spec(spec, job_name(self.name))
        service, batch_job = build_manifests(job, service_account=self.config.service_account)
        batch, core = self._apis()
        say = note or (lambda message: None)
        spec.log_file.parent.mkdir(parents=True, exist_ok=True)
        with spec.log_file.open("a", encoding="utf-8") as log, StopSignals() as stop:
            log.write(f"$ kubernetes: Job {job.namespace}/{job.name} ({job.nodes} pod(s) x {job.nproc_per_node})\n")
            log.flush()
            try:
                core.create_namespaced_service(job.namespace, service)
                batch.create_namespaced_job(job.namespace, batch_job)
            except ApiException as error:
                raise KubernetesJobError(
                    f"the Kubernetes API refused the Job {job.namespace}/{job.name}: {error.status} {error.reason}: "
                    f"{str(error.body)[:500]}"
                ) from error
            say(f"{self.name}: created Kubernetes Job {job.namespace}/{job.name}")
            sink = LineSink(log, on_progress, on_line)
            last = self._follow(batch, core, job, sink=sink, stop=stop, say=say)
        if stop.stopping:
            stop.finish()  # re-raises Prefect's TerminationSignal, or hands the signal on (which may raise too)
            signum = stop.signum if stop.signum is not None else signal.SIGTERM
            raise LaunchCancelled(signum, f"Kubernetes Job {job.name} ({self.name}) deleted; it has ended")
        if last.state != "Complete":
            failed = {pod: phase for pod, (phase, _) in last.pods.items() if phase == "Failed"}
            tails = "; ".join(f"{pod}: {self._log_tail(core, job, pod)}" for pod in failed)
            raise KubernetesJobError(
                f"Kubernetes Job {job.namespace}/{job.name} ({self.name}) failed ({last.reason or 'no reason given'});"
                f" failed pods: {', '.join(failed) or 'none reported'}; {tails or 'no log'}; running the stage again "
                "resumes from its newest complete checkpoint"
            )

    def _follow(
        self, batch: Any, core: Any, job: ClusterJobSpec, *, sink: LineSink, stop: StopSignals, say: LineCallback
    ) -> JobProgress:
        shown: JobProgress | None = None
        deleted_at: float | None = None
        streaming: set[str] = set()
        next_poll = 0.0

        def poll() -> JobProgress | None:
            """One look at the Job (and a step of stopping it); its last progress once it has ended."""
            nonlocal shown, deleted_at, next_poll
            self._drain(sink)
            if stop.stopping and deleted_at is None:
                say(f"{self.name}: stopping; deleting Kubernetes Job {job.name}")
                self._delete(batch, core, job)
                deleted_at = time.monotonic()
            now = time.monotonic()
            if now >= next_poll:
                state = self._state(batch, core, job)
                if state is None:  # deleted: gone with its pods
                    return shown or JobProgress(state="Deleted", pods={})
                if shown is None or (state.state, state.pods) != (shown.state, shown.pods):
                    nodes = ", ".join(f"{pod} ({phase} on {node or '-'})" for pod, (phase, node) in state.pods.items())
                    say(f"{self.name}: Kubernetes Job {job.name} {state.state}: {nodes or 'no pod yet'}")
                    report_cluster_job(
                        ClusterJob(
                            scheduler="kubernetes", job_id=f"{job.namespace}/{job.name}", name=job.name,
                            state=state.state, nodes=nodes, log=f"kubectl logs -n {job.namespace} job/{job.name}",
                        )
                    )  # fmt: skip
                    shown = state
                first = f"{job.name}-0"
                for pod, (phase, _) in state.pods.items():
                    if pod.startswith(first) and phase != "Pending" and pod not in streaming:
                        streaming.add(pod)
                        self._stream(core, job, pod)
                if state.state in ("Complete", "Failed") and deleted_at is None:
                    time.sleep(0.5)  # the log stream's last lines
                    self._drain(sink)
                    return state
                next_poll = now + (1.0 if deleted_at is not None else self.config.poll_seconds)
            if deleted_at is not None and now > deleted_at + self.config.stop_grace_seconds + 120:
                raise KubernetesJobError(f"Kubernetes Job {job.name} still exists long after it was deleted")
            return None

        last: JobProgress | None = None
        try:
            while last is None:
                try:
                    last = poll()
                    if last is None:
                        time.sleep(0.2)
                except BaseException as error:
                    if not stop.caught(error):
                        raise  # a crash, or a second interrupt: the Job is deleted below
            return last
        finally:
            if last is None and deleted_at is None:
                with contextlib.suppress(Exception):
                    self._delete(batch, core, job)  # a crash of the flow run: leave no Job behind
            elif last is not None:
                with contextlib.suppress(Exception):
                    core.delete_namespaced_service(job.name, job.namespace)

    def _state(self, batch: Any, core: Any, job: ClusterJobSpec) -> JobProgress | None:
        from kubernetes.client.exceptions import ApiException

        try:
            read = batch.read_namespaced_job_status(job.name, job.namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        pods = core.list_namespaced_pod(job.namespace, label_selector=f"job-name={job.name}")
        phases = {
            pod.metadata.name: (pod.status.phase if pod.status else "Pending", pod.spec.node_name or "")
            for pod in pods.items
        }
        status = read.status
        for condition in (status.conditions if status else None) or []:
            if condition.status == "True" and condition.type in ("Complete", "Failed"):
                return JobProgress(state=condition.type, pods=phases, reason=condition.reason or "")
        running = any(phase == "Running" for phase, _ in phases.values())
        return JobProgress(state="Running" if running else "Pending", pods=phases)

    def _stream(self, core: Any, job: ClusterJobSpec, pod: str) -> None:
        """Copy pod `pod`'s log lines into the queue the follow loop drains, from a thread of its own."""

        def read() -> None:
            rest = b""
            try:
                response = core.read_namespaced_pod_log(
                    pod, job.namespace, container=CONTAINER, follow=True, _preload_content=False
                )
                for chunk in response.stream(4096):
                    *lines, rest = (rest + chunk).split(b"\n")
                    for line in lines:
                        self._log_lines.put(line.decode("utf-8", errors="replace"))
            except Exception as error:  # noqa: BLE001 - a broken stream must not end the follow; the log stays on the pod
                self._log_lines.put(f"d9d: the log stream of pod {pod} broke: {error!r}")
            if rest:
                self._log_lines.put(rest.decode("utf-8", errors="replace"))

        threading.Thread(target=read, name=f"d9d-k8s-log-{pod}", daemon=True).start()

    def _drain(self, sink: LineSink) -> None:
        while True:
            try:
                line = self._log_lines.get_nowait()
            except queue.Empty:
                return
            if line is not None:
                sink(line)

    def _log_tail(self, core: Any, job: ClusterJobSpec, pod: str) -> str:
        with contextlib.suppress(Exception):
            text = core.read_namespaced_pod_log(pod, job.namespace, container=CONTAINER, tail_lines=5)
            return " | ".join(str(text).strip().splitlines()[-5:])
        return "(log not readable)"

    def _delete(self, batch: Any, core: Any, job: ClusterJobSpec) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        with contextlib.suppress(ApiException):
            batch.delete_namespaced_job(
                job.name, job.namespace, body=client.V1DeleteOptions(propagation_policy="Foreground")
            )
        with contextlib.suppress(ApiException):
            core.delete_namespaced_service(job.name, job.namespace)
