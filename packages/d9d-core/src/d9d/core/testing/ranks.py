"""Fork-based multi-rank runner for tests.

Starting a rank costs seconds (import torch, import DTensor, first DTensor op); forking a parent that already paid
those costs brings a 4-rank test under half a second. The parent must therefore be single-threaded and hold no
process group when it forks: a forked copy of a live gloo group or of another thread's lock deadlocks. Each rank
writes its result (or traceback) to a file; the parent waits with a deadline, and on a deadlock asks every rank for
its Python stack (faulthandler on SIGUSR1) before killing it, so a hang becomes a test failure that shows where each
rank was stuck.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_SECONDS = 60.0
# After one rank fails, the others usually block in a collective waiting for it; give them this long to finish or
# fail on their own before they are killed, so a genuine second error is still reported.
_PEER_GRACE_SECONDS = 1.0
_POLL_SECONDS = 0.005
_STACK_WAIT_SECONDS = 5.0


class RankFailure(AssertionError):
    """One or more ranks raised or exited abnormally; the message holds each failing rank's traceback."""


class RankTimeout(AssertionError):
    """Ranks did not finish before the deadline (a deadlock); the message holds every unfinished rank's stack."""


@dataclass(frozen=True)
class _Outcome:
    ok: bool
    value: Any = None
    error: str = ""


def warm_up_distributed() -> None:
    """Pay the one-time costs (DTensor import and first op) in the parent so forked ranks start warm.

    Uses the `fake` backend in-process, then destroys the group: the parent must hold no group when it forks.
    """
    import torch._dynamo  # constructing any torch optimizer imports it (~6 s), which every rank would pay again
    import torch.distributed.fsdp
    import torch.distributed.tensor as dtensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("warm_up_distributed must run before any process group exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
        tensor = dtensor.distribute_tensor(torch.ones(4, 4), mesh, [dtensor.Shard(0)])
        tensor.redistribute(mesh, [dtensor.Replicate()])
        (tensor * 2).sum()
    finally:
        dist.destroy_process_group()
    _ = torch.distributed.fsdp.fully_shard


def _check_forkable() -> None:
    if dist.is_initialized():
        raise RuntimeError(
            "refusing to fork ranks: this process holds a process group, and a forked copy of it would deadlock; "
            "run this test in a process without one (destroy the group first)."
        )
    # On a machine with GPUs, a parent that has initialised CUDA, or run any backward (autograd then starts one
    # thread per GPU), cannot give its forked children CUDA or autograd; PyTorch's own errors say so in the child.
    # Hence the CPU suite runs there with CUDA_VISIBLE_DEVICES= and GPU tests that fork ranks run in their own
    # pytest process (.ci/gpu_suite.sh, docs/testing.md).
    others = [thread.name for thread in threading.enumerate() if thread is not threading.main_thread()]
    if others:
        raise RuntimeError(
            f"refusing to fork ranks: this process runs other threads ({', '.join(sorted(others))}), whose locks a "
            "fork would copy in a held state; run tests that start Prefect, aim or wandb in a separate pytest "
            "invocation (mark them `isolated`)."
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(
    *,
    rank: int,
    world_size: int,
    body: Callable[[], Any],
    workdir: Path,
    init_process_group: bool,
    port: int,
    timeout_seconds: float,
) -> int:
    stack_file = (workdir / f"stack-{rank}.txt").open("w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=stack_file, all_threads=True)  # a crash (e.g. SIGSEGV) also leaves the rank's stack
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "D9D_DEVICE": "cpu",
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(1)
    try:
        if init_process_group:
            from datetime import timedelta

            dist.init_process_group(
                "gloo",
                init_method=f"file://{workdir / 'store'}",
                rank=rank,
                world_size=world_size,
                # Longer than the harness deadline, so a deadlock is caught by the harness with every rank's stack
                # rather than by one rank's collective timing out first.
                timeout=timedelta(seconds=timeout_seconds + 30),
            )
            # Creating a gloo group is not a synchronisation point: a rank whose body is short could finish and
            # destroy its group while a peer is still connecting its mesh, which then fails with "Connection closed
            # by peer" (the flake seen under load). Past this barrier every rank's mesh is complete.
            dist.barrier()
        outcome = _Outcome(ok=True, value=body())
    except BaseException:  # noqa: BLE001 - whatever a rank raises (even SystemExit) is reported, not swallowed
        outcome = _Outcome(ok=False, error=traceback.format_exc())
    # Written before the teardown: NCCL's `destroy_process_group` can block while peers still wait in a collective
    # (a rank that raised leaves them there), and the harness then kills this rank; its error must not go with it.
    _write_outcome(workdir, rank, outcome)
    if dist.is_initialized():
        # The rank's own outcome matters more than a teardown error (peers may already be gone).
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return 0


def _write_outcome(workdir: Path, rank: int, outcome: _Outcome) -> None:
    try:
        payload = pickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - an unpicklable return value must still be reported, not lost
        payload = pickle.dumps(
            _Outcome(ok=False, error=f"rank {rank} returned an unpicklable value:\n" + traceback.format_exc())
        )
    partial = workdir / f"result-{rank}.pkl.partial"
    partial.write_bytes(payload)
    partial.replace(workdir / f"result-{rank}.pkl")  # whole or absent: the parent may read it while this rank hangs


def run_on_ranks(
    world_size: int,
    body: Callable[[], Any],
    *,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    init_process_group: bool = True,
) -> list[Any]:
    """Run `body()` on `world_size` forked ranks and return each rank's return value, by rank.

    Each rank sees torchrun-style environment variables and, unless `init_process_group=False`, an initialised gloo
    default group over a file store. Raises `RankFailure` with the tracebacks of failing ranks, or `RankTimeout` with
    every unfinished rank's stack when the deadline passes.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    _check_forkable()
    sys.stdout.flush()
    sys.stderr.flush()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="d9d-ranks-") as tmp:
        workdir = Path(tmp)
        pids: dict[int, int] = {}
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the child
                code = 1
                try:
                    code = _rank_main(
                        rank=rank,
                        world_size=world_size,
                        body=body,
                        workdir=workdir,
                        init_process_group=init_process_group,
                        port=port,
                        timeout_seconds=timeout_seconds,
                    )
                finally:
                    os._exit(code)
            pids[rank] = pid
        exit_codes: dict[int, int] = {}  # the reaped ranks, filled by _collect
        try:
            return _collect(pids, exit_codes, workdir, timeout_seconds)
        except BaseException:
            # Interrupted (Ctrl-C, `timeout -s INT`) while waiting: no rank may outlive the call. An orphaned rank
            # would keep the terminal's pipe open (a `| tee` never ends) and its GPU and ports taken.
            _dump_and_kill(pids, exit_codes, workdir)
            raise


def _collect(pids: dict[int, int], exit_codes: dict[int, int], workdir: Path, timeout_seconds: float) -> list[Any]:
    deadline = time.monotonic() + timeout_seconds
    first_failure_at: float | None = None
    reported: set[int] = set()  # live ranks whose written outcome was read (it does not change)
    timed_out = False
    while len(exit_codes) < len(pids):
        for rank, pid in pids.items():
            if rank in exit_codes:
                continue
            waited, status = os.waitpid(pid, os.WNOHANG)
            if waited:
                exit_codes[rank] = os.waitstatus_to_exitcode(status)
                if first_failure_at is None and _failed(workdir, rank, exit_codes[rank]):
                    first_failure_at = time.monotonic()
            elif first_failure_at is None and rank not in reported and (raised := _raised(workdir, rank)) is not None:
                reported.add(rank)
                if raised:  # and may hang in its teardown: the peers get the same grace as after an exit
                    first_failure_at = time.monotonic()
        now = time.monotonic()
        if len(exit_codes) == len(pids):
            break
        if first_failure_at is not None and now - first_failure_at > _PEER_GRACE_SECONDS:
            _dump_and_kill(pids, exit_codes, workdir)
            break
        if now > deadline:
            timed_out = True
            _dump_and_kill(pids, exit_codes, workdir)
            break
        time.sleep(_POLL_SECONDS)
    return _report(pids, exit_codes, workdir, timed_out, timeout_seconds)


def _raised(workdir: Path, rank: int) -> bool | None:
    """Whether the rank's written outcome is an error; None while it has written none."""
    result = workdir / f"result-{rank}.pkl"
    if not result.exists():
        return None
    outcome: _Outcome = pickle.loads(result.read_bytes())  # noqa: S301 - written by our own forked child
    return not outcome.ok


def _failed(workdir: Path, rank: int, exit_code: int) -> bool:
    return exit_code != 0 or _raised(workdir, rank) is not False


def _dump_and_kill(pids: dict[int, int], exit_codes: dict[int, int], workdir: Path) -> None:
    alive = [rank for rank in pids if rank not in exit_codes]
    for rank in alive:
        _signal(pids[rank], signal.SIGUSR1)
    # Let faulthandler write each stack. A rank blocked in an uninterruptible driver call (CUDA, NCCL) takes the signal
    # only when the call returns, so wait up to a few seconds for every stack file rather than a fixed 0.2 s.
    waiting_until = time.monotonic() + _STACK_WAIT_SECONDS
    while time.monotonic() < waiting_until and not all(_stack_written(workdir, rank) for rank in alive):
        time.sleep(0.05)
    for rank in alive:
        _signal(pids[rank], signal.SIGKILL)
    for rank in alive:
        _, status = os.waitpid(pids[rank], 0)
        exit_codes[rank] = -signal.SIGKILL
        del status


def _stack_written(workdir: Path, rank: int) -> bool:
    path = workdir / f"stack-{rank}.txt"
    return path.exists() and path.stat().st_size > 0


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _report(
    pids: dict[int, int], exit_codes: dict[int, int], workdir: Path, timed_out: bool, timeout_seconds: float
) -> list[Any]:
    values: list[Any] = []
    errors: list[str] = []
    unfinished: list[str] = []
    for rank in sorted(pids):
        result = workdir / f"result-{rank}.pkl"
        if result.exists():
            outcome: _Outcome = pickle.loads(result.read_bytes())  # noqa: S301 - written by our own forked child
            if not outcome.ok:
                errors.append(f"--- rank {rank} raised ---\n{outcome.error}")
            elif exit_codes.get(rank) == -signal.SIGKILL:
                unfinished.append(f"--- rank {rank} returned, then hung in its process-group teardown; killed ---")
            else:
                values.append(outcome.value)
                continue
        else:
            stack_path = workdir / f"stack-{rank}.txt"
            stack = stack_path.read_text() if stack_path.exists() else ""
            killed = exit_codes.get(rank) == -signal.SIGKILL
            state = "was still running and was killed" if killed else f"exited with code {exit_codes.get(rank)}"
            unfinished.append(f"--- rank {rank} {state}; its stack: ---\n{stack or '(no stack written)'}")
        values.append(None)
    if errors:
        detail = "\n".join(errors + unfinished)
        raise RankFailure(f"{len(errors)} of {len(pids)} ranks failed:\n{detail}")
    if timed_out:
        detail = "\n".join(unfinished)
        raise RankTimeout(
            f"{len(unfinished)} of {len(pids)} ranks did not finish within {timeout_seconds:g}s (deadlock?):\n{detail}"
        )
    if unfinished:
        detail = "\n".join(unfinished)
        raise RankFailure(f"{len(unfinished)} of {len(pids)} ranks exited without a result (crashed?):\n{detail}")
    return values
