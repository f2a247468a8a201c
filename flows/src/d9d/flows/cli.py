"""The `d9d` command line: run the pipeline or one stage from a preset, a YAML job file and `--set` overrides.

Bad input is caught before Prefect starts (config keys and values, corpus files, tokenizer files, a tokenizer
that differs from an existing shard set's), so those errors come back at once, naming what to fix.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

import yaml

from d9d.flows.deployments import DEPLOYMENT_COMMANDS, add_deployment_commands, run_deployment_command
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.contract import (
    MANIFEST_FILENAME,
    StageBusyError,
    StageDirectory,
    StageOutputConflict,
    StageResult,
)
from d9d.flows.jobs.convert import add_convert_command, run_convert_command
from d9d.flows.jobs.data_prep import CorpusError, SplitError, TokenizerError
from d9d.flows.jobs.launch import LaunchCancelled
from d9d.flows.jobs.loading import JobConfigError, load_job_config
from d9d.flows.jobs.presets import describe_presets
from d9d.flows.jobs.stage_spec import PreflightError
from d9d.flows.jobs.stages import PIPELINE, STAGES, preflight
from d9d.flows.jobs.verify import add_verify_command, run_verify_command

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM
EMBEDDED_STARTUP_SECONDS = 300.0  # a fresh SQLite database: 15-20 s on 2 cores, over 2 min under heavy load
INPUT_ERRORS = (
    JobConfigError, PreflightError, CorpusError, TokenizerError, SplitError, StageBusyError, StageOutputConflict
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="d9d",
        description="Run d9d's pipeline or one of its stages.",
        epilog=f"presets:\n{describe_presets()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="run the pipeline or one stage",
        description="Run the pipeline (every stage in order) or one stage; finished stages are skipped.",
        epilog=f"presets:\n{describe_presets()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("target", choices=["pipeline", *STAGES], help="pipeline, or a stage name")
    _config_arguments(run)
    show = commands.add_parser("show-config", help="print the job config that a run would use, as YAML")
    _config_arguments(show)
    add_convert_command(commands)
    add_verify_command(commands)
    add_deployment_commands(commands)
    return parser


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", help="start from a named preset (tiny, micro)")
    parser.add_argument("--config", type=Path, help="a YAML job file (applied over the preset)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, e.g. --set data_prep.workers=1 (repeatable; the value is YAML)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "convert":
        return run_convert_command(args)
    if args.command == "verify":
        return run_verify_command(args)
    if args.command in DEPLOYMENT_COMMANDS:
        return run_deployment_command(args)
    try:
        config = load_job_config(preset_name=args.preset, config_file=args.config, overrides=args.overrides)
        if args.command == "show-config":
            sys.stdout.write(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
            return 0
        stages = PIPELINE if args.target == "pipeline" else (args.target,)
        preflight(config, stages)
    except INPUT_ERRORS as error:
        sys.stderr.write(f"d9d: error: {error}\n")
        return EXIT_BAD_INPUT
    return _run(args.target, config, source=args.preset or str(args.config or "defaults"))


def _stage_output(config: JobConfig, stage: str) -> Path:
    return STAGES[stage].output(config)


@contextlib.contextmanager
def _api(mode: str) -> Iterator[None]:
    """The embedded API (started once per process, in its own session, dying with it) for the flows to report to;
    a configured API as it is."""
    if mode != "embedded":
        yield
        return
    from d9d.flows.embedded_api import embedded_api_url, startup_timeout, using_api

    home = Path(os.environ["PREFECT_HOME"])
    timeout = startup_timeout(os.environ, EMBEDDED_STARTUP_SECONDS)
    with using_api(embedded_api_url(home, startup_timeout=timeout)):
        yield


def _interrupted_line(signal_name: str, config: JobConfig) -> str:
    kept = _kept(config)
    return f"d9d: interrupted ({signal_name}): every rank has stopped; kept: {kept}; run the same command to continue\n"


def _kept(config: JobConfig) -> str:
    """What an interrupted run leaves to continue from: complete stage outputs, and the newest complete checkpoint
    of a training stage in progress."""
    from d9d.core.checkpoint import latest_complete

    kept = [
        f"{stage} {output}"
        for stage in PIPELINE
        if (output := _stage_output(config, stage)).is_dir() and (output / MANIFEST_FILENAME).is_file()
    ]
    for stage in ("pretrain", "finetune"):
        checkpoints = StageDirectory(_stage_output(config, stage)).partial / "checkpoints"
        newest = latest_complete(checkpoints) if checkpoints.is_dir() else None
        if newest is not None:
            kept.append(f"{stage} checkpoint {newest}")
    return ", ".join(kept) or "nothing finished yet"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that the flow unwinds and every stage's ranks are stopped."""


def _terminated(signum: int, frame: FrameType | None) -> None:
    del signum, frame
    raise Terminated


def _run(target: str, config: JobConfig, *, source: str) -> int:
    from d9d.flows.runtime import configure_prefect

    prefect_target = configure_prefect()
    say = sys.stderr.write
    say(f"d9d: running {target} ({source}); outputs under {config.workdir}\n")
    say(f"d9d: flows report to {prefect_target.description}\n")
    started = time.perf_counter()
    from d9d.flows.console import TerminalProgress, Waiting, set_progress

    previous_sigterm = signal.signal(signal.SIGTERM, _terminated)
    try:
        with contextlib.ExitStack() as api:
            # Importing Prefect takes seconds, and a fresh embedded database 15-20 s more on a small machine.
            embedded = prefect_target.mode == "embedded"
            starting = "the embedded Prefect API (15-20 s on a small machine)" if embedded else "Prefect"
            with Waiting(f"d9d: starting {starting}"):
                from d9d.flows.pipeline import pipeline_flow
                from d9d.flows.stage_flow import with_retries

                api.enter_context(_api(prefect_target.mode))
            flow = pipeline_flow if target == "pipeline" else with_retries(target, config)
            quiet_failures_on_the_console()
            set_progress(TerminalProgress())
            state = flow(config, return_state=True)  # the validated config itself: no second validation here
    except KeyboardInterrupt as interrupt:
        name = "SIGTERM" if isinstance(interrupt, Terminated) else "SIGINT"
        say(_interrupted_line(name, config))
        return EXIT_TERMINATED if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        set_progress(None)
    seconds = time.perf_counter() - started
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        if isinstance(error, LaunchCancelled):
            name = signal.Signals(error.signum).name
            say(_interrupted_line(name, config))
            return EXIT_TERMINATED if error.signum == signal.SIGTERM else EXIT_INTERRUPTED
        if isinstance(error, StageOutputConflict):
            say(f"d9d: error: {error}\n")
            return EXIT_BAD_INPUT
        say(
            f"d9d: {target} failed after {seconds:.1f} s: {error}\n"
            "d9d: finished work is kept; fix the cause and run the same command to continue from where it failed\n"
            f"d9d: {flow_run_pointer(state.state_details.flow_run_id)}\n"
        )
        return EXIT_FAILED
    returned = state.result()
    raw_results = returned["stages"] if target == "pipeline" else [returned]
    results = [StageResult.from_json(raw) for raw in raw_results]
    from d9d.flows.console import format_summary

    sys.stdout.write(format_summary(results, seconds=seconds, target=prefect_target.description) + "\n")
    sys.stdout.write(f"d9d: {flow_run_pointer(state.state_details.flow_run_id)}\n")
    return 0


class _NoRunTracebacks(logging.Filter):
    """Drops flow and task runs' error records (Prefect's "Encountered exception" tracebacks) from the console: `d9d`
    prints the cause itself, in one message. The Prefect API still receives them (its handler has no such filter)."""

    def filter(self, record: logging.LogRecord) -> bool:
        run_logger = record.name.startswith(("prefect.flow_runs", "prefect.task_runs"))
        return not (run_logger and record.levelno >= logging.ERROR)


def quiet_failures_on_the_console() -> None:
    from prefect.logging.handlers import PrefectConsoleHandler

    for logger in (logging.getLogger("prefect"), logging.getLogger()):
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and not any(
                isinstance(existing, _NoRunTracebacks) for existing in handler.filters
            ):
                handler.addFilter(_NoRunTracebacks())


def flow_run_pointer(flow_run_id: object) -> str:
    """How to see the flow run: its page in the Prefect UI of a configured server, else the command that shows it
    from the embedded database."""
    api = os.environ.get("PREFECT_API_URL", "")
    if api:
        ui = api.rstrip("/").removesuffix("/api")
        return f"Prefect flow run {flow_run_id}: {ui}/runs/flow-run/{flow_run_id}"
    home = os.environ.get("PREFECT_HOME", "")
    return f"Prefect flow run {flow_run_id}; to see it: PREFECT_HOME={home} prefect flow-run inspect {flow_run_id}"


if __name__ == "__main__":
    sys.exit(main())
