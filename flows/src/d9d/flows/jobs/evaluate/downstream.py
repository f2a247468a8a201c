"""What the evaluate ranks score per model beyond held-out loss: lm-eval tasks through lm_eval's own evaluator with
d9d's adapter (`D9dHarnessLM`), and greedy continuations of fixed prompts with the KV-cached `generate`.

Every rank runs the same requests on its copy of the (possibly FSDP-sharded) model: each forward gathers the
parameters, so all ranks must make the same forwards (the adapter and `generate` take the process group for that).
lm_eval is imported here, lazily: a suite without tasks never needs it. The tasks are loaded once per launch and
scored for each model in turn.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from d9d.flows.jobs.evaluate.config import DownstreamConfig
from d9d.models.generation import GenerationConfig, generate

LM_EVAL_EXTRA = "pip install 'd9d-models[eval]'"


@dataclass(frozen=True, kw_only=True)
class TaskScores:
    """One task's metrics (lm_eval's names, e.g. `acc`, `perplexity`), which way is better, and how many documents."""

    metrics: dict[str, float]
    higher_is_better: dict[str, bool]
    documents: int


class DownstreamEvaluator:
    """Scores models on `config.tasks` and continues `config.prompts`; build it once per launch."""

    def __init__(self, config: DownstreamConfig, *, cache_dir: Path, process_group: dist.ProcessGroup | None) -> None:
        # Local JSON-lines data needs no network (hub tasks do); each rank builds its own dataset cache (no
        # shared-file races).
        if all(_is_local(task, config.tasks_dir) for task in config.tasks):
            os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ["HF_DATASETS_CACHE"] = str(cache_dir)
        from tokenizers import Tokenizer

        from d9d.models.generation.harness import TokenizersCodec

        self.config = config
        self.codec = TokenizersCodec(Tokenizer.from_file(str(config.tokenizer)))
        self.process_group = process_group
        self._tasks: Any = None

    def evaluate(self, model: nn.Module) -> dict[str, Any]:
        """`{"tasks": {task: TaskScores as a dict}, "samples": [{"prompt", "continuation"}]}` for `model`."""
        model.eval()
        tasks = {name: scores.__dict__ for name, scores in self.score_tasks(model).items()}
        return {"tasks": tasks, "samples": self.continue_prompts(model)}

    def score_tasks(self, model: nn.Module) -> dict[str, TaskScores]:
        if not self.config.tasks:
            return {}
        try:
            from lm_eval.evaluator import evaluate
        except ImportError as error:
            raise ImportError(
                f"evaluate.tasks={self.config.tasks} are scored with lm-evaluation-harness; install it with "
                f"`{LM_EVAL_EXTRA}`, or set evaluate.tasks=[]"
            ) from error
        from d9d.models.generation.harness import D9dHarnessLM

        logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-request INFO lines drown the launch log
        harness = D9dHarnessLM(
            model,
            self.codec,
            max_length=self.config.max_length,
            batch_size=self.config.batch_size,
            max_gen_toks=self.config.max_new_tokens,
            process_group=self.process_group,
        )
        results = evaluate(harness, self._task_dict(), limit=self.config.limit, bootstrap_iters=0, log_samples=False)
        return {name: _task_scores(results, name) for name in self.config.tasks}

    def continue_prompts(self, model: nn.Module) -> list[dict[str, str]]:
        if not self.config.prompts:
            return []
        eos = self.codec.eos_token_id
        config = GenerationConfig(max_new_tokens=self.config.max_new_tokens, stop_token_ids=[eos], pad_token_id=eos)
        prompts = [self.codec.encode(prompt) or [eos] for prompt in self.config.prompts]
        result = generate(model, prompts, config, decode=self.codec.decode, process_group=self.process_group)
        return [
            {"prompt": prompt, "continuation": text}
            for prompt, text in zip(self.config.prompts, result.texts or [], strict=True)
        ]

    def _task_dict(self) -> Any:
        if self._tasks is None:
            from lm_eval.tasks import TaskManager

            local = str(self.config.tasks_dir) if self.config.tasks_dir is not None else None
            # lm_eval's own task index is only needed (and slow to build) when a hub task is asked for.
            hub = any(not _is_local(name, self.config.tasks_dir) for name in self.config.tasks)
            manager = TaskManager(include_path=local, include_defaults=hub or local is None)
            self._tasks = manager.load(list(self.config.tasks))
        return self._tasks


def _is_local(task: str, tasks_dir: Path | None) -> bool:
    return tasks_dir is not None and (tasks_dir / f"{task}.yaml").is_file()


def _task_scores(results: dict[str, Any], task: str) -> TaskScores:
    """lm_eval reports `metric,filter` keys (`acc,none`); stderr entries are left out (no bootstrap here)."""
    if task not in results["results"]:
        raise KeyError(f"lm_eval returned no results for task {task!r} (it returned {sorted(results['results'])})")
    metrics = {
        key.split(",", 1)[0]: float(value)
        for key, value in results["results"][task].items()
        if "," in key and "_stderr" not in key and isinstance(value, int | float)
    }
    better = {name: bool(value) for name, value in results.get("higher_is_better", {}).get(task, {}).items()}
    documents = int(results.get("n-samples", {}).get(task, {}).get("effective", 0))
    return TaskScores(metrics=metrics, higher_is_better=better, documents=documents)
