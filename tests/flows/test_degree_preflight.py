"""`d9d run` refuses a topology the model, the sequence or the batch cannot take before any rank starts (before
Prefect is even imported), naming the field, its value and what would be valid (docs/design/0015)."""

import sys

import pytest

from d9d.flows.cli import EXIT_BAD_INPUT, main


@pytest.fixture(autouse=True)
def _prefect_stays_unimported():
    was_imported = "prefect" in sys.modules
    yield
    if not was_imported:
        assert "prefect" not in sys.modules, "bad degrees must be reported before Prefect is imported"


def _error(capsys, tmp_path, stage: str, *overrides: str, preset: str = "micro") -> str:
    argv = ["run", stage, "--preset", preset, "--set", f"workdir={tmp_path}"]
    for override in overrides:
        argv += ["--set", override]
    assert main(argv) == EXIT_BAD_INPUT
    assert not any(tmp_path.iterdir()), "nothing may be written for a refused run"
    return capsys.readouterr().err


def test_degrees_whose_product_does_not_fit_the_ranks(capsys, tmp_path):
    err = _error(capsys, tmp_path, "pretrain", "pretrain.nproc_per_node=4", "pretrain.degrees.tp=3")
    assert "pretrain.degrees do not fit 4 ranks (pretrain.nproc_per_node=4 on 1 node(s))" in err
    assert "tp=3" in err and "choose degrees whose product divides 4" in err


def test_fixed_degrees_multiplying_to_another_world_size(capsys, tmp_path):
    err = _error(capsys, tmp_path, "pretrain", "pretrain.degrees.tp=2", "pretrain.degrees.dp_shard=2")
    assert "mesh degrees multiply to 4 but the world size is 2" in err


def test_tp_that_does_not_divide_the_key_value_heads(capsys, tmp_path):
    err = _error(capsys, tmp_path, "pretrain", "pretrain.nproc_per_node=4", "pretrain.degrees.tp=4")
    assert "pretrain.degrees.tp=4: tp=4 does not fit the model: num_key_value_heads=2" in err
    assert "valid tp degrees: [1, 2]" in err


def test_tp_with_replicated_data_parallelism(capsys, tmp_path):
    err = _error(capsys, tmp_path, "pretrain", "pretrain.degrees.tp=2", "pretrain.data_parallel.kind=replicate")
    assert "pretrain.data_parallel.kind=replicate with pretrain.degrees.tp=2 is not supported" in err
    assert "use kind=fsdp or kind=hsdp" in err


def test_replicate_with_experts_shared_by_ranks(capsys, tmp_path):
    # ep=2 over 4 data ranks: two ranks would hold each expert shard; replicate cannot reduce their gradients.
    err = _error(
        capsys, tmp_path, "pretrain", "pretrain.nproc_per_node=4", "pretrain.degrees.ep=2",
        "pretrain.data_parallel.kind=replicate", preset="micro-moe",
    )  # fmt: skip
    assert "pretrain.data_parallel.kind=replicate with pretrain.degrees.ep=2 needs every expert on one rank" in err
    assert "set pretrain.degrees.ep=4" in err


def test_single_rank_data_parallelism_on_several_ranks(capsys, tmp_path):
    err = _error(capsys, tmp_path, "pretrain", "pretrain.data_parallel.kind=single")
    assert "pretrain.data_parallel.kind=single trains one rank without FSDP, but pretrain.degrees.dp_shard=2" in err
    assert "use kind=fsdp" in err and "pretrain.nproc_per_node=1" in err


def test_cp_that_does_not_split_the_sequence_into_2cp_chunks(capsys, tmp_path):
    err = _error(capsys, tmp_path, "pretrain", "pretrain.degrees.cp=2", "pretrain.seq_len=62")
    assert "pretrain.degrees.cp=2 does not fit seq_len=62" in err
    assert "needs a multiple of 2*cp=4 (e.g. 60 or 64)" in err


def test_ep_on_a_dense_model(capsys, tmp_path):
    err = _error(capsys, tmp_path, "pretrain", "pretrain.degrees.ep=2")
    assert "pretrain.degrees.ep=2 needs a model with experts, but the model is qwen3_dense" in err


def test_ep_that_does_not_divide_the_experts(capsys, tmp_path):
    err = _error(
        capsys, tmp_path, "pretrain", "pretrain.nproc_per_node=4", "pretrain.degrees.ep=4",
        "pretrain.model.parameters.num_experts=6", preset="micro-moe",
    )  # fmt: skip
    assert "pretrain.degrees.ep=4 does not divide the model's num_experts=6" in err
    assert "valid ep (dividing num_experts and dp_replicate*dp_shard*cp=4): [1, 2]" in err


def test_ep_beyond_the_fold(capsys, tmp_path):
    err = _error(capsys, tmp_path, "pretrain", "pretrain.degrees.ep=4", preset="micro-moe")
    assert "ep=4 must divide dp_replicate*dp_shard*cp = 2" in err and "valid ep values: 1, 2" in err


def test_pp_with_more_stages_than_layers(capsys, tmp_path):
    err = _error(
        capsys, tmp_path, "pretrain", "pretrain.degrees.pp=2", "pretrain.pipeline.schedule.kind=interleaved_1f1b",
        "pretrain.pipeline.schedule.stages_per_rank=3",
    )  # fmt: skip
    assert "pretrain.degrees.pp=2 with pretrain.pipeline.schedule.kind=interleaved_1f1b" in err
    assert "num_layers=2 (+0 virtual) cannot fill 6 stages" in err


def test_whole_model_compilation_under_pipeline_parallelism(capsys, tmp_path):
    err = _error(capsys, tmp_path, "pretrain", "pretrain.degrees.pp=2", "pretrain.model.decoder.compile_model=true")
    assert "pretrain.model.decoder.compile_model=true with pretrain.degrees.pp=2" in err
    assert "compile_layers=true instead" in err


def test_pp_with_too_few_microbatches_for_the_schedule(capsys, tmp_path):
    err = _error(
        capsys, tmp_path, "pretrain", "pretrain.degrees.pp=2", "pretrain.global_batch_rows=4",
        "pretrain.model.parameters.num_layers=4", "pretrain.pipeline.schedule.kind=dualpipe_v",
    )  # fmt: skip
    assert "(2 micro-batches per step, 4 layers)" in err
    assert "schedule dualpipe_v needs at least 2*pp=4 micro-batches per step" in err


@pytest.mark.parametrize(
    ("degrees", "schedule"),
    [
        ({"pp": 2, "tp": 2}, "zb_h1"),
        ({"pp": 2, "tp": 2}, "zbv"),
        ({"pp": 2, "cp": 2}, "1f1b"),
        ({"pp": 2, "cp": 2}, "zbv"),
    ],
)
def test_pipelines_with_tp_or_cp_pass_the_preflight(degrees, schedule):
    # Parity: tests/pipeline/test_pipeline_tensor_parallel.py (every schedule, pp2 x tp2) and
    # tests/pipeline/test_pipeline_context_parallel.py (pp2 x cp2).
    from d9d.flows.jobs.degree_checks import check_topology
    from d9d.flows.jobs.presets import preset
    from d9d.flows.jobs.topology import RankTopology
    from d9d.models.catalogue import Qwen3MoeModelConfig

    raw = preset("micro-moe")["pretrain"]["model"]
    model = Qwen3MoeModelConfig.model_validate({**raw, "parameters": {**raw["parameters"], "num_layers": 4}})
    topology = RankTopology(nproc_per_node=4, degrees=degrees, pipeline={"schedule": {"kind": schedule}})
    resolved = check_topology("pretrain", topology, model, seq_len=64, microbatches_per_step=4)
    assert (resolved.pp, resolved.tp, resolved.cp, resolved.dp_shard) == (
        2,
        degrees.get("tp", 1),
        degrees.get("cp", 1),
        1,
    )


def test_combinations_not_supported_yet_are_refused_naming_both_degrees(capsys, tmp_path, monkeypatch):
    # Every pair of degrees runs today (UNSUPPORTED is empty); a pair listed there is refused before any rank starts.
    from d9d.flows.jobs import degree_checks

    monkeypatch.setitem(degree_checks.UNSUPPORTED, ("pp", "cp"), "a reason")
    err = _error(
        capsys, tmp_path, "pretrain", "pretrain.nproc_per_node=4", "pretrain.degrees.pp=2", "pretrain.degrees.cp=2",
        preset="micro-moe",
    )  # fmt: skip
    assert "pretrain.degrees.pp=2 with pretrain.degrees.cp=2 is not supported yet (a reason)" in err
    assert "set pretrain.degrees.pp=1 or pretrain.degrees.cp=1" in err


def test_finetune_degrees_are_checked_against_the_pretrained_model(capsys, tmp_path):
    err = _error(capsys, tmp_path, "pipeline", "finetune.nproc_per_node=4", "finetune.degrees.tp=4")
    assert "finetune.degrees.tp=4: tp=4 does not fit the model: num_key_value_heads=2" in err


def test_pipelined_finetune_schedules_are_checked(capsys, tmp_path):
    # The pipelined fine-tune runs (tests/flows/test_pipelined_exports.py); its schedule is checked like pretrain's.
    err = _error(capsys, tmp_path, "pipeline", "finetune.degrees.pp=2", "finetune.pipeline.schedule.kind=dualpipe_v")
    assert "finetune.degrees.pp=2 with finetune.pipeline.schedule.kind=dualpipe_v (4 micro-batches per step" in err
    assert "num_layers=2 (+0 virtual) cannot fill 4 stages" in err  # the pretrained model's layers


def test_finetune_global_batch_over_the_data_parallel_ranks_of_tp(capsys, tmp_path):
    err = _error(capsys, tmp_path, "pipeline", "finetune.nproc_per_node=4", "finetune.degrees.tp=2",
                 "finetune.global_batch_rows=6")  # fmt: skip
    assert (
        "finetune.global_batch_rows=6 cannot be split into micro-batches of finetune.microbatch_rows=2 over 2 " in err
    )
    assert "make it a multiple of 4" in err


def test_evaluate_degrees_are_checked(capsys, tmp_path):
    err = _error(capsys, tmp_path, "pipeline", "evaluate.degrees.cp=2", "evaluate.seq_len=30")
    assert "evaluate.degrees.cp=2 does not fit seq_len=30" in err


@pytest.mark.parametrize(
    ("override", "shown"),
    [
        ("evaluate.degrees.cp=2", "evaluate.degrees.cp=2 (it splits every sequence over ranks"),
        ("evaluate.degrees.pp=2", "evaluate.degrees.pp=2 (each pipeline stage holds part of the layers"),
    ],
)
def test_evaluate_tasks_and_prompts_are_refused_under_cp_and_pp_naming_why(capsys, tmp_path, override, shown):
    err = _error(capsys, tmp_path, "evaluate", override)  # the preset scores its two local tasks and prompts
    assert "evaluate.tasks and evaluate.prompts (task scores and sample continuations) are not supported" in err
    assert shown in err and "set evaluate.tasks=[] and evaluate.prompts=[]" in err


def test_ep_with_tp_passes_the_preflight():
    # ep x tp is supported (experts whole, ep over the data ranks of each tp coordinate; docs/design/0021), so the
    # preflight accepts it; ep still folds over the data ranks only, not over tp.
    from d9d.flows.jobs.degree_checks import check_topology
    from d9d.flows.jobs.presets import preset
    from d9d.flows.jobs.topology import RankTopology
    from d9d.models.catalogue import Qwen3MoeModelConfig

    model = Qwen3MoeModelConfig.model_validate(preset("micro-moe")["pretrain"]["model"])
    topology = RankTopology(nproc_per_node=4, degrees={"tp": 2, "ep": 2})
    degrees = check_topology("pretrain", topology, model, seq_len=64, microbatches_per_step=1)
    assert (degrees.dp_shard, degrees.tp, degrees.ep) == (2, 2, 2)


def test_ep_does_not_fold_over_tp(capsys, tmp_path):
    err = _error(
        capsys, tmp_path, "pretrain", "pretrain.nproc_per_node=4", "pretrain.degrees.tp=2", "pretrain.degrees.ep=4",
        preset="micro-moe",
    )  # fmt: skip
    assert "ep=4 must divide dp_replicate*dp_shard*cp = 2" in err


def test_evaluate_tasks_under_ep_with_tp_are_refused_naming_why(capsys, tmp_path):
    err = _error(capsys, tmp_path, "evaluate", "evaluate.nproc_per_node=4", "evaluate.degrees.tp=2",
                 "evaluate.degrees.ep=2", preset="micro-moe")  # fmt: skip
    assert "evaluate.degrees.ep=2 (with tp, expert dispatch of whole (not sequence-parallel) activations" in err
