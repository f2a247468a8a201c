"""`d9d serve`: one long-running Prefect runner that serves the file's deployments with their cron schedules.

The runner is the infrastructure: it polls the API, and runs each scheduled or triggered flow run in a subprocess
of its own (no work pool or worker needed). Schedules are paused when it stops (Prefect's default), so a stopped
`d9d serve` leaves no runs piling up.
"""

from __future__ import annotations

import sys

from d9d.flows.deployments.build import runner_deployment
from d9d.flows.deployments.config import DeployFile


def serve_deploy_file(deploy_file: DeployFile, names: list[str], *, limit: int | None) -> None:
    """Serve the deployments (all, or those named) until interrupted."""
    from prefect import serve

    deployments = [runner_deployment(entry, with_work_pool=False) for entry in deploy_file.select(names)]
    for entry in deploy_file.select(names):
        when = ", ".join(f"cron {item.cron!r} ({item.timezone})" for item in entry.schedules) or "on demand"
        sys.stderr.write(f"d9d: serving {entry.flow}/{entry.name}: {when}\n")
    serve(*deployments, limit=limit, print_starting_message=False)
