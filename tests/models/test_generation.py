"""Generation: the KV-cached decode equals re-running the full forward, greedy equals transformers' `generate`,
sampling is seeded and filters as specified, stopping works per row, and an FSDP-sharded model generates the same
(tensor parallelism: test_generation_tensor_parallel.py).

Tolerances: float32 throughout. The cached decode computes the same operations on the same values as the full
forward; only the attention's reduction differs (SDPA over the padded cache vs the eager backend over the exact
sequence), each rounding at float32's 6e-8, so logits agree to 1e-5 and greedy tokens are identical.
"""

import pytest
import torch
from tiny import DENSE_HF, EAGER, MOE_HF, VOCAB, d9d_from_hf, hf_dense, hf_moe
from torch.distributed.tensor import DTensor

from d9d.models import materialize_
from d9d.models.generation import FinishReason, GenerationConfig, SamplingConfig, filter_logits, generate
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    Qwen3MoeForCausalLM,
    parallelize_qwen3_dense,
    parallelize_qwen3_moe,
    qwen3_dense_parameters_from_hf,
    qwen3_moe_parameters_from_hf,
)

FP32 = {"atol": 1e-5, "rtol": 1e-5}
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [12, 7], [33, 2, 71, 71]]  # uneven: rows are padded in the batch
NEW = 8
MAKERS = {"dense": hf_dense, "moe": hf_moe}


def _reference_greedy(model, prompt, steps):
    """Greedy decoding by re-running the full forward over the growing (unpadded, single-row) sequence."""
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            last = model(torch.tensor([ids])).logits[0, -1].float()
            logits.append(last)
            ids.append(int(last.argmax()))
    return ids[len(prompt) :], torch.stack(logits)


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_cached_decode_equals_full_reforward(family):
    model, _ = d9d_from_hf(MAKERS[family]())
    result = generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW), return_logits=True)
    assert result.logits is not None and result.logits.shape == (len(PROMPTS), NEW, VOCAB)
    for row, prompt in enumerate(PROMPTS):
        tokens, logits = _reference_greedy(model, prompt, NEW)
        assert result.tokens[row] == tokens, f"row {row}"
        torch.testing.assert_close(result.logits[row], logits, **FP32, msg=f"row {row}")
    assert result.finish_reasons == [FinishReason.LENGTH] * len(PROMPTS)


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_greedy_equals_transformers_generate(family):
    hf = MAKERS[family]()
    model, _ = d9d_from_hf(hf)
    ours = generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW)).tokens
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        theirs = hf.generate(
            ids,
            attention_mask=attention_mask,
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert ours == theirs[:, width:].tolist()


def test_padded_tensor_prompts_left_or_right_give_the_list_result():
    model, _ = d9d_from_hf(hf_dense())
    config = GenerationConfig(max_new_tokens=4)
    expected = generate(model, PROMPTS, config).tokens
    width, lengths = 7, [len(p) for p in PROMPTS]
    left = torch.tensor([[95] * (width - len(p)) + p for p in PROMPTS])
    right = torch.tensor([p + [95] * (width - len(p)) for p in PROMPTS])
    assert generate(model, left, config, prompt_lengths=lengths, padding_side="left").tokens == expected
    assert generate(model, right, config, prompt_lengths=lengths, padding_side="right").tokens == expected


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    model, _ = d9d_from_hf(hf_dense())
    sampled = GenerationConfig(max_new_tokens=6, sampling=SamplingConfig(do_sample=True, temperature=1.5), seed=3)
    first, second = generate(model, PROMPTS, sampled).tokens, generate(model, PROMPTS, sampled).tokens
    assert first == second
    other_seed = generate(model, PROMPTS, sampled.model_copy(update={"seed": 4})).tokens
    assert other_seed != first  # 18 draws from near-uniform logits over 96 tokens: equal by chance ~1e-35
    greedy = generate(model, PROMPTS, GenerationConfig(max_new_tokens=6)).tokens
    top1 = SamplingConfig(do_sample=True, temperature=0.7, top_k=1)
    assert generate(model, PROMPTS, GenerationConfig(max_new_tokens=6, sampling=top1)).tokens == greedy


def test_filter_logits_top_k_top_p_and_temperature():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    kept = filter_logits(logits, SamplingConfig(do_sample=True, top_k=3)).isfinite()
    assert kept.tolist() == [[True, True, True, False, False]]
    # top_p=0.8: 0.5 + 0.2 = 0.7 < 0.8, so the third token is needed too; 0.85 >= 0.8 stops there.
    kept = filter_logits(logits, SamplingConfig(do_sample=True, top_p=0.8)).isfinite()
    assert kept.tolist() == [[True, True, True, False, False]]
    kept = filter_logits(logits, SamplingConfig(do_sample=True, top_p=0.5)).isfinite()
    assert kept.tolist() == [[True, False, False, False, False]]
    shuffled = logits[:, [3, 0, 4, 2, 1]]  # the nucleus follows the tokens, not their positions
    kept = filter_logits(shuffled, SamplingConfig(do_sample=True, top_p=0.8)).isfinite()
    assert kept.tolist() == [[False, True, False, True, True]]
    torch.testing.assert_close(filter_logits(logits, SamplingConfig(do_sample=True, temperature=2.0)), logits / 2)


def test_stop_token_ids_and_stop_strings_end_rows_separately():
    model, _ = d9d_from_hf(hf_dense())
    free = generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW)).tokens
    stop_token = free[0][2]  # row 0 stops at its third token, the others where (if) they produce it
    result = generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW, stop_token_ids=[stop_token]))
    assert result.tokens[0] == free[0][:3] and result.finish_reasons[0] == FinishReason.STOP_TOKEN
    for row in (1, 2):
        expected = free[row][: free[row].index(stop_token) + 1] if stop_token in free[row] else free[row]
        assert result.tokens[row] == expected

    def decode(ids):
        return " ".join(f"t{token}" for token in ids)

    stop = f"t{free[1][1]}"
    result = generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW, stop_strings=[stop]), decode=decode)
    assert result.texts is not None and stop not in result.texts[1]
    assert result.finish_reasons[1] == FinishReason.STOP_STRING and len(result.tokens[1]) <= 2
    assert result.texts[1] == decode(result.tokens[1]).split(stop)[0]


def test_bad_input_is_named():
    model, _ = d9d_from_hf(hf_dense())
    with pytest.raises(ValueError, match="stop_strings"):
        generate(model, PROMPTS, GenerationConfig(max_new_tokens=2, stop_strings=["x"]))
    with pytest.raises(ValueError, match="prompt_lengths"):
        generate(model, torch.zeros(2, 3, dtype=torch.long), GenerationConfig(max_new_tokens=2), prompt_lengths=[4, 1])
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, [[1], []], GenerationConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=1.5)
    model.model.sequence_sharded = True  # what the context-parallel plan sets on the backbone
    with pytest.raises(NotImplementedError, match="cp=1"):
        generate(model, PROMPTS, GenerationConfig(max_new_tokens=2))


FAMILIES = {
    "dense": (Qwen3DenseForCausalLM, parallelize_qwen3_dense, qwen3_dense_parameters_from_hf, DENSE_HF),
    "moe": (Qwen3MoeForCausalLM, parallelize_qwen3_moe, qwen3_moe_parameters_from_hf, MOE_HF),
}


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")
@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.distributed(world_size=2, timeout=180)
def test_fsdp_sharded_generation_equals_single_process(family):
    from d9d.core.dist import DistributedContext, MeshDegrees
    from d9d.parallel import FsdpConfig

    cls, parallelize, params_from_hf, hf_config = FAMILIES[family]
    params = params_from_hf({**hf_config, "num_hidden_layers": 2})
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2))
    with torch.device("meta"):
        model, reference = cls(params, config=EAGER), cls(params, config=EAGER)
    parallelize(model, ctx, FsdpConfig())
    torch.manual_seed(7)
    materialize_(model, "cpu")
    torch.manual_seed(7)
    materialize_(reference, "cpu")
    assert all(isinstance(p, DTensor) for p in model.parameters())
    # Each rank continues its own prompts, and rank 1's stop after one token: it must keep joining the forwards
    # (each gathers parameters) until rank 0 is done.
    prompts = PROMPTS if ctx.rank == 0 else [[4, 4, 9]]
    reference_free = generate(reference, [[4, 4, 9]], GenerationConfig(max_new_tokens=1)).tokens[0]
    config = GenerationConfig(max_new_tokens=NEW, stop_token_ids=reference_free if ctx.rank == 1 else [])
    ours = generate(model, prompts, config, process_group=torch.distributed.group.WORLD, return_logits=True)
    expected = generate(reference, prompts, config, return_logits=True)
    assert ours.tokens == expected.tokens
    assert ours.finish_reasons == expected.finish_reasons
    steps = expected.logits.shape[1]  # rank 1 alone stops after 1 step; sharded, it kept stepping with rank 0
    assert ours.logits.shape[1] == NEW
    torch.testing.assert_close(ours.logits[:, :steps], expected.logits, **FP32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_decode_equals_eager_on_gpu():
    model, _ = d9d_from_hf(hf_dense())
    model = model.cuda()
    eager = generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW), return_logits=True)
    compiled = generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW, compile=True), return_logits=True)
    assert compiled.tokens == eager.tokens
    torch.testing.assert_close(compiled.logits, eager.logits, atol=1e-4, rtol=1e-4)  # fused kernels reorder sums
