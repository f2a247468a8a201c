"""The evaluate rank program under `degrees.pp`, `cp` and `tp` (4 gloo ranks, a checkpoint of the pretrain program)
gives the held-out loss of data parallelism alone on the same rows.

Tolerance 1e-5 relative: float32 sums in another order (tensor-parallel matmul and vocabulary-parallel loss
reductions, context-parallel online softmax, pipeline stages), nothing else differs.
"""

import json

import pytest
import torch.distributed as dist
import yaml
from test_pretrain_program import job_file  # noqa: F401  (the fixture: token shards and a pretrain job file)

from d9d.flows.jobs.evaluate.program import main as evaluate
from d9d.flows.jobs.pretrain.program import main as pretrain

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

TOLERANCE = 1e-5


@pytest.mark.distributed(world_size=4, timeout=600)
def test_evaluate_under_pp_cp_and_tp_equals_data_parallel_only(job_file):  # noqa: F811
    root = job_file.parent
    assert pretrain(["--config", str(job_file), "--set", "stage.steps=2"]) == 0
    job = yaml.safe_load(job_file.read_text())
    config = {"model": job["stage"]["model"], "shards": job["train_shards"], "seq_len": 16, "rows_per_step": 4,
              "device": "cpu", "output": str(root / "eval"), "checkpoint": str(root / "checkpoints")}  # fmt: skip
    eval_file = root / "evaluate.yaml"
    if dist.get_rank() == 0:
        eval_file.write_text(yaml.safe_dump(config))
    dist.barrier()
    losses = {}
    for name, degree in [("dp4", None), ("pp2", "degrees.pp=2"), ("cp2", "degrees.cp=2"), ("tp2", "degrees.tp=2")]:
        argv = ["--config", str(eval_file), "--set", f"output={root / name}"]
        assert evaluate(argv + (["--set", degree] if degree else [])) == 0
        dist.barrier()  # rank 0 writes the report
        losses[name] = json.loads((root / name / "evaluation.json").read_text())["loss"]
    for name, loss in losses.items():
        assert abs(loss - losses["dp4"]) <= TOLERANCE * losses["dp4"], (name, losses)


WORDS = "of man first disobedience and the fruit that forbidden tree whose mortal taste brought death into world"
WORDS = WORDS.split()
MULTIPLE_CHOICE = [
    {"context": "of man first", "choices": ["disobedience and the", "tree whose mortal"], "label": 0},
    {"context": "that forbidden", "choices": ["fruit of man", "tree whose mortal taste"], "label": 1},
    {"context": "brought death", "choices": ["into the world", "and the fruit", "first taste"], "label": 0},
    {"context": "the fruit of", "choices": ["that forbidden tree", "world death"], "label": 0},
]
ROLLING = [{"text": "of man first disobedience and the fruit"}, {"text": "brought death into the world and all"}]


def _write_downstream(root):
    """A word-level tokenizer inside the model's 96-token vocabulary, a multiple-choice and a rolling
    log-likelihood task over local JSON-lines (no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1} | {word: index + 2 for index, word in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(root / "tokenizer.json"))
    tasks = root / "tasks"
    tasks.mkdir()
    for name, docs in (("mc", MULTIPLE_CHOICE), ("rolling", ROLLING)):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    common = "dataset_path: json\ntest_split: test\n"
    (tasks / "d9d_test_mc.yaml").write_text(
        f"task: d9d_test_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'mc.jsonl'}\n"
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n'
    )
    (tasks / "d9d_test_rolling.yaml").write_text(
        f"task: d9d_test_rolling\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'rolling.jsonl'}\n"
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    return {
        "tokenizer": str(root / "tokenizer.json"), "tasks": ["d9d_test_mc", "d9d_test_rolling"],
        "tasks_dir": str(tasks), "max_length": 32, "batch_size": 3, "max_new_tokens": 6,
        "prompts": ["of man first", "brought death into the"],
    }  # fmt: skip


@pytest.mark.distributed(world_size=4, timeout=600)
def test_evaluate_tasks_and_samples_under_tp_equal_data_parallel_only(job_file):  # noqa: F811
    """tp2 x dp_shard2 (the program builds it without sequence parallelism) against dp_shard4 on the same
    checkpoint: the same task scores (log-likelihood sums reduced in another order: 1e-5 relative) and the same
    greedy sample continuations."""
    pytest.importorskip("lm_eval")
    root = job_file.parent
    assert pretrain(["--config", str(job_file), "--set", "stage.steps=2"]) == 0
    job = yaml.safe_load(job_file.read_text())
    eval_file = root / "evaluate.yaml"
    if dist.get_rank() == 0:
        config = {"model": job["stage"]["model"], "shards": job["train_shards"], "seq_len": 16, "rows_per_step": 4,
                  "device": "cpu", "output": str(root / "eval"), "checkpoint": str(root / "checkpoints"),
                  "steps": 1, "downstream": _write_downstream(root)}  # fmt: skip
        eval_file.write_text(yaml.safe_dump(config))
    dist.barrier()
    reports = {}
    for name, degree in [("dp4", None), ("tp2", "degrees.tp=2")]:
        argv = ["--config", str(eval_file), "--set", f"output={root / name}"]
        assert evaluate(argv + (["--set", degree] if degree else [])) == 0
        dist.barrier()  # rank 0 writes the reports
        reports[name] = json.loads((root / name / "downstream.json").read_text())
    expected, actual = reports["dp4"], reports["tp2"]
    assert actual["samples"] == expected["samples"]
    assert all(sample["continuation"] for sample in expected["samples"])
    assert actual["tasks"].keys() == expected["tasks"].keys() == {"d9d_test_mc", "d9d_test_rolling"}
    for task, scores in expected["tasks"].items():
        assert actual["tasks"][task]["metrics"] == pytest.approx(scores["metrics"], rel=TOLERANCE), task
        assert actual["tasks"][task]["documents"] == scores["documents"] > 0
