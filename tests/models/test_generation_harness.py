"""The lm-eval-harness adapter: its log-likelihoods equal a direct computation, its generations equal `generate`,
and a local task (custom YAML over JSON-lines, no network) runs through lm_eval's own `simple_evaluate`.

float32: the adapter runs the same forward as the direct computation, only batched with right padding (which the
causal mask hides), so log-likelihoods agree to 1e-5 (sums of a few log-probabilities, each exact to ~1e-7).
"""

import json

import pytest
import torch
from tiny import DENSE_HF, EAGER
from torch.nn import functional

from d9d.models import materialize_
from d9d.models.generation import GenerationConfig, generate
from d9d.models.qwen3 import Qwen3DenseForCausalLM, qwen3_dense_parameters_from_hf

lm_eval = pytest.importorskip("lm_eval")
tokenizers = pytest.importorskip("tokenizers")

from lm_eval.api.instance import Instance  # noqa: E402

from d9d.models.generation.harness import D9dHarnessLM, TokenizersCodec  # noqa: E402

TEXT = [
    "Of Man's first disobedience, and the fruit",
    "Of that forbidden tree whose mortal taste",
    "Brought death into the World, and all our woe,",
    "Shall I compare thee to a summer's day?",
    "Thou art more lovely and more temperate:",
]


def _codec():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TEXT, trainer=trainer)
    return TokenizersCodec(tokenizer)


def _model(vocab):
    params = qwen3_dense_parameters_from_hf({**DENSE_HF, "vocab_size": vocab, "num_hidden_layers": 2})
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(params, config=EAGER)
    torch.manual_seed(0)
    materialize_(model, "cpu")
    return model.eval()


@pytest.fixture(scope="module")
def lm():
    codec = _codec()
    return D9dHarnessLM(_model(codec.tokenizer.get_vocab_size()), codec, max_length=64, batch_size=3)


def _request(kind, args, index=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=index)


def _direct_logprob(model, context, continuation):
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        log_probs = functional.log_softmax(model(ids).logits.float()[0], dim=-1)
    predicted = log_probs[len(context) - 1 : -1]
    target = torch.tensor(continuation)
    return float(predicted.gather(-1, target[:, None]).sum()), bool((predicted.argmax(-1) == target).all())


def test_loglikelihood_equals_direct_computation(lm):
    pairs = [("Of Man's first", " disobedience"), ("", "Thou art"), ("Shall I compare thee", " to a summer's day?")]
    pairs += [(TEXT[2], " and all"), ("Brought", " death into the World")]
    ours = lm.loglikelihood([_request("loglikelihood", pair, i) for i, pair in enumerate(pairs)])
    for (context, continuation), (logprob, greedy) in zip(pairs, ours, strict=True):
        context_ids = lm.codec.encode(context) if context else [lm.codec.eos_token_id]
        expected, expected_greedy = _direct_logprob(lm.model, context_ids, lm.codec.encode(continuation))
        assert logprob == pytest.approx(expected, abs=1e-5), (context, continuation)
        assert greedy == expected_greedy
        assert logprob < 0


def test_greedy_flag_marks_the_model_own_argmax(lm):
    context = lm.codec.encode("Of that forbidden")
    generated = generate(lm.model, [context], GenerationConfig(max_new_tokens=3)).tokens[0]
    changed = [*generated[:-1], (generated[-1] + 1) % 320]
    greedy, other = lm.score_pairs([(context, generated), (context, changed)])
    assert greedy.is_greedy and not other.is_greedy
    assert greedy.logprob > other.logprob


def test_loglikelihood_rolling_equals_direct_computation(lm):
    texts = [TEXT[0], TEXT[3] + " " + TEXT[4]]
    ours = lm.loglikelihood_rolling([_request("loglikelihood_rolling", (text,), i) for i, text in enumerate(texts)])
    for text, value in zip(texts, ours, strict=True):
        ids = lm.codec.encode(text)
        expected, _ = _direct_logprob(lm.model, [lm.codec.eos_token_id], ids)
        assert value == pytest.approx(expected, abs=1e-5)


def test_rolling_windows_cover_every_token_once_when_text_exceeds_max_length():
    codec = _codec()
    model = _model(codec.tokenizer.get_vocab_size())
    short = D9dHarnessLM(model, codec, max_length=8, batch_size=2)
    text = " ".join(TEXT)
    assert len(codec.encode(text)) > 3 * 8
    (value,) = short.loglikelihood_rolling([_request("loglikelihood_rolling", (text,))])
    # Each token is scored once, with at most 8 tokens of context: the total lies between the full-context
    # log-likelihood's neighbourhood and zero, and equals the sum over lm_eval's disjoint windows done directly.
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    expected = 0.0
    for window in get_rolling_token_windows(codec.encode(text), codec.eos_token_id, 8, 1):
        context, continuation = make_disjoint_window(window)
        expected += _direct_logprob(model, context, continuation)[0]
    assert value == pytest.approx(expected, abs=1e-4)


def test_generate_until_stops_at_the_request_strings(lm):
    context = "Of Man's first"
    prompt, eos = lm.codec.encode(context), lm.codec.eos_token_id
    free = generate(lm.model, [prompt], GenerationConfig(max_new_tokens=12, stop_token_ids=[eos])).tokens[0]
    # A stop string the model does produce: the text of one of its later tokens (printable ASCII, so the decoded
    # prefix is the same however the tokens are cut).
    stop = next(
        text
        for token in free[2:]
        if (text := lm.codec.decode([token])).isascii() and text.strip() and text not in lm.codec.decode(free[:2])
    )
    steps = next(n for n in range(1, len(free) + 1) if stop in lm.codec.decode(free[:n]))
    (text,) = lm.generate_until([_request("generate_until", (context, {"until": [stop], "max_gen_toks": 12}))])
    assert text == lm.codec.decode(free[:steps]).split(stop)[0]
    assert stop not in text
    with pytest.raises(ValueError, match="unsupported generation arguments"):
        lm.generate_until([_request("generate_until", (context, {"until": [], "num_beams": 4}))])


def test_local_multiple_choice_task_runs_through_simple_evaluate(lm, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    docs = [
        {"context": TEXT[0], "choices": [" " + TEXT[1], " " + TEXT[3]], "label": 0},
        {"context": TEXT[3], "choices": [" " + TEXT[2], " " + TEXT[4]], "label": 1},
        {"context": TEXT[1], "choices": [" " + TEXT[2], " " + TEXT[0], " " + TEXT[4]], "label": 0},
    ]
    data = tmp_path / "next_line.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (tmp_path / "next_line.yaml").write_text(
        "task: d9d_test_next_line\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    results = simple_evaluate(model=lm, tasks=["d9d_test_next_line"], task_manager=manager, log_samples=False)
    accuracy = results["results"]["d9d_test_next_line"]["acc,none"]
    # The same choice, computed with the adapter's scoring directly: the most likely continuation per document.
    correct = 0
    for doc in docs:
        scores = [lm.loglikelihood([_request("loglikelihood", (doc["context"], c))])[0][0] for c in doc["choices"]]
        correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["label"])
    assert accuracy == pytest.approx(correct / len(docs))


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")
@pytest.mark.distributed(world_size=2, timeout=180)
def test_adapter_on_an_fsdp_sharded_model_equals_single_process():
    from d9d.core.dist import DistributedContext, MeshDegrees
    from d9d.models.qwen3 import parallelize_qwen3_dense
    from d9d.parallel import FsdpConfig

    codec = _codec()
    params = qwen3_dense_parameters_from_hf(
        {**DENSE_HF, "vocab_size": codec.tokenizer.get_vocab_size(), "num_hidden_layers": 2}
    )
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2))
    with torch.device("meta"):
        sharded = Qwen3DenseForCausalLM(params, config=EAGER)
    parallelize_qwen3_dense(sharded, ctx, FsdpConfig())
    torch.manual_seed(0)
    materialize_(sharded, "cpu")
    reference = _model(codec.tokenizer.get_vocab_size())
    ours = D9dHarnessLM(sharded, codec, max_length=64, batch_size=2, process_group=torch.distributed.group.WORLD)
    theirs = D9dHarnessLM(reference, codec, max_length=64, batch_size=2)
    pairs = [(TEXT[0], " " + TEXT[1]), ("", TEXT[3]), ("Thou art", " more lovely")]
    requests = [_request("loglikelihood", pair, i) for i, pair in enumerate(pairs)]
    for (a, greedy_a), (b, greedy_b) in zip(ours.loglikelihood(requests), theirs.loglikelihood(requests), strict=True):
        assert a == pytest.approx(b, abs=1e-5) and greedy_a == greedy_b
    until = [_request("generate_until", ("Of Man's first", {"until": ["\n"], "max_gen_toks": 6}))]
    assert ours.generate_until(until) == theirs.generate_until(until)


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")
@pytest.mark.distributed(world_size=2, timeout=300)
def test_adapter_on_a_tensor_parallel_model_equals_single_process(tmp_path):
    """tp=2 without sequence parallelism (any sequence length; here odd ones): log-likelihoods, rolling
    log-likelihoods and generations equal the single-process model's on the same checkpoint."""
    import torch.distributed as dist
    from tiny import d9d_from_hf, hf_dense

    from d9d.core.dist import DistributedContext, MeshDegrees
    from d9d.models.qwen3 import mapper_from_huggingface_qwen3_dense, parallelize_qwen3_dense
    from d9d.parallel import FsdpConfig
    from d9d.parallel.tensor import TensorParallelConfig
    from d9d.states import load_model_state

    codec = _codec()
    hf = hf_dense(seed=2, vocab_size=codec.tokenizer.get_vocab_size(), num_hidden_layers=2)
    if dist.get_rank() == 0:
        hf.save_pretrained(tmp_path / "hf")
    dist.barrier()
    params = qwen3_dense_parameters_from_hf(hf.config.to_dict())
    ctx = DistributedContext.build(MeshDegrees(tp=2))
    with torch.device("meta"):
        sharded = Qwen3DenseForCausalLM(params, config=EAGER)
    parallelize_qwen3_dense(sharded, ctx, FsdpConfig(), tensor_parallel=TensorParallelConfig(sequence_parallel=False))
    materialize_(sharded, "cpu")
    load_model_state(tmp_path / "hf", sharded, mapper_from_huggingface_qwen3_dense(params))
    reference, _ = d9d_from_hf(hf)
    ours = D9dHarnessLM(sharded, codec, max_length=64, batch_size=2, process_group=dist.group.WORLD)
    theirs = D9dHarnessLM(reference, codec, max_length=64, batch_size=2)
    pairs = [(TEXT[0], " " + TEXT[1]), ("", TEXT[3]), ("Thou art", " more lovely"), (TEXT[2], " and all")]
    requests = [_request("loglikelihood", pair, i) for i, pair in enumerate(pairs)]
    for (a, greedy_a), (b, greedy_b) in zip(ours.loglikelihood(requests), theirs.loglikelihood(requests), strict=True):
        assert a == pytest.approx(b, abs=1e-5) and greedy_a == greedy_b
    rolling = [_request("loglikelihood_rolling", (text,), i) for i, text in enumerate(TEXT[:2])]
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(theirs.loglikelihood_rolling(rolling), abs=1e-5)
    until = [_request("generate_until", ("Of Man's first", {"until": ["\n"], "max_gen_toks": 6}))]
    assert ours.generate_until(until) == theirs.generate_until(until)

    with torch.device("meta"):
        sequence_parallel = Qwen3DenseForCausalLM(params, config=EAGER)
    parallelize_qwen3_dense(sequence_parallel, ctx, FsdpConfig())
    with pytest.raises(NotImplementedError, match=r"sequence_parallel=False"):
        D9dHarnessLM(sequence_parallel, codec)
