"""The training stage the fault campaign (`bench/faults.py`) runs under `torchrun`: `fault_rank_program.py --work DIR`.

A tiny next-token model (embedding + linear) trained by the d9d-core `Trainer` on CPU ranks over gloo: data from the
token shard set `DIR/shards` (opened with its checksums verified), rows chosen from the global step only (so a
resumed run sees the same batches), gradients summed over ranks by one all-reduce per parameter, checkpoints every
`--every` steps into `DIR/checkpoints`. At the end rank 0 writes the sha256 of every parameter's bytes to
`DIR/final.sha256` (the campaign compares it bitwise with a fault-free run).

`D9D_FAULT=KIND:RANK:STEP` injects one fault into rank RANK: `kill` SIGKILLs it after backward of step STEP;
`fsize` lowers its file-size limit to 4 KiB as the checkpoint of step STEP starts (a full disk: the write fails and
SIGXFSZ ends the rank); `hang` makes it sleep forever at the start of step STEP (the others must time out).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import signal
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from d9d.core.data import TokenShardSet
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import (
    CheckpointingConfig,
    CheckpointStarted,
    EventBus,
    ForwardBackwardFinished,
    LossResult,
    StepStarted,
    TokenBatch,
    Trainer,
    TrainerConfig,
    TrainerParts,
)

VOCAB, SEQ, ROWS = 64, 16, 8  # ROWS: global batch rows per step


class ShardRows:
    """This rank's rows of each global batch: row r of step s is document (s * ROWS + r) mod N, cut to SEQ + 1."""

    def __init__(self, shards: TokenShardSet, rank: int, world: int) -> None:
        self._shards, self._rank, self._world = shards, rank, world
        self.steps = 0

    def next_step(self) -> list[TokenBatch]:
        per_rank = ROWS // self._world
        rows = []
        for row in range(self._rank * per_rank, (self._rank + 1) * per_rank):
            document = self._shards.document((self.steps * ROWS + row) % self._shards.num_documents)
            tokens = np.resize(np.asarray(document, dtype=np.int64), SEQ + 1)  # repeats a short document
            rows.append(torch.from_numpy(tokens))
        self.steps += 1
        batch = torch.stack(rows)
        return [TokenBatch(input_ids=batch[:, :-1], labels=batch[:, 1:])]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = int(state["steps"])


class NextToken:
    def count_tokens(self, batch: TokenBatch) -> int:
        return batch.labels.numel()

    def compute_loss(self, model: nn.Module, batch: TokenBatch) -> LossResult:
        logits = model(batch.input_ids)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch.labels.reshape(-1), reduction="sum")
        return LossResult(loss_sum=loss)


class AllReduceGradients:
    """Sum every gradient over the ranks once backward is done (plain data parallelism)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model

    def begin_step(self, num_microbatches: int) -> None:
        del num_microbatches

    def wait(self) -> None:
        for param in self._model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)


def _inject(events: EventBus, rank: int) -> None:
    spec = os.environ.get("D9D_FAULT", "")
    if not spec:
        return
    kind, fault_rank, step = spec.split(":")
    if int(fault_rank) != rank:
        return
    at = int(step)

    def kill(event: ForwardBackwardFinished) -> None:
        if event.step == at:
            os.kill(os.getpid(), signal.SIGKILL)

    def full_disk(event: CheckpointStarted) -> None:
        if event.step == at:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    def hang(event: StepStarted) -> None:
        if event.step == at:
            time.sleep(10**6)

    match kind:
        case "kill":
            events.subscribe(ForwardBackwardFinished, kill)
        case "fsize":
            events.subscribe(CheckpointStarted, full_disk)
        case "hang":
            events.subscribe(StepStarted, hang)
        case other:
            raise ValueError(f"D9D_FAULT kind {other!r}; valid: kill, fsize, hang")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=30.0)  # also the rendezvous: slow imports on a busy host
    args = parser.parse_args()
    with DistributedContext.build(
        MeshDegrees(dp_shard=-1), device="cpu", timeout=timedelta(seconds=args.timeout_s)
    ) as ctx:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
        config = TrainerConfig(
            total_steps=args.steps,
            global_batch_rows=ROWS,
            microbatch_rows=ROWS // ctx.world_size,
            collective_timeout_s=args.timeout_s,
            checkpointing=CheckpointingConfig(directory=args.work / "checkpoints", every_steps=args.every),
        )
        parts = TrainerParts(
            model=model,
            gradient_sync=AllReduceGradients(model),
            optimizer=optimizer,
            lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
            data=ShardRows(TokenShardSet(args.work / "shards"), ctx.rank, ctx.world_size),
            task=NextToken(),
        )
        events = EventBus()
        _inject(events, ctx.rank)
        result = Trainer(ctx, config, parts, events=events).train()
        if ctx.is_main_process and not result.preempted:
            digest = hashlib.sha256()
            for name, tensor in sorted(model.state_dict().items()):
                digest.update(name.encode())
                digest.update(tensor.detach().contiguous().numpy().tobytes())
            (args.work / "final.sha256").write_text(digest.hexdigest() + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
