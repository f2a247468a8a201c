"""Servers, deployments and schedules: `d9d server start`, `d9d serve`, `d9d deploy` and the deployment file."""

from d9d.flows.deployments.command import COMMANDS as DEPLOYMENT_COMMANDS
from d9d.flows.deployments.command import add_deployment_commands, run_deployment_command
from d9d.flows.deployments.config import DeployConfigError, DeployFile, load_deploy_file

__all__ = [
    "DEPLOYMENT_COMMANDS",
    "DeployConfigError",
    "DeployFile",
    "add_deployment_commands",
    "load_deploy_file",
    "run_deployment_command",
]
