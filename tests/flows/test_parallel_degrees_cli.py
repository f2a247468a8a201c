"""`d9d run` trains with `degrees.tp/cp/pp/ep` (docs/design/0015): 4 gloo CPU ranks on the `micro` presets, each run
in its own output directory over one prepared workdir, against the data-parallel-only run on the same ranks.

Every run sees the same global batch per step (8 rows of 64 tokens) and starts from the same weights (the convert
stage's checkpoint for the dense model; the seeded initialisation, which is layout-independent, for the MoE), so the
loss curves must agree. Tolerance: relative 1e-5 per step over the 8 steps (4 for the fine-tune). The runs differ
only in float32 summation order (tp splits the matmul reductions and the vocabulary-parallel loss; cp sums attention
blocks with an online softmax; pp accumulates micro-batches stage by stage; ep sums expert outputs per rank);
measured on the 2-core machine: tp2 2.0e-8, cp2 3.1e-8, pp2 (1F1B) 2.0e-8, ep2 2.0e-8, fine-tune tp2 4.1e-8
relative at worst (pp2 x tp2 and pp2 x cp2 pass the same bound), so 1e-5 leaves room for another summation order
while a wrong token weighting (1/cp, 1/dp) or a missed shard fails it.

These are the slowest flow tests (a Prefect API and a torchrun launch of 4 ranks per run): few and short.
"""

import json

import pytest

from d9d.flows.cli import main
from d9d.flows.jobs.torchrun_stage import LOG_FILE, LOSSES_FILE, read_losses
from d9d.states import CheckpointSource

pytestmark = [pytest.mark.isolated, pytest.mark.slow]

TOLERANCE = 1e-5
RANKS = "pretrain.nproc_per_node=4"


@pytest.fixture(scope="module")
def workdir(prefect_api, tmp_path_factory):
    """data-prep, finetune-data and convert of the `micro` preset, once; every test trains into its own output."""
    root = tmp_path_factory.mktemp("degrees")
    for stage in ("data-prep", "finetune-data", "convert"):
        assert main(["run", stage, "--preset", "micro", "--set", f"workdir={root}"]) == 0
    return root


def _run(workdir, stage: str, output: str, *overrides: str, preset: str = "micro") -> dict[int, float]:
    target = workdir / output
    argv = ["run", stage, "--preset", preset, "--set", f"workdir={workdir}", "--set", f"{stage}.output={target}"]
    for override in overrides:
        argv += ["--set", override]
    assert main(argv) == 0
    losses = read_losses(target / LOSSES_FILE)
    assert sorted(losses) == list(range(1, len(losses) + 1)) and len(losses) >= 4
    return losses


def _assert_same_curve(actual: dict[int, float], expected: dict[int, float]) -> None:
    worst = max(abs(actual[step] - expected[step]) / abs(expected[step]) for step in expected)
    assert worst <= TOLERANCE, (actual, expected)


def _ran_with(workdir, output: str, stage: str, degrees: str) -> None:
    assert f"{stage} on {degrees}" in (workdir / output / LOG_FILE).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def dense_baseline(workdir):
    losses = _run(workdir, "pretrain", "pretrain-dp4", RANKS)
    _ran_with(workdir, "pretrain-dp4", "pretrain", "pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1, ep=1")
    return losses


@pytest.mark.parametrize(
    ("name", "overrides", "degrees"),
    [
        ("tp2", ["pretrain.degrees.tp=2"], "pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=1"),
        ("cp2", ["pretrain.degrees.cp=2"], "pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=1"),
        (
            "pp2",
            ["pretrain.degrees.pp=2", "pretrain.pipeline.schedule.kind=1f1b"],
            "pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=1, pipeline schedule 1f1b",
        ),
        (
            "pp2tp2",
            ["pretrain.degrees.pp=2", "pretrain.degrees.tp=2"],
            "pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=2, ep=1, pipeline schedule 1f1b",
        ),
        (
            "pp2cp2",
            ["pretrain.degrees.pp=2", "pretrain.degrees.cp=2"],
            "pp=2, dp_replicate=1, dp_shard=1, cp=2, tp=1, ep=1, pipeline schedule 1f1b",
        ),
        # CPU offload of the FSDP units: on CPU ranks the same arithmetic (tests/parallel/test_cpu_offload.py)
        ("offload", ["pretrain.data_parallel.offload=true"], "pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1, ep=1"),
    ],
)
def test_pretrain_with_a_degree_matches_data_parallel_only(workdir, dense_baseline, name, overrides, degrees):
    losses = _run(workdir, "pretrain", f"pretrain-{name}", RANKS, *overrides)
    _ran_with(workdir, f"pretrain-{name}", "pretrain", degrees)
    _assert_same_curve(losses, dense_baseline)


def test_moe_pretrain_with_expert_parallelism_matches_data_parallel_only(workdir):
    baseline = _run(workdir, "pretrain", "moe-dp4", RANKS, preset="micro-moe")
    losses = _run(workdir, "pretrain", "moe-ep2", RANKS, "pretrain.degrees.ep=2", preset="micro-moe")
    _ran_with(workdir, "moe-ep2", "pretrain", "pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1, ep=2")
    _assert_same_curve(losses, baseline)
    # The static-capacity exchange (design 0029) from the command line: at factor 2.0 this routing drops nothing,
    # so it moves the same rows as the all-to-all exchange (bit-equal on the development machine, 8 steps).
    capacity = "pretrain.model.decoder.expert_dispatch.kind=all_to_all_capacity"
    static = _run(workdir, "pretrain", "moe-ep2-capacity", RANKS, "pretrain.degrees.ep=2", capacity, preset="micro-moe")
    assert "kind: all_to_all_capacity" in (workdir / "moe-ep2-capacity" / "job.yaml").read_text(encoding="utf-8")
    _assert_same_curve(static, baseline)
    # Replicated dense parameters beside ep = the data ranks, with the token exchange (design 0031): the layout a
    # CUDA-graphed step needs, from the command line; it adds the tokens' partial sums in another order (float32).
    tokens = "pretrain.model.decoder.expert_dispatch.kind=all_to_all_tokens"
    replicated = _run(
        workdir, "pretrain", "moe-ep4-replicate", RANKS, "pretrain.degrees.ep=4", tokens,
        "pretrain.data_parallel.kind=replicate", preset="micro-moe",
    )  # fmt: skip
    _ran_with(workdir, "moe-ep4-replicate", "pretrain", "pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1, ep=4")
    _assert_same_curve(replicated, baseline)


def _finetune_base(workdir) -> list[str]:
    return [f"pretrain.output={workdir / 'pretrain-dp4'}", "finetune.nproc_per_node=4"]


@pytest.fixture(scope="module")
def finetune_baseline(workdir, dense_baseline):
    """The data-parallel-only fine-tune (dp_shard=4) of the dp4 pretrain, run once: the tp2 and pp2 fine-tunes
    compare with the same run (it was trained twice, identically, into the same output: one 4-rank launch less)."""
    return _run(workdir, "finetune", "finetune-dp4", *_finetune_base(workdir))


def test_finetune_with_tensor_parallelism_matches_data_parallel_only(workdir, finetune_baseline):
    losses = _run(workdir, "finetune", "finetune-tp2", *_finetune_base(workdir), "finetune.degrees.tp=2")
    _ran_with(workdir, "finetune-tp2", "finetune", "pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=1")
    _assert_same_curve(losses, finetune_baseline)


def test_pipelined_finetune_matches_data_parallel_only(workdir, finetune_baseline, capsys):
    """pp=2 x dp_shard=2, ZB-H1 with 1.5x 1F1B's activation memory (design note 0030), set from the command line:
    LoRA per stage, its exports gathered from both stages into the committed output. With 2 micro-batches per step
    the larger bound leaves the program as it is; the gloo parity tests cover a program it changes. Measuring costs
    in the job needs a stage with layers and neither end of the model, which the micro preset's 2 layers cannot
    give: refused before any rank starts."""
    pipeline = ["finetune.degrees.pp=2", "finetune.pipeline.schedule.kind=zb_h1"]
    with pytest.raises(AssertionError):
        _run(
            workdir,
            "finetune",
            "finetune-pp2-measured",
            *_finetune_base(workdir),
            *pipeline,
            "finetune.pipeline.measure_costs_at_step=2",
        )
    assert "measure_costs_at_step=2: 2 stages (pp=2, zb_h1)" in capsys.readouterr().err
    assert not (workdir / "finetune-pp2-measured").exists()
    losses = _run(
        workdir,
        "finetune",
        "finetune-pp2",
        *_finetune_base(workdir),
        *pipeline,
        "finetune.pipeline.schedule.activation_memory=1.5",
    )
    _ran_with(
        workdir,
        "finetune-pp2",
        "finetune",
        "pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=1, pipeline schedule zb_h1",
    )
    _assert_same_curve(losses, finetune_baseline)
    for part in ("adapter", "merged"):  # every stage's tensors, whole (the writers' file count differs: 2 and 4)
        metas = {
            name: meta.shape for name, meta in CheckpointSource.open(workdir / "finetune-pp2" / part).metas().items()
        }
        assert metas == {
            name: meta.shape for name, meta in CheckpointSource.open(workdir / "finetune-dp4" / part).metas().items()
        }


def _evaluation(workdir, output: str, *overrides: str) -> dict:
    target = workdir / output
    argv = ["run", "evaluate", "--preset", "micro", "--set", f"workdir={workdir}", "--set", f"evaluate.output={target}"]
    for override in overrides:
        argv += ["--set", override]
    assert main(argv) == 0
    return json.loads((target / "evaluation.json").read_text(encoding="utf-8"))


def test_evaluate_with_tensor_parallelism_scores_and_samples_like_data_parallel_only(workdir, dense_baseline):
    """The evaluate stage at tp2 x dp_shard2 (tasks scored and prompts continued without sequence parallelism)
    against dp_shard4 on the same checkpoints: the same task scores (1e-5 relative), samples and held-out losses."""
    base = [f"pretrain.output={workdir / 'pretrain-dp4'}", "evaluate.nproc_per_node=4", "evaluate.finetune=false",
            "evaluate.limit=6", "evaluate.max_new_tokens=8"]  # fmt: skip
    expected = _evaluation(workdir, "evaluate-dp4", *base)
    actual = _evaluation(workdir, "evaluate-tp2", *base, "evaluate.degrees.tp=2")
    _ran_with(workdir, "evaluate-tp2", "evaluate", "pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=1")
    assert actual["samples"] == expected["samples"]
    assert all(sample["continuation"] for samples in expected["samples"].values() for sample in samples)
    assert actual["tasks"].keys() == expected["tasks"].keys() and expected["tasks"]
    for checkpoint, tasks in expected["tasks"].items():
        assert tasks.keys() == actual["tasks"][checkpoint].keys() and len(tasks) == 4
        for task, scores in tasks.items():
            assert actual["tasks"][checkpoint][task]["metrics"] == pytest.approx(scores["metrics"], rel=TOLERANCE)
    for checkpoint, splits in expected["checkpoints"].items():
        for split, report in splits.items():
            assert actual["checkpoints"][checkpoint][split]["loss"] == pytest.approx(report["loss"], rel=TOLERANCE)
