"""The project's two local lm-eval tasks, built from the held-out works of its own corpora.

For each embedded corpus (Shakespeare, Milton) this writes, into one directory, JSON-lines data and an lm-eval
custom task YAML per task:

- `d9d_next_line_<corpus>`: multiple choice. Given a line of verse, which of `choices` lines follows it (the true
  next line, the others drawn from the same held-out work)? Metric: accuracy over the choices' log-likelihoods.
- `d9d_cloze_<corpus>`: LAMBADA-style. Given the previous line and a line without its last word, the word.
  Metrics: whether greedy decoding produces the word (`acc`) and the word's perplexity.

Only works that the data-prep stage holds out for validation (same fraction and seed as its defaults) are used, so
a model trained on that stage's training split never saw the text. Output is deterministic for given arguments.

    python -m d9d.flows.jobs.evaluation_tasks OUT_DIR [--docs 200] [--seed 0]
    lm_eval --model ... --include_path OUT_DIR --tasks d9d_next_line_milton,d9d_cloze_milton
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from d9d.flows.jobs.data_prep.config import EmbeddedCorpus
from d9d.flows.jobs.data_prep.corpus import embedded_files
from d9d.flows.jobs.data_prep.split import validation_documents

CorpusName = Literal["shakespeare", "milton"]
CORPORA: tuple[CorpusName, ...] = ("shakespeare", "milton")
_LINE_NUMBER = re.compile(r"\s{2,}\d+\s*$")  # Gutenberg verse carries line numbers at the right margin
_WORD = re.compile(r"^[A-Za-z]{3,}$")


@dataclass(frozen=True, kw_only=True)
class HeldOutSplit:
    """How a stage chose its validation works from an embedded corpus (its `validation_fraction`, `seed` and the
    corpus's `limit`): the tasks are built from those works only. The defaults are the data-prep stage's."""

    validation_fraction: float = 0.05
    seed: int = 0
    limit: int | None = None


@dataclass(frozen=True, kw_only=True)
class HeldOutText:
    corpus: CorpusName
    works: tuple[str, ...]
    lines: tuple[tuple[str, ...], ...]  # per work, its cleaned verse lines in order


def held_out_text(
    corpus: CorpusName, *, validation_fraction: float = 0.05, split_seed: int = 0, limit: int | None = None
) -> HeldOutText:
    """The works of `corpus` in the data-prep stage's validation split (each `.txt` file is one document), for a
    stage that read its first `limit` works (`EmbeddedCorpus.limit`) and split them with this fraction and seed."""
    files = embedded_files(EmbeddedCorpus(name=corpus, limit=limit))
    chosen = sorted(validation_documents(len(files), validation_fraction, split_seed))
    works = [files[index] for index in chosen]
    return HeldOutText(
        corpus=corpus,
        works=tuple(work.name for work in works),
        lines=tuple(tuple(_clean_lines(work.path.read_text(encoding="utf-8", errors="replace"))) for work in works),
    )


def _clean_lines(text: str) -> list[str]:
    lines = []
    for raw in text.splitlines():
        line = _LINE_NUMBER.sub("", raw).strip()
        if len(line.split()) >= 4 and not line.isupper():  # verse, not headings or stage directions in capitals
            lines.append(line)
    return lines


def next_line_documents(text: HeldOutText, *, count: int, choices: int, seed: int) -> list[dict[str, Any]]:
    """`count` multiple-choice documents: `context` a line, `choices` candidate next lines, `label` the true one."""
    rng = random.Random(f"next_line/{text.corpus}/{seed}")  # noqa: S311 (reproducible, not secret)
    pairs = [(work, index) for work, lines in enumerate(text.lines) for index in range(len(lines) - 1)]
    documents = []
    for work, index in rng.sample(pairs, min(count, len(pairs))):
        lines = text.lines[work]
        target = lines[index + 1]
        pool = [line for line in lines if line not in (target, lines[index])]
        options = [target, *rng.sample(pool, choices - 1)]
        rng.shuffle(options)
        documents.append({"context": lines[index], "choices": options, "label": options.index(target)})
    return documents


def cloze_documents(text: HeldOutText, *, count: int, seed: int) -> list[dict[str, Any]]:
    """`count` documents: `context` the previous line and this line up to its last word, `target` that word."""
    rng = random.Random(f"cloze/{text.corpus}/{seed}")  # noqa: S311 (reproducible, not secret)
    candidates = []
    for work, lines in enumerate(text.lines):
        for index in range(1, len(lines)):
            *head, last = lines[index].split()
            word = last.rstrip(".,;:!?'\"")
            if len(head) >= 3 and _WORD.match(word):
                candidates.append((work, index, " ".join(head), word))
    documents = []
    for work, index, prefix, word in rng.sample(candidates, min(count, len(candidates))):
        documents.append({"context": f"{text.lines[work][index - 1]}\n{prefix}", "target": f" {word}"})
    return documents


def _yaml(task: str, data: Path, body: Sequence[str]) -> str:
    # JSON strings are YAML strings: no quoting rules of our own.
    header = [
        f"task: {task}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(data.resolve()))}",
        "test_split: test",
    ]
    return "\n".join([*header, *body]) + "\n"


NEXT_LINE_BODY = (
    "output_type: multiple_choice",
    'doc_to_text: "{{context}}"',
    'doc_to_choice: "{{choices}}"',
    'doc_to_target: "{{label}}"',
    f"target_delimiter: {json.dumps(chr(10))}",
    "metric_list:",
    "  - metric: acc",
    "    aggregation: mean",
    "    higher_is_better: true",
)
CLOZE_BODY = (
    "output_type: loglikelihood",
    'doc_to_text: "{{context}}"',
    'doc_to_target: "{{target}}"',
    'target_delimiter: ""',
    "metric_list:",
    "  - metric: acc",
    "    aggregation: mean",
    "    higher_is_better: true",
    "  - metric: perplexity",
    "    aggregation: perplexity",
    "    higher_is_better: false",
)


def write_local_tasks(
    out_dir: Path,
    *,
    corpora: Sequence[CorpusName] = CORPORA,
    documents: int = 200,
    choices: int = 4,
    seed: int = 0,
    validation_fraction: float = 0.05,
    split_seed: int = 0,
    limit: int | None = None,
) -> list[str]:
    """Write `<task>.jsonl` and `<task>.yaml` for both tasks of each corpus into `out_dir`; returns the task names."""
    if documents < 1:
        raise ValueError(f"documents={documents} must be at least 1")
    if choices < 2:
        raise ValueError(f"choices={choices} must be at least 2 (the true line and a distractor)")
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for corpus in corpora:
        text = held_out_text(corpus, validation_fraction=validation_fraction, split_seed=split_seed, limit=limit)
        for kind, docs, body in (
            ("next_line", next_line_documents(text, count=documents, choices=choices, seed=seed), NEXT_LINE_BODY),
            ("cloze", cloze_documents(text, count=documents, seed=seed), CLOZE_BODY),
        ):
            task = f"d9d_{kind}_{corpus}"
            data = out_dir / f"{task}.jsonl"
            data.write_text("".join(json.dumps(doc, sort_keys=True) + "\n" for doc in docs), encoding="utf-8")
            (out_dir / f"{task}.yaml").write_text(_yaml(task, data, body), encoding="utf-8")
            names.append(task)
    return names


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--corpora", nargs="+", choices=CORPORA, default=list(CORPORA))
    parser.add_argument("--docs", type=int, default=200, help="documents per task")
    parser.add_argument("--choices", type=int, default=4, help="candidate lines per next-line question")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--validation-fraction", type=float, default=0.05, help="as data_prep.validation_fraction")
    parser.add_argument("--split-seed", type=int, default=0, help="as data_prep.seed")
    args = parser.parse_args(argv)
    names = write_local_tasks(
        args.out_dir,
        corpora=args.corpora,
        documents=args.docs,
        choices=args.choices,
        seed=args.seed,
        validation_fraction=args.validation_fraction,
        split_seed=args.split_seed,
    )
    sys.stdout.write("".join(f"{name}\n" for name in names))


if __name__ == "__main__":
    main()
