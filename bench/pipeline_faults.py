"""Faults in the micro pipeline run by the `d9d` command itself (used by `bench/faults.py`).

The stage-level kinds of `faults.py` drive one training stage under torchrun; these drive the whole
`d9d run pipeline --preset micro`: the `d9d` process with its embedded Prefect API, every stage and their
committed outputs.

- `kill-flow`: SIGKILL of the `d9d` process at a random moment of the run (the flow process: stages, Prefect API,
  torchrun and ranks below it must all die with it).
- `interrupt-flow`: Ctrl-C (SIGINT to the run's process group, as a terminal sends it) at a random moment; the run
  must end within seconds with exit code 130.
- `damage-manifest`: after a complete run, a byte of one stage's `manifest.json` changed; the rerun must refuse it
  naming the file, and the fix the error names (`--set replace_outputs=true`) must rebuild it.
- `full-disk-stage`: the work directory on a tmpfs too small for the run (a real ENOSPC at whatever write comes
  first: a shard, a checkpoint, a manifest); the disk is then grown and the run repeated.

The final result compared with a fault-free run: the token shards, the merged fine-tuned model's safetensors, the
pretrain and fine-tune loss curves and every evaluated loss (these fix the pretrain checkpoint bit for bit).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

PIPELINE_KINDS = ("kill-flow", "interrupt-flow", "damage-manifest", "full-disk-stage")
PIPELINE_TIMEOUT_S = 1200
INTERRUPT_GRACE_S = 60  # "within seconds" on an idle machine; the shared 2-core machine gets a margin


def d9d_command(work: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "d9d.flows", "run", "pipeline", "--preset", "micro", "--set", f"workdir={work}",
        *extra,
    ]  # fmt: skip


def start(work: Path, home: Path, log: Path, *extra: str) -> subprocess.Popen[str]:
    """The run in its own session and process group, like a terminal's foreground job."""
    env = {**os.environ, "D9D_HOME": str(home), "OMP_NUM_THREADS": "1"}
    env.pop("PREFECT_HOME", None)
    env.pop("PREFECT_API_URL", None)
    handle = log.open("a", encoding="utf-8")
    handle.write(f"\n=== {' '.join(d9d_command(work, *extra))}\n")
    handle.flush()
    # A campaign started in the background (`nohup ... &`) inherits SIGINT ignored, and an ignored signal stays
    # ignored across exec: Ctrl-C would never reach the run. A handled one is reset to the default on exec.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return subprocess.Popen(
        d9d_command(work, *extra), env=env, stdout=handle, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


class Descendants:
    """Every process started below the run, seen by polling (the Prefect API, torchrun and ranks come and go)."""

    def __init__(self, root: subprocess.Popen[str]) -> None:
        self.root = root
        self.seen: dict[int, psutil.Process] = {}

    def poll(self) -> None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.root.pid).children(recursive=True):
                self.seen.setdefault(child.pid, child)

    def alive(self) -> list[psutil.Process]:
        """Those still running (a `psutil.Process` checks its creation time, so a reused pid is not counted)."""
        return [process for process in self.seen.values() if _running(process)]

    def settle(self, seconds: float = 10.0) -> list[psutil.Process]:
        """Those still running after up to `seconds`: the Prefect API and the ranks need a moment to end after the
        run did (parent-death signals, graceful shutdown); what outlives this is an orphan."""
        deadline = time.monotonic() + seconds
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait(process: subprocess.Popen[str], watch: Descendants | None = None, timeout: float = PIPELINE_TIMEOUT_S) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if watch is not None:
            watch.poll()
        code = process.poll()
        if code is not None:
            return code
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    return process.wait()


def run(work: Path, home: Path, log: Path, *extra: str) -> int:
    process = start(work, home, log, *extra)
    return wait(process, Descendants(process))


def result_digest(work: Path) -> str:
    """What a fault must not change: shards, the merged model, loss curves and evaluated losses (no paths, no
    timestamps)."""
    digest = hashlib.sha256()
    files = sorted([*(work / "data").rglob("*.d9dtok"), *(work / "finetune" / "merged").glob("*.safetensors")])
    for path in files:
        digest.update(str(path.relative_to(work)).encode())
        digest.update(path.read_bytes())
    for curve in ("pretrain", "finetune"):
        for line in (work / curve / "losses.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                digest.update(f"{curve}:{record['step']}:{record['loss']!r}".encode())
    evaluation = json.loads((work / "evaluation" / "evaluation.json").read_text(encoding="utf-8"))
    for name, splits in sorted(evaluation["checkpoints"].items()):
        for split, values in sorted(splits.items()):
            digest.update(f"{name}:{split}:{values['loss']!r}:{values['tokens']}".encode())
    return digest.hexdigest()


def _kill_at_random_moment(
    work: Path, home: Path, log: Path, rng: random.Random, reference_seconds: float, send: signal.Signals
) -> tuple[str, subprocess.Popen[str], Descendants, float]:
    process = start(work, home, log)
    watch = Descendants(process)
    delay = rng.uniform(3.0, max(4.0, 0.6 * reference_seconds))  # the reference ran on a busier machine, maybe
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline and process.poll() is None:
        watch.poll()
        time.sleep(0.2)
    watch.poll()
    if process.poll() is not None:
        return f"the run ended before the signal at {delay:.0f} s (exit {process.returncode})", process, watch, delay
    if send == signal.SIGKILL:
        os.kill(process.pid, signal.SIGKILL)
    else:
        os.killpg(process.pid, send)  # a terminal's Ctrl-C reaches its whole foreground process group
    return "", process, watch, delay


def inject_pipeline(
    kind: str, work: Path, home: Path, rng: random.Random, reference_seconds: float
) -> tuple[str, bool | None, int, list[str]]:
    """Run the pipeline with fault `kind`. Returns what was done, whether a corrupt input was refused (None: no
    corrupt input), how many processes of the faulty run outlived it, and extra arguments for the rerun."""
    log = work.parent / f"{work.name}.log"
    match kind:
        case "kill-flow" | "interrupt-flow":
            send = signal.SIGKILL if kind == "kill-flow" else signal.SIGINT
            ended, process, watch, delay = _kill_at_random_moment(work, home, log, rng, reference_seconds, send)
            if ended:
                return ended, None, len(watch.settle()), []
            signalled = time.monotonic()
            code = wait(process, watch, timeout=INTERRUPT_GRACE_S if kind == "interrupt-flow" else 30)
            took = time.monotonic() - signalled
            orphans = watch.settle()
            for survivor in orphans:
                with contextlib.suppress(psutil.Error):
                    survivor.kill()
            detail = f"{signal.Signals(send).name} at {delay:.0f} s: exit {code} after {took:.1f} s"
            if kind == "interrupt-flow" and code != 130:
                detail += " (expected 130)"
            return detail, None, len(orphans), []
        case "damage-manifest":
            code = run(work, home, log)
            if code != 0:
                return f"the fault-free first run failed (exit {code})", None, 0, []
            manifests = sorted(work.glob("*/manifest.json"))
            target = rng.choice(manifests)
            data = bytearray(target.read_bytes())
            digits = [index for index, byte in enumerate(data) if chr(byte).isdigit()]
            if rng.random() < 0.5:
                index = rng.choice(digits)
                data[index] = ord(str((int(chr(data[index])) + 1) % 10))
                how = "a digit changed"
            else:
                index = rng.randrange(len(data))
                data[index] ^= 0xFF
                how = "a byte flipped"
            target.write_bytes(bytes(data))
            code = run(work, home, log)
            text = log.read_text(encoding="utf-8", errors="replace")
            refused = code != 0 and str(target) in text.split("===")[-1]
            relative = target.relative_to(work)
            return f"{relative}: {how} at {index}; rerun exit {code}", refused, 0, ["--set", "replace_outputs=true"]
        case "full-disk-stage":
            size_kib = rng.randint(256, 3072)  # a complete micro run needs about 5 MiB
            work.mkdir(parents=True, exist_ok=True)
            if subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(work)], check=False
            ).returncode:
                raise SystemExit("full-disk-stage needs root and tmpfs mounts (mount -t tmpfs failed)")
            code = run(work, home, log)
            grown = subprocess.run(["mount", "-o", "remount,size=256m", str(work)], check=False).returncode
            return f"work dir on a {size_kib} KiB tmpfs: exit {code}; grown (rc {grown})", None, 0, []
        case other:
            raise ValueError(f"unknown pipeline fault kind {other!r}; valid: {', '.join(PIPELINE_KINDS)}")


def release(work: Path) -> None:
    """Unmount a trial's tmpfs (full-disk-stage), keeping nothing of it."""
    if os.path.ismount(work):
        subprocess.run(["umount", "-l", str(work)], check=False)
    shutil.rmtree(work, ignore_errors=True)
