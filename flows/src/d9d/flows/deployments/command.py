"""The `d9d server start`, `serve`, `deploy` and `render-job` commands (parsers and dispatch; Prefect imported late)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from d9d.flows.deployments.config import DeployConfigError, load_deploy_file

COMMANDS = ("server", "serve", "deploy", "render-job")
DEFAULT_FILE = Path("infra/prefect.yaml")
EXIT_BAD_INPUT = 2


def add_deployment_commands(commands: Any) -> None:
    """Register `server`, `serve` and `deploy` on the `d9d` command line's subparsers."""
    server = commands.add_parser("server", help="run a Prefect server (schedules, workers, UI)")
    actions = server.add_subparsers(dest="server_command", required=True, metavar="ACTION")
    start = actions.add_parser(
        "start",
        help="start a Prefect server in the foreground",
        description="Start a Prefect server: SQLite under $D9D_HOME/server unless --database-url names Postgres.",
    )
    start.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; beyond loopback it needs PREFECT_SERVER_API_AUTH_STRING or --behind-auth-proxy",
    )
    start.add_argument(
        "--behind-auth-proxy",
        action="store_true",
        help="a reverse proxy in front authenticates every request (lets --host be a non-loopback address)",
    )
    start.add_argument("--port", type=int, default=4200)
    start.add_argument(
        "--database-url",
        help="postgresql+asyncpg://USER:PASSWORD@HOST:5432/DB for a team (default: SQLite in the server's home)",
    )
    start.add_argument("--no-ui", dest="ui", action="store_false", help="serve the API only")
    for name, text in (
        ("serve", "serve the file's deployments with their schedules from this process (a Prefect runner)"),
        ("deploy", "create work pools, concurrency limits and deployments from the file on the Prefect server"),
    ):
        parser = commands.add_parser(name, help=text, description=text)
        parser.add_argument(
            "--file", type=Path, default=DEFAULT_FILE, help=f"the deployment file (default {DEFAULT_FILE})"
        )
        parser.add_argument(
            "--deployment",
            dest="deployments",
            action="append",
            default=[],
            metavar="NAME",
            help="only this deployment (repeatable; default: all)",
        )
        if name == "serve":
            parser.add_argument("--limit", type=int, help="flow runs at once (default: no limit)")
    render = commands.add_parser(
        "render-job",
        help="render a multi-node torchrun job for Slurm (sbatch script) or Kubernetes (indexed Job + Service)",
        description="Render the Slurm or Kubernetes job template (shipped with d9d-flows) for a ClusterJobSpec "
        "(defaults: 2 nodes x 8 GPUs).",
    )
    render.add_argument("kind", choices=["slurm", "kubernetes"])
    render.add_argument("--spec", type=Path, help="a YAML file of ClusterJobSpec fields (nodes, gpus_per_node, ...)")
    render.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="e.g. --set nodes=4"
    )
    render.add_argument(
        "--templates", type=Path, default=None, help="a directory of your own slurm/ and k8s/ templates"
    )


def run_deployment_command(args: argparse.Namespace) -> int:
    """Dispatch `server`, `serve`, `deploy` or `render-job`; 2 on bad input, naming what to fix."""
    try:
        if args.command == "server":
            return _server(args)
        if args.command == "render-job":
            return _render_job(args)
        from d9d.flows.runtime import configure_prefect

        target = configure_prefect()  # before anything imports prefect (schedules are checked by its models)
        deploy_file = load_deploy_file(args.file)
        deploy_file.select(args.deployments)  # an unknown name fails before anything is changed
        _require_server(args.command, target.mode)
        if args.command == "serve":
            from d9d.flows.deployments.serve import serve_deploy_file

            serve_deploy_file(deploy_file, args.deployments, limit=args.limit)
            return 0
        from d9d.flows.deployments.deploy import apply_deploy_file

        report = apply_deploy_file(deploy_file, args.deployments)
    except (DeployConfigError, ValueError, FileNotFoundError) as error:
        sys.stderr.write(f"d9d: error: {error}\n")
        return EXIT_BAD_INPUT
    for line in report.lines():
        sys.stdout.write(f"d9d: {line}\n")
    return 0


def _server(args: argparse.Namespace) -> int:
    from d9d.flows.deployments.server import plan_server, start_server

    plan = plan_server(
        host=args.host,
        port=args.port,
        database_url=args.database_url,
        ui=args.ui,
        environ=os.environ,
        behind_auth_proxy=args.behind_auth_proxy,
    )
    start_server(plan)
    return 1  # exec failed


def _render_job(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from d9d.core.config import load_config
    from d9d.flows.deployments.cluster import TEMPLATES_DIR, ClusterJobSpec, render_cluster_job

    try:
        spec = load_config(ClusterJobSpec, args.spec, args.overrides)
    except ValidationError as error:
        problems = [
            f"{'.'.join(map(str, problem['loc']))} = {problem.get('input')!r}: {problem['msg']}"
            for problem in error.errors(include_url=False)
        ]
        raise DeployConfigError("invalid cluster job spec: " + "; ".join(problems)) from None
    sys.stdout.write(render_cluster_job(args.kind, spec, templates=args.templates or TEMPLATES_DIR))
    return 0


def _require_server(command: str, mode: str) -> None:
    if mode == "embedded":
        raise DeployConfigError(
            f"`d9d {command}` needs a Prefect server: schedules and workers cannot use the embedded API, which "
            "stops when its process exits. Start one with `d9d server start` and set "
            "PREFECT_API_URL=http://127.0.0.1:4200/api (or your server's URL)."
        )
