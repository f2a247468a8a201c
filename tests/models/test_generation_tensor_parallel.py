"""Generation on a tensor-parallel Qwen3 (dense and MoE), alone (tp=2) and with FSDP (tp=2 x dp_shard=2): the same
tokens, logits and finish reasons as single-process generation on the same weights, greedy, sampled and with stop
strings, identical on every tp rank; a model in the sequence-parallel (training) layout is refused by name, and a
checkpoint it writes loads into the replicated-activation layout that generates.

Tolerances: float32. The tp model computes the same sums split over two ranks (each row-parallel linear adds the
ranks' partial products in an all-reduce), so logits differ from the single-process ones by reordering only: 1e-5.
Greedy and seeded sampled tokens are identical (the test asserts it; a near-tie flipped by 1e-6 would show here).
"""

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tiny import EAGER, d9d_from_hf, hf_dense, hf_moe
from torch.distributed.tensor import DTensor, Replicate

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.models import materialize_
from d9d.models.generation import FinishReason, GenerationConfig, SamplingConfig, generate
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    Qwen3MoeForCausalLM,
    detect_experts_format,
    mapper_from_huggingface_qwen3_dense,
    mapper_from_huggingface_qwen3_moe,
    mapper_to_huggingface_qwen3_dense,
    parallelize_qwen3_dense,
    parallelize_qwen3_moe,
    qwen3_dense_parameters_from_hf,
    qwen3_moe_parameters_from_hf,
)
from d9d.parallel import FsdpConfig
from d9d.parallel.tensor import TensorParallelConfig
from d9d.states import load_model_state, save_model_state

pytestmark = [
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:Slicing a flattened dim:UserWarning"),
]

FP32 = {"atol": 1e-5, "rtol": 1e-5}
NEW = 6
REPLICATED_ACTIVATIONS = TensorParallelConfig(sequence_parallel=False)
# Per data-parallel rank: uneven rows (padded in the batch), odd lengths (no sequence split would fit tp=2).
PROMPTS = {0: [[5, 17, 3, 88, 41, 9, 60], [12, 7], [33, 2, 71]], 1: [[4, 4, 9], [90, 1, 1, 30, 2]]}


def _decode(ids):
    return " ".join(f"t{token}" for token in ids)


def _hf(family):
    return hf_dense(seed=5, num_hidden_layers=2) if family == "dense" else hf_moe(seed=5, num_hidden_layers=2)


def _tp_model(family, hf, directory, degrees, tensor_parallel=REPLICATED_ACTIVATIONS):
    """The tp model loaded from the HF checkpoint in `directory` through the real loading path."""
    config = hf.config.to_dict()
    if family == "dense":
        params = qwen3_dense_parameters_from_hf(config)
        cls, parallelize, mapper = Qwen3DenseForCausalLM, parallelize_qwen3_dense, mapper_from_huggingface_qwen3_dense
        from_hf = mapper(params)
    else:
        params = qwen3_moe_parameters_from_hf(config)
        cls, parallelize = Qwen3MoeForCausalLM, parallelize_qwen3_moe
        on_disk = {}
        for file in directory.glob("*.safetensors"):
            on_disk.update(load_file(file))
        from_hf = mapper_from_huggingface_qwen3_moe(params, experts_format=detect_experts_format(on_disk))
    ctx = DistributedContext.build(degrees, device="cpu")
    with torch.device("meta"):
        model = cls(params, config=EAGER)
    parallelize(model, ctx, FsdpConfig(), tensor_parallel=tensor_parallel)
    materialize_(model, "cpu")
    load_model_state(directory, model, from_hf)
    return model.eval(), ctx


def _saved_hf(family, tmp_path):
    hf = _hf(family)
    if dist.get_rank() == 0:
        hf.save_pretrained(tmp_path / "hf")
    dist.barrier()
    return hf


def _check_against_single_process(model, reference, prompts, group):
    """Greedy (logits too), seeded sampling and stop strings equal the single-process model's; every rank of the
    tp group holds the same tokens."""
    greedy = GenerationConfig(max_new_tokens=NEW)
    ours = generate(model, prompts, greedy, process_group=group, return_logits=True)
    expected = generate(reference, prompts, greedy, return_logits=True)
    assert ours.tokens == expected.tokens
    torch.testing.assert_close(ours.logits, expected.logits, **FP32)

    sampling = SamplingConfig(do_sample=True, temperature=1.3, top_k=40, top_p=0.95)
    sampled = GenerationConfig(max_new_tokens=NEW, sampling=sampling, seed=11)
    ours_sampled = generate(model, prompts, sampled, process_group=group).tokens
    assert ours_sampled == generate(reference, prompts, sampled).tokens
    assert ours_sampled != ours.tokens  # sampling at temperature 1.3 over near-uniform logits left greedy

    stop = f"t{expected.tokens[0][1]}"  # row 0 stops at its second token; the others where (if) they produce it
    stopping = GenerationConfig(max_new_tokens=NEW, stop_strings=[stop])
    ours_stopped = generate(model, prompts, stopping, decode=_decode, process_group=group)
    expected_stopped = generate(reference, prompts, stopping, decode=_decode)
    assert ours_stopped.tokens == expected_stopped.tokens and ours_stopped.texts == expected_stopped.texts
    assert ours_stopped.finish_reasons == expected_stopped.finish_reasons
    assert ours_stopped.finish_reasons[0] == FinishReason.STOP_STRING
    return ours.tokens, ours_sampled


def _tp_ranks_agree(tokens, ctx):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (ctx.coordinate("batch")["dp"], tokens))
    by_dp = {}
    for dp, held in every:
        by_dp.setdefault(dp, []).append(held)
    assert all(all(held == group[0] for held in group) for group in by_dp.values()), by_dp


@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.distributed(world_size=2, timeout=300)
def test_tp2_generation_equals_single_process(family, tmp_path):
    hf = _saved_hf(family, tmp_path)
    model, ctx = _tp_model(family, hf, tmp_path / "hf", MeshDegrees(tp=2))
    between = []  # activations between blocks: whole on every rank (no sequence parallelism)
    hook = model.model.layers["0"].register_forward_hook(lambda _m, _a, out: between.append(out))
    reference, _ = d9d_from_hf(hf)
    greedy, sampled = _check_against_single_process(model, reference, PROMPTS[0], dist.group.WORLD)
    hook.remove()
    assert isinstance(between[0], DTensor) and between[0].placements == (Replicate(),)
    assert between[0].to_local().shape[:2] == (3, 7) and between[1].to_local().shape[:2] == (3, 1)  # decode step
    _tp_ranks_agree((greedy, sampled), ctx)

    with pytest.raises(ValueError, match=r"tp ranks \[0, 1\] were given different prompts"):
        generate(model, PROMPTS[dist.get_rank()], GenerationConfig(max_new_tokens=2))


@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.distributed(world_size=4, timeout=420)
def test_tp2_fsdp2_generation_equals_single_process(family, tmp_path):
    hf = _saved_hf(family, tmp_path)
    model, ctx = _tp_model(family, hf, tmp_path / "hf", MeshDegrees(dp_shard=2, tp=2))
    reference, _ = d9d_from_hf(hf)
    dp = ctx.coordinate("batch")["dp"]  # each data-parallel rank its own prompts, shared by its two tp ranks
    greedy, sampled = _check_against_single_process(model, reference, PROMPTS[dp], dist.group.WORLD)
    _tp_ranks_agree((greedy, sampled), ctx)


@pytest.mark.distributed(world_size=2, timeout=300)
def test_sequence_parallel_model_is_refused_and_its_checkpoint_generates(tmp_path):
    hf = _saved_hf("dense", tmp_path)
    trained, _ = _tp_model("dense", hf, tmp_path / "hf", MeshDegrees(tp=2), tensor_parallel=TensorParallelConfig())
    with pytest.raises(NotImplementedError, match=r"tp=2.*TensorParallelConfig\(sequence_parallel=False\)"):
        generate(trained, PROMPTS[0], GenerationConfig(max_new_tokens=2))
    params = qwen3_dense_parameters_from_hf(hf.config.to_dict())
    with torch.no_grad():  # as if trained: the export must not be the import echoed back
        for param in trained.parameters():
            param.mul_(1.01)
    save_model_state(tmp_path / "trained", trained, mapper_to_huggingface_qwen3_dense(params))
    dist.barrier()
    model, _ = _tp_model("dense", hf, tmp_path / "trained", MeshDegrees(tp=2))
    with torch.no_grad():
        for param in hf.parameters():
            param.mul_(1.01)
    reference, _ = d9d_from_hf(hf)
    expected = generate(reference, PROMPTS[0], GenerationConfig(max_new_tokens=NEW), return_logits=True)
    ours = generate(model, PROMPTS[0], GenerationConfig(max_new_tokens=NEW), return_logits=True)
    assert ours.tokens == expected.tokens
    torch.testing.assert_close(ours.logits, expected.logits, **FP32)


@pytest.mark.distributed(world_size=4, timeout=300)
def test_expert_parallel_with_the_replicated_layout_is_refused_naming_the_degrees():
    params = qwen3_moe_parameters_from_hf({**_hf("moe").config.to_dict()})
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, tp=2, ep=2), device="cpu")
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(params, config=EAGER)
    with pytest.raises(NotImplementedError, match=r"ep=2 with tp=2 and sequence_parallel=False"):
        parallelize_qwen3_moe(model, ctx, FsdpConfig(), tensor_parallel=REPLICATED_ACTIVATIONS)
