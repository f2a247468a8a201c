"""Rank program for the kill/resume tests: `torchrun --nproc-per-node N rank_program.py --out DIR [faults]`.

Trains the tiny dense Qwen3 under FSDP over all ranks for `--steps` steps, checkpointing every `--every` steps
into `DIR/checkpoints`, and appends each step's loss (as a float hex string, for bitwise comparison) to
`DIR/losses.jsonl` on rank 0. Faults, applied on the ranks named by `--fault-ranks` (default: all):
`--kill-at S` SIGKILLs itself mid-step S (after backward, before the optimizer step); `--kill-in-checkpoint S`
SIGKILLs itself when the checkpoint of step S starts writing; `--sigterm-at S` sends itself SIGTERM at the start
of step S (what a preempting scheduler does).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

from loop_workload import build_tiny_trainer

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import CheckpointStarted, EventBus, ForwardBackwardFinished, StepFinished, StepStarted


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--kill-in-checkpoint", type=int)
    parser.add_argument("--sigterm-at", type=int)
    parser.add_argument("--fault-ranks", type=int, nargs="*")
    args = parser.parse_args()

    ctx = DistributedContext.build(MeshDegrees(dp_shard=-1), device="cpu")
    faulty = args.fault_ranks is None or ctx.rank in args.fault_ranks
    events = EventBus()

    def kill_self(signum: int) -> None:
        os.kill(os.getpid(), signum)

    if faulty and args.kill_at is not None:
        events.subscribe(
            ForwardBackwardFinished, lambda e: kill_self(signal.SIGKILL) if e.step == args.kill_at else None
        )
    if faulty and args.kill_in_checkpoint is not None:
        events.subscribe(
            CheckpointStarted, lambda e: kill_self(signal.SIGKILL) if e.step == args.kill_in_checkpoint else None
        )
    if faulty and args.sigterm_at is not None:
        events.subscribe(StepStarted, lambda e: kill_self(signal.SIGTERM) if e.step == args.sigterm_at else None)
    if ctx.is_main_process:
        args.out.mkdir(parents=True, exist_ok=True)

        def record(event: StepFinished) -> None:
            with (args.out / "losses.jsonl").open("a", encoding="utf-8") as handle:
                handle.write(json.dumps({"step": event.step, "loss": event.loss.hex()}) + "\n")
                handle.flush()
                os.fsync(handle.fileno())

        events.subscribe(StepFinished, record)

    trainer = build_tiny_trainer(
        ctx,
        family="dense",
        parallel="fsdp",
        total_steps=args.steps,
        global_rows=4,
        microbatch_rows=1,
        checkpoint_dir=args.out / "checkpoints",
        checkpoint_every=args.every,
        events=events,
    )
    result = trainer.train()
    if ctx.is_main_process:
        summary = {
            "last_step": result.last_step,
            "preempted": result.preempted,
            "resumed_from": str(result.resumed_from) if result.resumed_from else None,
        }
        (args.out / "result.json").write_text(json.dumps(summary), encoding="utf-8")
    ctx.close()


if __name__ == "__main__":
    main()
