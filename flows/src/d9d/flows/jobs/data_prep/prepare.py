"""Data preparation in this process (not a torchrun rank program): plan the work, get a tokenizer, tokenize in worker
processes, index the shards.

Every finished piece (the tokenizer, each unit of tokenized text) is recorded in the stage's partial directory
with the key it was made for, so an attempt that fails part-way loses nothing: the next one keeps what matches.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import platform
import sys
import time
import types
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, assert_never

from d9d.core.data import FORMAT_VERSION, ShardInfo, TokenDType, token_dtype_for_vocab, write_token_shard_index
from d9d.flows.jobs.contract import (
    FileFingerprint,
    ManifestError,
    PartialStage,
    StageKey,
    StageManifest,
    digest_json,
)
from d9d.flows.jobs.data_prep.config import DataPrepConfig, FileTokenizer, TrainBpeTokenizer
from d9d.flows.jobs.data_prep.corpus import (
    CorpusFile,
    DocumentRange,
    check_readable,
    corpus_files,
    read_range,
    scan,
    text_field_of,
)
from d9d.flows.jobs.data_prep.split import validation_documents
from d9d.flows.jobs.data_prep.tokenizer import (
    TokenizerError,
    TokenizerInfo,
    describe,
    load_tokenizer_file,
    tokenizer_spec,
    train_bpe,
)
from d9d.flows.jobs.data_prep.worker import ItemResult, WorkItem, initialize_worker, tokenize_item
from d9d.flows.jobs.faults import check_fault
from d9d.flows.jobs.progress import Progress

STAGE_NAME = "data-prep"
# Bump when the same config and inputs would now produce different output, so finished stages run again.
STAGE_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "validation")
RECORDED_PACKAGES = ("d9d-core", "d9d-flows", "tokenizers", "numpy", "pyarrow", "pydantic")


@dataclass(frozen=True, kw_only=True)
class Preflight:
    """The cheap checks, done before anything starts (and before an orchestrator is contacted)."""

    files: tuple[CorpusFile, ...]
    tokenizer_spec: str


@dataclass(frozen=True, kw_only=True)
class DataPrepPlan:
    config: DataPrepConfig
    output: Path
    files: tuple[CorpusFile, ...]
    ranges: tuple[DocumentRange, ...]
    documents: int
    text_bytes: int
    validation: frozenset[int]
    tokenizer_spec: str
    key: StageKey


@dataclass(frozen=True, kw_only=True)
class DataPrepOutcome:
    outputs: list[str]
    statistics: dict[str, Any]


def preflight(config: DataPrepConfig, output: Path) -> Preflight:
    """Fail fast on a missing or unreadable corpus file, a bad tokenizer file, or a tokenizer mismatch."""
    files = tuple(corpus_files(config.corpus))
    text_field = text_field_of(config.corpus)
    for file in files:
        check_readable(file, text_field=text_field)
    spec = tokenizer_spec(config.tokenizer)
    check_existing_tokenizer(config, output, spec)
    return Preflight(files=files, tokenizer_spec=spec)


def check_existing_tokenizer(config: DataPrepConfig, output: Path, spec: str) -> None:
    """Refuse to replace a shard set made with another tokenizer unless the config says so.

    Other changes (more text, another seed) simply make the stage run again; a different tokenizer silently
    invalidates every model trained on the old shards, so it has to be asked for.
    """
    if config.allow_tokenizer_change or not output.exists():
        return
    try:
        existing = StageManifest.read(output).statistics.get("tokenizer", {})
    except ManifestError:
        return
    if existing.get("spec") not in (None, spec):
        raise TokenizerError(
            f"tokenizer mismatch with the existing shard set at {output}: it was tokenized with "
            f"{existing.get('source', 'another tokenizer')} (sha256 {str(existing.get('sha256'))[:12]}), but "
            f"data_prep.tokenizer now asks for {_tokenizer_source(config)}; write elsewhere with "
            "--set data_prep.output=DIR, or replace it with --set data_prep.allow_tokenizer_change=true"
        )


def plan_data_prep(config: DataPrepConfig, output: Path) -> DataPrepPlan:
    """Checksum the inputs, cut the corpus into ranges and choose the validation documents."""
    checked = preflight(config, output)
    fingerprints: list[FileFingerprint] = []
    ranges: list[DocumentRange] = []
    documents = 0
    for file in checked.files:
        fingerprint, file_ranges = scan(file, first_document=documents, chunk_bytes=config.chunk_bytes)
        fingerprints.append(fingerprint)
        ranges += file_ranges
        documents += sum(document_range.count for document_range in file_ranges)
    if isinstance(config.tokenizer, FileTokenizer):
        fingerprints.append(FileFingerprint.of(config.tokenizer.path, name=f"tokenizer:{config.tokenizer.path}"))
    if documents == 0:
        raise ValueError(f"data_prep.corpus holds no documents ({len(checked.files)} files, all empty)")
    key = StageKey(
        stage=STAGE_NAME,
        stage_version=STAGE_VERSION,
        config={**config.stage_key_config(), "token_shard_format": FORMAT_VERSION},
        inputs=tuple(fingerprints),
    )
    return DataPrepPlan(
        config=config,
        output=output,
        files=checked.files,
        ranges=tuple(ranges),
        documents=documents,
        text_bytes=sum(document_range.text_bytes for document_range in ranges),
        validation=validation_documents(documents, config.validation_fraction, config.seed),
        tokenizer_spec=checked.tokenizer_spec,
        key=key,
    )


def run_data_prep(plan: DataPrepPlan, partial: PartialStage, *, progress: Progress) -> DataPrepOutcome:
    """Produce the stage's files in `partial.root`, reusing every piece an earlier attempt finished."""
    started = time.perf_counter()
    tokenizer, tokenizer_seconds, tokenizer_reused = _tokenizer_piece(plan, partial, progress)
    dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    items = _work_items(plan, partial.root, dtype)
    checksums = {fingerprint.name: fingerprint.sha256 for fingerprint in plan.key.inputs}
    keys = {item.number: _item_key(item, tokenizer, checksums) for item in items}
    results: dict[int, ItemResult] = {}
    for item in items:
        piece = partial.find(_piece_name(item), keys[item.number])
        if piece is not None:
            results[item.number] = _result_from_json(piece.data)
    pending = [item for item in items if item.number not in results]
    reused = f" ({len(results)} finished by an earlier attempt)" if results else ""
    progress.note(
        f"tokenizing {len(items)} units of about {plan.config.chunk_bytes // 1024} KiB of text{reused} with "
        f"{min(plan.config.workers, max(len(pending), 1))} worker processes"
    )
    progress.start("tokenize", total=plan.text_bytes, unit="B")
    if results:  # a fresh run reused nothing: no "earlier attempt" on its bar
        progress.advance(sum(item.text_bytes for item in items if item.number in results), "earlier attempt")
    tokenize_started = time.perf_counter()
    failed = True
    try:
        if pending:
            _tokenize(
                pending, workers=plan.config.workers, partial=partial, keys=keys, results=results, progress=progress
            )
        failed = False
    finally:
        progress.finish(failed=failed)
    tokenize_seconds = time.perf_counter() - tokenize_started
    outputs = [TOKENIZER_FILE]
    split_stats: dict[str, dict[str, int]] = {}
    for split in SPLITS:
        shards = [shard for number in sorted(results) if (shard := _shard(results[number], split)) is not None]
        index = write_token_shard_index(
            partial.root / split,
            [ShardInfo(**{**asdict(shard), "file": Path(shard.file).name}) for shard in shards],
            dtype=dtype,
            metadata={
                "split": split,
                "tokenizer_sha256": tokenizer.sha256,
                "vocab_size": tokenizer.vocab_size,
                "eos_token_id": tokenizer.eos_token_id,
                "stage_key": plan.key.digest,
            },
        )
        outputs += [f"{split}/index.json", *(shard.file for shard in shards)]
        split_stats[split] = {
            "documents": index.num_documents,
            "tokens": index.num_tokens,
            "bytes": index.num_bytes,
            "shards": len(index.shards),
        }
    new_tokens = sum(results[item.number].tokens for item in pending)
    statistics = {
        "splits": split_stats,
        "documents": plan.documents,
        "empty_documents": sum(result.empty_documents for result in results.values()),
        "text_bytes": plan.text_bytes,
        "bytes_per_token": round(
            sum(s["bytes"] for s in split_stats.values()) / max(1, sum(s["tokens"] for s in split_stats.values())), 4
        ),
        "tokenizer": {
            **tokenizer.to_json(),
            "source": _tokenizer_source(plan.config),
            "seconds": round(tokenizer_seconds, 3),
            "reused": tokenizer_reused,
        },
        "tokenization": {
            "workers": plan.config.workers,
            "units": len(items),
            "units_reused": len(items) - len(pending),
            "seconds": round(tokenize_seconds, 3),
            "tokens_per_second": round(new_tokens / tokenize_seconds) if pending and tokenize_seconds > 0 else None,
        },
        "seconds": round(time.perf_counter() - started, 3),
        "python": platform.python_version(),
    }
    return DataPrepOutcome(outputs=outputs, statistics=statistics)


def _tokenizer_source(config: DataPrepConfig) -> str:
    tokenizer = config.tokenizer
    match tokenizer:
        case TrainBpeTokenizer():
            return f"a byte-level BPE trained here (vocab_size={tokenizer.vocab_size})"
        case FileTokenizer():
            return f"the tokenizer file {tokenizer.path}"
        case _:
            assert_never(tokenizer)


def _tokenizer_piece(
    plan: DataPrepPlan, partial: PartialStage, progress: Progress
) -> tuple[TokenizerInfo, float, bool]:
    config = plan.config
    # A trained tokenizer depends on its settings and on the training text (every input, and which documents
    # are held out); a loaded one only on its file.
    key = digest_json(
        {
            "spec": plan.tokenizer_spec,
            "inputs": plan.key.inputs_hash if isinstance(config.tokenizer, TrainBpeTokenizer) else None,
            "validation": sorted(plan.validation) if isinstance(config.tokenizer, TrainBpeTokenizer) else None,
        }
    )
    piece = partial.find("tokenizer", key)
    if piece is not None:
        progress.note("tokenizer: reusing the one an earlier attempt made")
        data = dict(piece.data)
        seconds = float(data.pop("seconds"))
        return TokenizerInfo(**data), seconds, True
    started = time.perf_counter()
    path = partial.root / TOKENIZER_FILE
    match config.tokenizer:
        case TrainBpeTokenizer():
            progress.note(f"tokenizer: training a byte-level BPE with {config.tokenizer.vocab_size} tokens")
            _train_in_a_worker(plan, path, progress)
            tokenizer = load_tokenizer_file(path)
        case FileTokenizer():
            tokenizer = load_tokenizer_file(config.tokenizer.path)
            tokenizer.save(str(path))
        case _:
            assert_never(config.tokenizer)
    info = describe(tokenizer, config.tokenizer, spec=plan.tokenizer_spec)
    seconds = time.perf_counter() - started
    partial.record("tokenizer", key, [TOKENIZER_FILE], {**info.to_json(), "seconds": seconds})
    check_fault("data_prep.tokenizer", 1)
    return info, seconds, False


def _train_in_a_worker(plan: DataPrepPlan, path: Path, progress: Progress) -> None:
    """Train in a worker process, showing the documents the trainer has read and then its merging, live.

    In a worker process: training starts a thread pool, which must not live on in a process that forks later (test
    harnesses, orchestrators); it also returns the training memory when it ends. `tokenizers` exposes no progress
    but its own terminal bar, so the worker counts the documents it hands the trainer into shared memory and this
    process polls the count; once every document is read, the trainer merges pairs (the bar's clock keeps running).
    """
    context = _worker_context()
    documents_read = context.Value("q", 0, lock=False)  # one writer (the worker): no lock needed
    all_read = context.Value("b", 0, lock=False)
    progress.start("tokenizer training", total=float(plan.documents - len(plan.validation)), unit="documents")
    shown = 0
    failed = True
    try:
        with ProcessPoolExecutor(
            max_workers=1, mp_context=context, initializer=_TrainingCounter.share, initargs=(documents_read, all_read)
        ) as executor:
            with _workers_skip_the_main_module():  # the worker starts here
                training = executor.submit(train_tokenizer_file, plan, path)
            while not training.done():
                wait([training], timeout=_TRAINING_POLL_SECONDS)
                read = int(documents_read.value)
                progress.advance(float(read - shown), "merging pairs" if all_read.value else "reading")
                shown = read
            training.result()
        failed = False
    finally:
        progress.finish(failed=failed)


_TRAINING_POLL_SECONDS = 0.5


class _TrainingCounter:
    """The worker's shared count of training documents handed to the trainer (set by the pool's initializer)."""

    documents_read: Any = None
    all_read: Any = None

    @classmethod
    def share(cls, documents_read: Any, all_read: Any) -> None:
        cls.documents_read, cls.all_read = documents_read, all_read

    @classmethod
    def count(cls, texts: Iterator[str]) -> Iterator[str]:
        """`texts`, counting each into the shared counter, and flagging the end (the trainer then merges)."""
        for text in texts:
            yield text
            if cls.documents_read is not None:
                cls.documents_read.value += 1
        if cls.all_read is not None:
            cls.all_read.value = 1


def train_tokenizer_file(plan: DataPrepPlan, path: Path) -> None:
    """Train the plan's BPE on its training split and save it to `path` (runs in a worker process)."""
    assert isinstance(plan.config.tokenizer, TrainBpeTokenizer)
    train_bpe(_TrainingCounter.count(_training_texts(plan)), plan.config.tokenizer).save(str(path))


def _training_texts(plan: DataPrepPlan) -> Iterator[str]:
    """The training split's documents, in order, up to `max_train_bytes` of text."""
    config = plan.config
    assert isinstance(config.tokenizer, TrainBpeTokenizer)
    budget = config.tokenizer.max_train_bytes
    text_field = text_field_of(config.corpus)
    used = 0
    for document_range in plan.ranges:
        for offset, text in enumerate(read_range(document_range, text_field=text_field)):
            if document_range.first_document + offset in plan.validation:
                continue
            size = len(text.encode("utf-8"))
            if budget is not None and used + size > budget:
                yield text[: budget - used]  # characters for bytes: at most the budget's worth of text
                return
            used += size
            yield text


def _work_items(plan: DataPrepPlan, root: Path, dtype: TokenDType) -> list[WorkItem]:
    """Consecutive ranges packed into items of about `chunk_bytes` of text (independent of the worker count)."""
    groups: list[list[DocumentRange]] = [[]]
    size = 0
    for document_range in plan.ranges:
        if groups[-1] and size + document_range.text_bytes > plan.config.chunk_bytes:
            groups.append([])
            size = 0
        groups[-1].append(document_range)
        size += document_range.text_bytes
    items = []
    text_field = text_field_of(plan.config.corpus)
    for number, group in enumerate(groups):
        first = group[0].first_document
        last = group[-1].first_document + group[-1].count
        items.append(
            WorkItem(
                number=number,
                ranges=tuple(group),
                validation=frozenset(d for d in plan.validation if first <= d < last),
                text_field=text_field,
                tokenizer_path=root / TOKENIZER_FILE,
                dtype=dtype,
                train_path=root / "train" / f"part-{number:05d}.d9dtok",
                validation_path=root / "validation" / f"part-{number:05d}.d9dtok",
            )
        )
    return items


def _worker_context() -> multiprocessing.context.BaseContext:
    """Workers come from a fork server: a clean single-threaded process that has imported the worker code once.

    Never a plain fork of the caller, which may run an orchestrator's threads (a forked copy of a lock another
    thread held deadlocks); and cheaper than spawning, which imports everything again for every pool.
    """
    context = multiprocessing.get_context("forkserver")
    # Takes effect when the fork server starts (the first pool in this process); later calls change nothing.
    context.set_forkserver_preload(["d9d.flows.jobs.data_prep.prepare", "d9d.flows.jobs.data_prep.worker"])
    return context


@contextlib.contextmanager
def _workers_skip_the_main_module() -> Iterator[None]:
    """While pool workers start, `__main__` is a bare module, so that they do not run the caller's main module.

    A fork-server (or spawned) worker first imports the parent's main module (`python -m d9d.flows.cli`, the `d9d`
    script, Prefect's `prefect.engine`), in case a task was defined there: for the CLI that is Prefect and the whole
    of d9d-flows, 3-5 s of a core per pool, and a stage starts up to two pools. The tasks here are d9d functions and
    never need it. Only worker start-up sees the swap: the pool starts its workers in `submit`, in this thread.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _item_key(item: WorkItem, tokenizer: TokenizerInfo, checksums: dict[str, str]) -> str:
    return digest_json(
        {
            "tokenizer": tokenizer.sha256,
            "dtype": item.dtype,
            "format": FORMAT_VERSION,
            "validation": sorted(item.validation),
            "ranges": [
                {
                    "file": r.file.name,
                    "sha256": checksums[r.file.name],
                    "first": r.first_document,
                    "count": r.count,
                    "bytes": [r.byte_start, r.byte_end],
                    "row_group": r.row_group,
                }
                for r in item.ranges
            ],
        }
    )


def _piece_name(item: WorkItem) -> str:
    return f"item-{item.number:05d}"


def _tokenize(
    pending: list[WorkItem],
    *,
    workers: int,
    partial: PartialStage,
    keys: dict[int, str],
    results: dict[int, ItemResult],
    progress: Progress,
) -> None:
    executor = ProcessPoolExecutor(
        max_workers=min(workers, len(pending)), mp_context=_worker_context(), initializer=initialize_worker
    )
    finished = 0

    def record(item: WorkItem, result: ItemResult) -> None:
        # Shard names relative to the stage directory, as a reused piece's record has them.
        recorded = _result_to_json(result, item, partial)
        results[item.number] = _result_from_json(recorded)
        files = [shard["file"] for shard in (recorded["train"], recorded["validation"]) if shard is not None]
        partial.record(_piece_name(item), keys[item.number], files, recorded)
        progress.advance(item.text_bytes, f"{sum(r.tokens for r in results.values()):,} tokens")

    futures: dict[Future[ItemResult], WorkItem] = {}
    try:
        with _workers_skip_the_main_module():  # the workers start here
            futures = {executor.submit(tokenize_item, item): item for item in pending}
        waiting = set(futures)
        while waiting:
            done, waiting = wait(waiting, return_when=FIRST_COMPLETED)
            for future in done:
                item = futures[future]
                try:
                    result = future.result()
                except BrokenProcessPool as error:
                    raise RuntimeError(
                        f"a tokenizer worker died while tokenizing unit {item.number} (out of memory or killed?); "
                        "run again to continue from the finished units"
                    ) from error
                record(item, result)
                finished += 1
                check_fault("data_prep.items", finished)
    except BaseException:
        # Units already running finish while the pool shuts down; keep them, so the next attempt has less to do.
        executor.shutdown(wait=True, cancel_futures=True)
        for future, item in futures.items():
            if item.number not in results and future.done() and not future.cancelled() and not future.exception():
                record(item, future.result())
        raise
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _shard(result: ItemResult, split: str) -> ShardInfo | None:
    return result.train if split == "train" else result.validation


def _result_to_json(result: ItemResult, item: WorkItem, partial: PartialStage) -> dict[str, Any]:
    def shard(info: ShardInfo | None, path: Path) -> dict[str, Any] | None:
        return None if info is None else {**info.to_json(), "file": str(path.relative_to(partial.root))}

    return {
        **{k: v for k, v in asdict(result).items() if k not in ("train", "validation")},
        "train": shard(result.train, item.train_path),
        "validation": shard(result.validation, item.validation_path),
    }


def _result_from_json(data: dict[str, Any]) -> ItemResult:
    def shard(raw: dict[str, Any] | None) -> ShardInfo | None:
        return None if raw is None else ShardInfo(**raw)

    return ItemResult(**{**data, "train": shard(data["train"]), "validation": shard(data["validation"])})
