"""Fault campaign: one training stage run many times, each with one injected fault, then rerun; checks recovery.

Each trial builds a fresh work directory (a token shard set, then checkpoints), injects one fault of a random kind at
a random step, reruns the stage cleanly and checks: the rerun completes; the final model is bitwise equal to a
fault-free run's (every fault here hits a step boundary or a checkpoint, and a resumed CPU run is bitwise exact);
files outside the work directory are unchanged; no process of the trial is alive afterwards; a corrupt input was
refused (the run failed naming it, or resume fell back past it) rather than trained on.

The stage is `bench/fault_rank_program.py` (the d9d-core Trainer, 2 CPU ranks over gloo under torchrun, 8 steps,
checkpoints every 2) rather than the whole micro pipeline, so that many trials fit in the time.

Kinds: kill-rank (SIGKILL of one rank mid-step), kill-launcher (SIGKILL of torchrun), sigterm (SIGTERM to torchrun:
preemption), full-disk (file-size limit on one rank while a checkpoint is written), hang (one rank sleeps; the
others time out), flip-shard / truncate-shard / flip-index (a token shard or the shard index damaged before the
run), truncate-checkpoint / flip-checkpoint-state (the newest complete checkpoint damaged after a crash).

    python bench/faults.py --trials 20 --seed 1                 # table on stdout
    python bench/faults.py --trials 100 --append-docs           # also appended to docs/reliability.md
    python bench/faults.py --trials 3 --kinds kill-rank flip-shard --json out.json   # what the CI test runs
    python bench/faults.py --trials 4 --kinds kill-flow interrupt-flow damage-manifest full-disk-stage  # the pipeline
    python bench/faults.py --aggregate runs/*.json                  # one table of many runs' trials
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import psutil

from d9d.core.data import TokenShardSetWriter
from pipeline_faults import PIPELINE_KINDS, inject_pipeline, release, result_digest
from pipeline_faults import run as run_pipeline

HERE = Path(__file__).resolve().parent
PROGRAM = HERE / "fault_rank_program.py"
STEPS, EVERY, NPROC = 8, 2, 2
KINDS = (
    "kill-rank", "kill-launcher", "sigterm", "full-disk", "hang",
    "flip-shard", "truncate-shard", "flip-index", "truncate-checkpoint", "flip-checkpoint-state",
)  # fmt: skip
ALL_KINDS = (*KINDS, *PIPELINE_KINDS)  # the pipeline kinds run the whole micro pipeline: minutes per trial
RUN_TIMEOUT_S = 240


@dataclass
class Trial:
    kind: str
    detail: str
    injected: bool = True  # False: the run ended before the fault's moment (not counted in the table)
    recovered: bool = False
    lost_data: bool = False
    orphans: int = 0
    corrupt_accepted: bool = False
    outside_changed: bool = False
    seconds: float = 0.0
    note: str = ""


def make_shards(directory: Path) -> None:
    """The same small shard set every time (several shards, so a damaged one is one of many)."""
    if directory.exists():
        shutil.rmtree(directory)
    rng = np.random.default_rng(1234)
    with TokenShardSetWriter(directory, dtype="uint16", max_shard_tokens=2000) as writer:
        for _ in range(120):
            writer.add_document(rng.integers(0, 64, size=int(rng.integers(8, 60))), num_bytes=10)


def _command(work: Path) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={NPROC}", "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0", "--max-restarts=0", str(PROGRAM), "--work", str(work),
        "--steps", str(STEPS), "--every", str(EVERY),
    ]  # fmt: skip


def _start(work: Path, fault: str | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    env.pop("D9D_FAULT", None)
    if fault:
        env["D9D_FAULT"] = fault
    log = (work / "log.txt").open("a", encoding="utf-8")
    log.write(f"\n=== {' '.join(_command(work))} D9D_FAULT={fault}\n")
    log.flush()
    return subprocess.Popen(
        _command(work), env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _wait(process: subprocess.Popen[str], timeout: float = RUN_TIMEOUT_S) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return -9


def _run(work: Path, fault: str | None = None) -> int:
    return _wait(_start(work, fault))


def _alive(work: Path) -> list[psutil.Process]:
    """Processes of this trial (their command line names its work directory)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if str(work) in " ".join(process.info["cmdline"] or []):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _reap(work: Path) -> int:
    """Kill what is left of the trial's processes; returns how many there were."""
    left = _alive(work)
    for process in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(left, timeout=10)
    return len(left)


def _wait_for_checkpoint(work: Path, process: subprocess.Popen[str], at_least: int) -> bool:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        complete = [path for path in (work / "checkpoints").glob("step-*") if (path / "COMPLETE").is_file()]
        if any(int(path.name.split("-")[1]) >= at_least for path in complete):
            return True
        time.sleep(0.1)
    return False


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def _newest_complete(work: Path) -> Path:
    return sorted(path for path in (work / "checkpoints").glob("step-*") if (path / "COMPLETE").is_file())[-1]


def _log(work: Path) -> str:
    return (work / "log.txt").read_text(encoding="utf-8", errors="replace")


def _tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def inject(kind: str, work: Path, rng: random.Random) -> tuple[str, bool | None]:
    """Run the stage with fault `kind`; returns (what was done, whether a corrupt input was refused or None)."""
    rank, step = rng.randrange(NPROC), rng.randint(2, STEPS - 1)
    match kind:
        case "kill-rank" | "full-disk" | "hang":
            step = step // EVERY * EVERY if kind == "full-disk" else step  # a step that checkpoints
            name = {"kill-rank": "kill", "full-disk": "fsize", "hang": "hang"}[kind]
            code = _run(work, f"{name}:{rank}:{step}")
            return f"rank {rank} step {step}: exit {code}", None
        case "kill-launcher" | "sigterm":
            process = _start(work)
            if not _wait_for_checkpoint(work, process, at_least=rng.choice([2, 4])):
                return f"the run ended before the signal (exit {_wait(process)})", None
            if kind == "kill-launcher":
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
                time.sleep(1.0)
                return f"torchrun SIGKILLed; {len(_alive(work))} ranks left running", None
            os.kill(process.pid, signal.SIGTERM)
            return f"torchrun SIGTERMed: exit {_wait(process)}", None
        case "flip-shard" | "truncate-shard" | "flip-index":
            shards = sorted((work / "shards").glob("*.d9dtok"))
            target = rng.choice(shards) if kind != "flip-index" else work / "shards" / "index.json"
            if kind == "truncate-shard":
                target.write_bytes(target.read_bytes()[: rng.randrange(64, target.stat().st_size)])
            elif kind == "flip-shard":
                _flip(target, rng.randrange(64, target.stat().st_size))
            else:
                text = target.read_text()
                position = rng.choice([i for i, char in enumerate(text) if char.isdigit()])
                digit = str((int(text[position]) + 1) % 10)
                target.write_text(text[:position] + digit + text[position + 1 :])
            code = _run(work)
            refused = code != 0 and "TokenShardFormatError" in _log(work)
            make_shards(work / "shards")  # the fix the error names: rebuild the shard set
            return f"{target.name} damaged: exit {code}", refused
        case "truncate-checkpoint" | "flip-checkpoint-state":
            code = _run(work, f"kill:{rank}:{rng.randint(5, STEPS - 1)}")  # crash after two complete checkpoints
            newest = _newest_complete(work)
            if kind == "truncate-checkpoint":
                shard = rng.choice(sorted(newest.glob("*.distcp")))
                shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
                target = shard
            else:
                target = rng.choice([newest / "trainer_state.json", *sorted((newest / "rng").glob("*.json"))])
                _flip(target, rng.randrange(target.stat().st_size))
            return f"crash (exit {code}), then {newest.name}/{target.name} damaged", None
        case other:
            raise ValueError(f"unknown fault kind {other!r}; valid: {', '.join(KINDS)}")


def run_trial(kind: str, root: Path, number: int, reference: str, rng: random.Random) -> Trial:
    started = time.monotonic()
    work = root / f"trial-{number:04d}"
    work.mkdir()
    make_shards(work / "shards")
    outside = _tree_digest(root / "outside")
    detail, refused = inject(kind, work, rng)
    trial = Trial(kind=kind, detail=detail)
    trial.orphans = _reap(work)  # counted: a process of the faulty run still alive before the rerun
    code = _run(work)
    final = work / "final.sha256"
    trial.recovered = code == 0 and final.is_file()
    trial.lost_data = not trial.recovered or final.read_text().strip() != reference
    if kind in ("truncate-checkpoint", "flip-checkpoint-state"):
        refused = "trying the previous complete one" in _log(work)
    trial.corrupt_accepted = refused is False
    trial.orphans += _reap(work)
    trial.outside_changed = _tree_digest(root / "outside") != outside
    trial.seconds = round(time.monotonic() - started, 1)
    if trial.lost_data or trial.corrupt_accepted or trial.orphans or trial.outside_changed:
        trial.note = f"see {work / 'log.txt'}"
    return trial


def run_pipeline_trial(
    kind: str, root: Path, number: int, reference: str, reference_seconds: float, rng: random.Random
) -> Trial:
    """A fault in `d9d run pipeline --preset micro`, then the same command again (with the fix a refusal named)."""
    started = time.monotonic()
    work, home = root / f"trial-{number:04d}", root / "home"
    log = root / f"trial-{number:04d}.log"
    outside = _tree_digest(root / "outside")
    try:
        detail, refused, orphans, fix = inject_pipeline(kind, work, home, rng, reference_seconds)
        trial = Trial(kind=kind, detail=detail, orphans=orphans + _reap(work))
        trial.injected = not detail.startswith("the run ended before")
        code = run_pipeline(work, home, log, *fix)
        trial.recovered = code == 0
        try:
            trial.lost_data = not trial.recovered or result_digest(work) != reference
        except (OSError, ValueError, KeyError) as error:
            trial.lost_data, trial.note = True, f"result unreadable: {error!r}"
        trial.corrupt_accepted = refused is False
        trial.orphans += _reap(work)
        trial.outside_changed = _tree_digest(root / "outside") != outside
    finally:
        release(work)
    trial.seconds = round(time.monotonic() - started, 1)
    if trial.lost_data or trial.corrupt_accepted or trial.orphans or trial.outside_changed or not trial.recovered:
        trial.note = (trial.note + f" see {log}").strip()
    return trial


def table(trials: list[Trial]) -> str:
    lines = [
        "| fault | injected | recovered | lost data | orphan processes | corrupt input accepted | outside changed |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in [*ALL_KINDS, "all"]:
        chosen = [trial for trial in trials if kind in ("all", trial.kind) and trial.injected]
        if not chosen:
            continue
        name = f"**{kind}**" if kind == "all" else kind
        lines.append(
            f"| {name} | {len(chosen)} | {sum(t.recovered for t in chosen)} | {sum(t.lost_data for t in chosen)} | "
            f"{sum(t.orphans for t in chosen)} | {sum(t.corrupt_accepted for t in chosen)} | "
            f"{sum(t.outside_changed for t in chosen)} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kinds", nargs="+", choices=ALL_KINDS, default=list(KINDS), help="default: the stage kinds (fast)"
    )
    parser.add_argument("--root", type=Path, help="keep trials here (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write every trial as JSON here")
    parser.add_argument(
        "--append-docs",
        action="store_true",
        help="add the table at the end of docs/reliability.md's fault campaign section",
    )
    parser.add_argument(
        "--aggregate", nargs="+", type=Path, metavar="JSON", help="print one table of earlier --json files"
    )
    args = parser.parse_args()
    if args.aggregate:
        earlier = [Trial(**record) for path in args.aggregate for record in json.loads(path.read_text())]
        print(table(earlier))
        return 0
    root = args.root or Path(tempfile.mkdtemp(prefix="d9d-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    (root / "outside").mkdir(exist_ok=True)
    (root / "outside" / "precious.txt").write_text("files outside the work directory must not change\n")
    rng = random.Random(args.seed)
    started = time.monotonic()

    reference = ""
    if any(kind in KINDS for kind in args.kinds):
        clean = root / "reference"
        clean.mkdir(exist_ok=True)
        make_shards(clean / "shards")
        if _run(clean) != 0:
            print(_log(clean)[-4000:], file=sys.stderr)
            raise SystemExit("the fault-free reference run failed")
        reference = (clean / "final.sha256").read_text().strip()

    kinds = list(args.kinds)
    pipeline_reference, pipeline_seconds = "", 0.0
    reference_record = root / "pipeline-reference.json"  # kept, so that a later campaign in --root reuses it
    if any(kind in PIPELINE_KINDS for kind in kinds) and reference_record.is_file():
        recorded = json.loads(reference_record.read_text())
        pipeline_reference, pipeline_seconds = recorded["digest"], recorded["seconds"]
        print(f"fault-free micro pipeline: {pipeline_seconds:.0f} s (recorded in {reference_record})")
    elif any(kind in PIPELINE_KINDS for kind in kinds):
        clean_pipeline = root / "pipeline-reference"
        began = time.monotonic()
        if run_pipeline(clean_pipeline, root / "home", root / "pipeline-reference.log") != 0:
            print((root / "pipeline-reference.log").read_text()[-4000:], file=sys.stderr)
            raise SystemExit("the fault-free reference pipeline run failed")
        pipeline_seconds = time.monotonic() - began
        pipeline_reference = result_digest(clean_pipeline)
        reference_record.write_text(json.dumps({"digest": pipeline_reference, "seconds": pipeline_seconds}))
        print(f"fault-free micro pipeline: {pipeline_seconds:.0f} s")

    trials = []
    first = len(list(root.glob("trial-*.log")))  # numbers go on after a previous campaign's in the same --root
    for number in range(first, first + args.trials):
        done = number - first
        kind = kinds[done % len(kinds)] if done < len(kinds) else rng.choice(kinds)  # every kind at least once
        if kind in PIPELINE_KINDS:
            trial = run_pipeline_trial(kind, root, number, pipeline_reference, pipeline_seconds, rng)
        else:
            trial = run_trial(kind, root, number, reference, rng)
        trials.append(trial)
        if args.json:  # after every trial, so that a campaign stopped by a time limit keeps what it did
            args.json.write_text(json.dumps([asdict(record) for record in trials], indent=1))
        flags = "ok" if trial.recovered and not (trial.lost_data or trial.corrupt_accepted or trial.orphans) else "BAD"
        print(f"[{done + 1}/{args.trials}] {kind}: {trial.detail} -> {flags} ({trial.seconds} s) {trial.note}")
    minutes = (time.monotonic() - started) / 60
    summary = table(trials)
    print(summary)
    if args.json:
        args.json.write_text(json.dumps([asdict(trial) for trial in trials], indent=1))
    if args.append_docs:
        docs = HERE.parent / "docs" / "reliability.md"
        stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        heading = (
            f"\n`python bench/faults.py --trials {args.trials} --seed {args.seed}` ({stamp}, {minutes:.0f} min, "
            f"CPU, {NPROC} gloo ranks):\n\n"
        )
        text = docs.read_text(encoding="utf-8")
        start = text.index("\n## Fault campaign\n")
        end = text.find("\n## ", start + 1)
        end = len(text) if end < 0 else end
        docs.write_text(text[:end].rstrip("\n") + "\n" + heading + summary + "\n" + text[end:], encoding="utf-8")
    if args.root is None:
        shutil.rmtree(root, ignore_errors=True)
    bad = [t for t in trials if not t.recovered or t.lost_data or t.corrupt_accepted or t.orphans or t.outside_changed]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
