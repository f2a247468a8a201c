"""The `kubernetes` launcher: the manifests it submits validated against Kubernetes' OpenAPI schema
(`kubernetes-validate`, schemas bundled: nothing is downloaded), and its follow/stop logic run through the official
client (`kubernetes.client.ApiClient`, `BatchV1Api`, `CoreV1Api`: real request building, real (de)serialisation of
Job, Pod and Status objects) against a small API server on 127.0.0.1 that plays one Job's life: created, pods
Pending, Running (pod 0 prints rank 0's log), then Complete or Failed, or deleted when the launcher deletes it.

No cluster here: scheduling, the pods' DNS names and the rendezvous, and the SIGTERM a deleted pod gets are not
exercised (docs/cluster.md says what was run where). Isolated: the server and the log stream are threads.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes extra is not installed")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")

from d9d.flows.jobs.launch import LaunchCancelled, LaunchSpec, progress_line  # noqa: E402
from d9d.flows.jobs.launchers import ClusterJob, KubernetesLauncherConfig, observe_cluster_jobs  # noqa: E402
from d9d.flows.jobs.launchers.cluster_job import SecretRef  # noqa: E402
from d9d.flows.jobs.launchers.kubernetes import KubernetesJobError, KubernetesLauncher, build_manifests  # noqa: E402
from d9d.flows.jobs.topology import RankTopology  # noqa: E402

pytestmark = pytest.mark.isolated
KUBERNETES_VERSION = "1.30.0"  # a version kubernetes-validate bundles the schema of


@dataclass
class FakeJobLife:
    """One Job's life as the API server tells it: `running_reads` status reads Running, then `end`."""

    end: str = "Complete"  # Complete, Failed, or "" (runs until deleted)
    running_reads: int = 3
    log: list[str] = field(default_factory=list)
    created: dict[str, Any] = field(default_factory=dict)  # kind -> the body the client sent
    deleted: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    reads: int = 0

    def job(self, name: str) -> dict[str, Any]:
        body = dict(self.created["Job"])
        status: dict[str, Any] = {"active": 1}
        if self.reads > self.running_reads and self.end:
            status = {"conditions": [{"type": self.end, "status": "True", "reason": f"Job{self.end}"}]}
        return {**body, "status": status}

    def pods(self, name: str) -> dict[str, Any]:
        nodes = self.created["Job"]["spec"]["completions"]
        if self.reads <= 1:
            phase = "Pending"
        elif self.reads <= self.running_reads or not self.end:
            phase = "Running"
        else:
            phase = "Succeeded" if self.end == "Complete" else "Failed"
        items = [
            {
                "metadata": {"name": f"{name}-{index}-x7k2p", "namespace": "d9d"},
                "spec": {"nodeName": f"gpu-node-{index}", "containers": [{"name": "torchrun"}]},
                "status": {"phase": phase if index == 0 or phase != "Failed" else "Running"},
            }
            for index in range(nodes)
        ]
        return {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}


def _server(life: FakeJobLife) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length", 0))
            return json.loads(self.rfile.read(length) or b"{}")

        def do_POST(self) -> None:
            body = self._body()
            life.created[body["kind"]] = body
            self._send(201, body)

        def do_DELETE(self) -> None:
            path = urlparse(self.path).path
            life.deleted.append((path, self._body()))
            # As the API server answers: the deleted Service itself; a Status for a Job deleted in the foreground.
            if "/services/" in path:
                self._send(200, life.created["Service"])
            else:
                self._send(200, {"apiVersion": "v1", "kind": "Status", "status": "Success"})

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if match := re.fullmatch(r"/apis/batch/v1/namespaces/d9d/jobs/([^/]+)/status", url.path):
                if any("/jobs/" in path for path, _ in life.deleted):
                    status = {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "reason": "NotFound",
                        "code": 404,
                    }
                    self._send(404, status)
                    return
                life.reads += 1
                self._send(200, life.job(match.group(1)))
            elif url.path == "/api/v1/namespaces/d9d/pods":
                selector = parse_qs(url.query)["labelSelector"][0]
                self._send(200, life.pods(selector.split("=", 1)[1]))
            elif url.path.startswith("/api/v1/namespaces/d9d/pods/") and url.path.endswith("/log"):
                self._send(200, "".join(line + "\n" for line in life.log), "text/plain")
            else:
                self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def api(request: pytest.FixtureRequest) -> Iterator[tuple[FakeJobLife, Any]]:
    life = FakeJobLife(**getattr(request, "param", {}))
    server = _server(life)
    configuration = kubernetes.client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
    client = kubernetes.client.ApiClient(configuration)
    try:
        yield life, client
    finally:
        server.shutdown()
        client.close()


def _launcher(client: Any, *, nodes: int = 2, device: str = "cuda") -> KubernetesLauncher:
    config = KubernetesLauncherConfig(
        nodes=nodes, namespace="d9d", shared_dir=Path("/shared/d9d"), poll_seconds=0.05,
        secret_env={"WANDB_API_KEY": SecretRef(secret="wandb", key="api-key")}, memory="64Gi", cpus_per_node=16,
    )  # fmt: skip
    return KubernetesLauncher(config, RankTopology(nproc_per_node=4, device=device), "pretrain", api_client=client)  # type: ignore[arg-type]


def _spec(tmp_path: Path) -> LaunchSpec:
    return LaunchSpec(
        module="d9d.flows.jobs.pretrain.program",
        args=["--config", "/shared/d9d/run/.pretrain.partial/job.yaml"],
        nproc_per_node=4,
        log_file=tmp_path / "launch.log",
    )


@pytest.mark.parametrize(("nodes", "device"), [(2, "cuda"), (1, "cpu")])
def test_the_manifests_are_valid_kubernetes_objects(tmp_path: Path, nodes: int, device: str) -> None:
    launcher = _launcher(None, nodes=nodes, device=device)
    service, job = build_manifests(launcher.job_spec(_spec(tmp_path), "d9d-pretrain-abc123"))
    serialise = kubernetes.client.ApiClient().sanitize_for_serialization
    for manifest in (serialise(service), serialise(job)):
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
    job_dict = serialise(job)
    pod = job_dict["spec"]["template"]["spec"]
    assert job_dict["spec"]["completionMode"] == "Indexed" and job_dict["spec"]["completions"] == nodes
    container = pod["containers"][0]
    assert f"--nnodes={nodes}" in container["command"] and "--nproc-per-node=4" in container["command"]
    secret = next(env for env in container["env"] if env["name"] == "WANDB_API_KEY")
    assert secret == {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}}
    gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert gpus == ("4" if device == "cuda" else None)
    assert serialise(service)["spec"]["clusterIP"] == "None"


def test_a_bad_manifest_is_refused_by_the_validator() -> None:
    """The validator is not a formality: a Job without its pod template is refused."""
    bad = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": {"completions": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_a_job_is_created_followed_to_complete_and_its_log_streamed(
    api: tuple[FakeJobLife, Any], tmp_path: Path
) -> None:
    life, client = api
    life.log = ["rank 0 starting", progress_line({"event": "step", "step": 1, "loss": 2.5}), "rank 0 done"]
    records: list[dict[str, Any]] = []
    jobs: list[ClusterJob] = []
    with observe_cluster_jobs(jobs.append):
        _launcher(client).run(_spec(tmp_path), on_progress=records.append)
    kubernetes_validate.validate(life.created["Job"], KUBERNETES_VERSION, strict=True)  # what went over the wire
    kubernetes_validate.validate(life.created["Service"], KUBERNETES_VERSION, strict=True)
    assert records == [{"event": "step", "step": 1, "loss": 2.5}]
    log = (tmp_path / "launch.log").read_text()
    assert "rank 0 starting" in log and "rank 0 done" in log and "d9d-progress" not in log
    assert [job.state for job in jobs] == ["Pending", "Running", "Complete"]
    assert "gpu-node-1" in jobs[-1].nodes
    assert [path for path, _ in life.deleted] == [
        f"/api/v1/namespaces/d9d/services/{life.created['Job']['metadata']['name']}"
    ]


@pytest.mark.parametrize("api", [{"end": "Failed"}], indirect=True)
def test_a_failed_job_names_the_failed_pod_and_its_log(api: tuple[FakeJobLife, Any], tmp_path: Path) -> None:
    life, client = api
    life.log = ["Traceback (most recent call last):", "RuntimeError: NCCL timeout on rank 3"]
    with pytest.raises(KubernetesJobError, match=r"JobFailed.*-0-x7k2p.*NCCL timeout on rank 3"):
        _launcher(client).run(_spec(tmp_path))


@pytest.mark.parametrize("api", [{"end": ""}], indirect=True)
def test_sigterm_deletes_the_job_and_waits_until_it_is_gone(api: tuple[FakeJobLife, Any], tmp_path: Path) -> None:
    life, client = api
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))

    def stop_when_running() -> None:
        while life.reads < 3:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_running, daemon=True).start()
    try:
        with pytest.raises(LaunchCancelled, match="deleted"):
            _launcher(client).run(_spec(tmp_path))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM]  # handed on to the handler that was there before
    name = life.created["Job"]["metadata"]["name"]
    job_deletes = [body for path, body in life.deleted if path == f"/apis/batch/v1/namespaces/d9d/jobs/{name}"]
    assert job_deletes and job_deletes[0]["propagationPolicy"] == "Foreground"  # its pods go with it
