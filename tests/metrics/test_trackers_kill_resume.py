"""A training run logging to JSON lines, TensorBoard, aim and wandb (offline) at once is SIGKILLed mid-step 13
(checkpoints every 5 steps, so steps 11 and 12 were already logged), resumed from step 10 and run to step 20. Each
sink, read back with its own reader, must hold one run whose loss series has steps 1..20 exactly once, with the
losses the Trainer reported (the surviving attempt's, for replayed steps).

Readers: the JSON lines file itself; TensorBoard's `EventAccumulator`; aim's SDK (`aim.Repo`, the run indexed
first); the `.wandb` transaction logs parsed into wandb's own `Record` protobufs. Two `torchrun` launches of 2 gloo
ranks; the trackers exist on both ranks but only rank 0 writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = Path(__file__).with_name("tracker_rank_program.py")
STEPS = list(range(1, 21))
pytestmark = [pytest.mark.isolated, pytest.mark.slow]


def _launch(out: Path, *extra: str) -> int:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0", "--max-restarts=0", str(PROGRAM), "--out", str(out), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "WANDB_SILENT": "true"}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    with (out / "launch.log").open("a") as log:
        log.write(completed.stdout + completed.stderr)
    return completed.returncode


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kill-resume")
    assert _launch(out, "--kill-at", "13") != 0
    (jsonl,) = (out / "jsonl").glob("*.jsonl")
    logged = [json.loads(line)["step"] for line in jsonl.read_text().splitlines()]
    assert logged == list(range(1, 13)), "the killed attempt logged steps 1..12, so 11 and 12 get replayed"
    assert _launch(out) == 0, (out / "launch.log").read_text()[-3000:]
    return out


def _trainer_losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    return {record["step"]: record["loss"] for record in records}  # a replayed step keeps its last value


def test_jsonl_run_is_rewritten_on_resume_to_hold_each_step_once(run_dir):
    (path,) = (run_dir / "jsonl").glob("*.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [record["step"] for record in records] == STEPS
    expected = _trainer_losses(run_dir)
    assert all(record["loss"] == expected[record["step"]] for record in records)
    assert {"grad_norm", "learning_rate", "tokens", "tokens_per_second"} <= set(records[0])
    hparams = json.loads(path.with_suffix("").with_suffix(".hparams.json").read_text())
    assert hparams == {"model.hidden": 16, "model.vocab": 32, "optimizer.lr": 0.01, "steps": 20}


def test_tensorboard_reader_drops_the_killed_attempts_replayed_steps(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (log_dir,) = (run_dir / "tensorboard").iterdir()
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2  # one file per attempt, in one run directory
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    scalars = accumulator.Scalars("loss")
    assert [event.step for event in scalars] == STEPS
    expected = _trainer_losses(run_dir)
    for event in scalars:  # TensorBoard stores float32
        assert event.value == pytest.approx(expected[event.step], rel=1e-6)


def test_aim_run_is_continued_and_replayed_steps_overwritten(run_dir):
    from aim import Repo
    from aim.sdk.index_manager import RepoIndexManager
    from aim.storage.context import Context

    repo = Repo.from_path(str(run_dir / "aim"))
    (run_hash,) = repo.list_all_runs()
    RepoIndexManager.get_index_manager(repo).index(run_hash)  # aim queries see a run only once it is indexed
    (run,) = list(repo.iter_runs())
    assert (run.hash, run.experiment, run.name) == (run_hash, "kill-resume", "train")
    steps, (values, *_) = run.get_metric("loss", Context({})).data.items_list()
    assert steps == STEPS
    expected = _trainer_losses(run_dir)
    assert values == [expected[step] for step in STEPS]
    assert run["hparams"] == {"model.hidden": 16, "model.vocab": 32, "optimizer.lr": 0.01, "steps": 20}


def test_wandb_offline_directories_share_the_run_id_and_hold_each_step_once(run_dir):
    from d9d.metrics.trackers.wandb_records import read_history, read_records, read_run_id

    files = sorted((run_dir / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # wandb offline writes one directory per process: one per attempt
    run_ids = {read_run_id(path) for path in files}
    assert len(run_ids) == 1 and None not in run_ids
    groups = {record.run.run_group for path in files for record in read_records(path) if record.HasField("run")}
    assert groups == {"kill-resume"}
    rows = [row for path in files for row in read_history(path)]
    assert sorted(row["_step"] for row in rows) == STEPS
    expected = _trainer_losses(run_dir)
    assert all(row["loss"] == expected[row["_step"]] for row in rows)
