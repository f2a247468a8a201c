"""The stage contract: a manifest, not an orchestrator's cache, decides whether a stage's output is complete."""

import json
import os
import threading

import pytest

from d9d.flows.jobs.contract import (
    FileFingerprint,
    StageBusyError,
    StageDirectory,
    StageKey,
    StageManifest,
    StageOutputConflict,
    Status,
)
from d9d.flows.jobs.contract.manifest import ManifestError


def _key(config=None, inputs=None):
    return StageKey(
        stage="demo",
        stage_version=1,
        config=config or {"size": 1},
        inputs=inputs or (FileFingerprint(name="in.txt", size=3, sha256="a" * 64),),
    )


def _complete(tmp_path, key=None, files=None):
    directory = StageDirectory(tmp_path / "out")
    partial = directory.open_partial()
    files = files or {"a.bin": b"alpha", "sub/b.bin": b"beta"}
    for name, data in files.items():
        (partial.root / name).parent.mkdir(parents=True, exist_ok=True)
        (partial.root / name).write_bytes(data)
    directory.commit(
        partial, key or _key(), outputs=list(files), packages={"x": "1"}, statistics={"n": 2}, created_at="now"
    )
    return directory


def test_missing_output_is_not_complete(tmp_path):
    assert StageDirectory(tmp_path / "out").check(_key()).status is Status.MISSING


def test_committed_output_is_complete_and_the_partial_directory_is_gone(tmp_path):
    directory = _complete(tmp_path)
    completeness = directory.check(_key())
    assert completeness.complete, completeness.reason
    assert not directory.partial.exists()
    manifest = StageManifest.read(directory.target)
    assert [output.name for output in manifest.outputs] == ["a.bin", "sub/b.bin"]
    assert manifest.statistics == {"n": 2}
    assert manifest.packages == {"x": "1"}
    assert directory.verify_checksums() == []


def test_directory_without_manifest_is_incomplete(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.bin").write_bytes(b"alpha")
    completeness = StageDirectory(tmp_path / "out").check(_key())
    assert completeness.status is Status.INCOMPLETE
    assert "manifest" in completeness.reason


def test_deleted_or_truncated_output_file_makes_it_incomplete(tmp_path):
    directory = _complete(tmp_path)
    (directory.target / "sub" / "b.bin").write_bytes(b"bet")
    completeness = directory.check(_key())
    assert completeness.status is Status.INCOMPLETE
    assert "b.bin has 3 bytes, the manifest records 4" in completeness.reason
    (directory.target / "a.bin").unlink()
    assert "a.bin is missing" in directory.check(_key()).reason


def test_same_size_damage_is_found_by_the_checksum_check(tmp_path):
    directory = _complete(tmp_path)
    (directory.target / "a.bin").write_bytes(b"ALPHA")
    assert directory.check(_key()).complete  # sizes match: the fast check cannot tell
    assert directory.verify_checksums() == ["a.bin"]


def test_changed_config_or_inputs_make_it_stale_and_say_what_changed(tmp_path):
    directory = _complete(tmp_path)
    stale = directory.check(_key(config={"size": 2}))
    assert stale.status is Status.STALE
    assert "config changed (size)" in stale.reason
    changed_input = (FileFingerprint(name="in.txt", size=3, sha256="b" * 64),)
    assert "inputs changed (in.txt)" in directory.check(_key(inputs=changed_input)).reason


def test_commit_prunes_unlisted_files_and_replaces_the_old_output(tmp_path):
    directory = StageDirectory(_complete(tmp_path).target, replace=True)
    partial = directory.open_partial()
    (partial.root / "keep.bin").write_bytes(b"new")
    (partial.root / "scratch").mkdir()
    (partial.root / "scratch" / "tmp.bin").write_bytes(b"junk")
    key = _key(config={"size": 2})
    directory.commit(partial, key, outputs=["keep.bin"], packages={}, statistics={}, created_at="now")
    assert sorted(p.name for p in directory.target.rglob("*")) == ["keep.bin", "manifest.json"]
    assert directory.check(key).complete
    assert not any(p.name.endswith(".replaced") for p in tmp_path.iterdir())


def test_commit_refuses_a_listed_output_that_was_not_written(tmp_path):
    directory = StageDirectory(tmp_path / "out")
    partial = directory.open_partial()
    with pytest.raises(FileNotFoundError, match=r"missing\.bin was not written"):
        directory.commit(partial, _key(), outputs=["missing.bin"], packages={}, statistics={}, created_at="")
    assert not directory.target.exists()


def test_pieces_are_reused_only_for_their_key_and_while_their_files_are_intact(tmp_path):
    directory = StageDirectory(tmp_path / "out")
    partial = directory.open_partial()
    (partial.root / "part.bin").write_bytes(b"12345")
    partial.record("unit-0", "key-1", ["part.bin"], {"tokens": 5})
    again = directory.open_partial()  # a later attempt
    piece = again.find("unit-0", "key-1")
    assert piece is not None
    assert piece.data == {"tokens": 5}
    assert again.find("unit-0", "key-2") is None
    (partial.root / "part.bin").write_bytes(b"123")
    assert again.find("unit-0", "key-1") is None
    assert again.find("unit-9", "key-1") is None


def test_piece_record_is_json_with_sizes_and_checksums(tmp_path):
    partial = StageDirectory(tmp_path / "out").open_partial()
    (partial.root / "p.bin").write_bytes(b"x")
    partial.record("p", "k", ["p.bin"], {})
    raw = json.loads((partial.root / ".pieces" / "p.json").read_text())
    assert raw["files"][0]["size"] == 1
    assert len(raw["files"][0]["sha256"]) == 64


def test_a_second_writer_of_the_same_stage_is_refused(tmp_path):
    directory = StageDirectory(tmp_path / "out")
    with directory.lock():
        read_end, write_end = os.pipe()
        pid = os.fork() if threading.active_count() == 1 else None
        if pid == 0:  # another process trying to write the same stage
            try:
                with StageDirectory(tmp_path / "out").lock():
                    os.write(write_end, b"acquired")
            except StageBusyError as error:
                os.write(write_end, str(error).encode())
            os._exit(0)
        if pid is None:
            pytest.skip("cannot fork with other threads running")
        os.waitpid(pid, 0)
        message = os.read(read_end, 1000).decode()
    assert "is being written by pid" in message
    with directory.lock():  # released
        pass


# A stage replaces only what it wrote itself ---------------------------------------------------------------------------


def _commit_new(directory, key=None):
    partial = directory.open_partial(key or _key())
    (partial.root / "a.bin").write_bytes(b"new")
    return directory.commit(partial, key or _key(), outputs=["a.bin"], packages={}, statistics={}, created_at="")


def test_a_foreign_directory_is_refused_naming_it_and_kept_intact(tmp_path):
    """`--set workdir=/shared` where /shared/data is someone's folder: the data-prep stage must not replace it."""
    foreign = tmp_path / "data"
    (foreign / "theirs").mkdir(parents=True)
    (foreign / "theirs" / "results.csv").write_text("1,2\n")
    directory = StageDirectory(foreign)
    with pytest.raises(StageOutputConflict, match=r"data exists and is not a d9d stage output .*theirs/") as refused:
        _commit_new(directory)
    assert "replace_outputs=true" in str(refused.value)
    with pytest.raises(StageOutputConflict):
        directory.refuse_foreign()  # the CLI's preflight says the same before anything starts
    assert (foreign / "theirs" / "results.csv").read_text() == "1,2\n"
    assert not directory.partial.exists()
    _commit_new(StageDirectory(foreign, replace=True))  # the explicit option
    assert not (foreign / "theirs").exists() and (foreign / "a.bin").read_bytes() == b"new"


def test_a_file_or_an_unlisted_entry_in_the_target_is_refused(tmp_path):
    (tmp_path / "out").write_text("a file")
    with pytest.raises(StageOutputConflict, match=r"out exists and is not a directory"):
        _commit_new(StageDirectory(tmp_path / "out"))
    (tmp_path / "out").unlink()
    directory = _complete(tmp_path)
    (directory.target / "notes.txt").write_text("mine")
    (directory.target / "a.bin").write_bytes(b"damaged")  # incomplete, so replaceable but for notes.txt
    with pytest.raises(StageOutputConflict, match=r"holds .*notes.txt, which its demo manifest does not list"):
        _commit_new(directory)
    assert (directory.target / "notes.txt").read_text() == "mine"


def test_another_stages_output_is_refused(tmp_path):
    directory = _complete(tmp_path)
    other = StageKey(stage="other", stage_version=1, config={}, inputs=())
    with pytest.raises(StageOutputConflict, match=r"is the output of stage 'demo', not 'other'"):
        directory.open_partial(other)


def test_a_complete_output_for_another_key_is_refused_naming_what_would_be_lost(tmp_path):
    directory = _complete(tmp_path)
    with pytest.raises(StageOutputConflict) as refused:
        _commit_new(directory, _key(config={"size": 2}))
    message = str(refused.value)
    assert "holds a complete demo output (made now) for another key (config changed (size))" in message
    assert "would delete its 2 files" in message and "a.bin, sub/" in message
    assert directory.check(_key()).complete  # untouched
    directory.refuse_foreign()  # a d9d output: not foreign, whatever its key
    _commit_new(StageDirectory(directory.target, replace=True), _key(config={"size": 2}))
    assert directory.check(_key(config={"size": 2})).complete


def test_an_incomplete_output_for_the_same_or_another_key_is_redone(tmp_path):
    directory = _complete(tmp_path)
    (directory.target / "sub" / "b.bin").unlink()  # damaged: what the stage wrote, not a finished output
    _commit_new(directory, _key(config={"size": 3}))
    assert directory.check(_key(config={"size": 3})).complete
    _commit_new(directory, _key(config={"size": 3}))  # complete for the same key: its own, rewritten on request


def test_a_foreign_partial_directory_is_refused(tmp_path):
    directory = StageDirectory(tmp_path / "out")
    directory.partial.mkdir()
    (directory.partial / "keep.txt").write_text("not d9d's")
    with pytest.raises(StageOutputConflict, match=r"\.out\.partial exists but is not a d9d partial directory"):
        directory.open_partial(_key())
    assert (directory.partial / "keep.txt").read_text() == "not d9d's"


def test_a_damaged_manifest_that_still_parses_is_never_taken_for_a_complete_output(tmp_path):
    """Every digit of the manifest changed in turn (recorded sizes, checksums, the key, statistics): each damaged
    manifest is refused by its own checksum, naming the file, and the output is kept for the user to inspect."""
    directory = _complete(tmp_path)
    path = directory.target / "manifest.json"
    intact = path.read_text(encoding="utf-8")
    digits = [index for index, char in enumerate(intact) if char.isdigit()]
    assert len(digits) > 100
    for index in digits:
        damaged = intact[:index] + str((int(intact[index]) + 1) % 10) + intact[index + 1 :]
        path.write_text(damaged, encoding="utf-8")
        with pytest.raises(ManifestError, match=r"manifest.json is damaged"):
            StageManifest.read(directory.target)
        completeness = directory.check(_key())
        assert completeness.status is Status.INCOMPLETE, (index, completeness.reason)
    with pytest.raises(StageOutputConflict, match=r"has a manifest d9d cannot trust .*damaged") as refused:
        _commit_new(directory)
    assert "replace_outputs=true" in str(refused.value)
    assert (directory.target / "a.bin").read_bytes() == b"alpha"
    path.write_text(intact, encoding="utf-8")
    assert directory.check(_key()).complete


def test_a_manifest_written_before_the_checksum_existed_is_still_read(tmp_path):
    directory = _complete(tmp_path)
    path = directory.target / "manifest.json"
    raw = json.loads(path.read_text(encoding="utf-8"))
    del raw["manifest_sha256"]
    path.write_text(json.dumps(raw, indent=2), encoding="utf-8")
    assert directory.check(_key()).complete
