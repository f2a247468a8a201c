"""Where a stage's output lives, how it becomes complete, and how an interrupted stage resumes.

A stage owns one target directory. While it runs it writes into a *partial* directory next to it
(`.<name>.partial`, same file system, so the final rename is atomic); finished pieces of work inside it carry a
small record (`.pieces/<piece>.json`) with the key they were made for, so a later attempt reuses them instead of
redoing them. When everything is written the stage commits: files it did not list are pruned, the manifest goes
in, and the partial directory is renamed onto the target. The target therefore either holds a complete output
with its manifest or does not exist; a directory without a valid manifest, or whose listed files are missing or
of the wrong size, is never taken as complete.

A stage replaces only what it wrote itself. Before it starts work (`open_partial`) and again when it commits, the
target must be absent, empty, or this stage's own output (its manifest, and nothing at the top level that the
manifest does not list); the partial directory must carry the stage's `.pieces` record. Anything else (a user's
`data/` folder under `--set workdir=/shared`, another stage's output) is refused with `StageOutputConflict` naming
the path. A *complete* output made for another key (a one-off `--set pretrain.steps=30` next to a finished run) is
refused too, naming what replacing it would delete: a stage never destroys finished work because its key changed.
`replace=True` (the job's `replace_outputs`) is the explicit option that lets it replace either.
"""

from __future__ import annotations

import enum
import fcntl
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from d9d.flows.jobs.contract.fingerprint import FileFingerprint
from d9d.flows.jobs.contract.manifest import MANIFEST_FILENAME, ManifestError, StageKey, StageManifest

PIECES_DIRNAME = ".pieces"


class StageBusyError(RuntimeError):
    """Another process is writing the same stage output."""


class StageOutputConflict(RuntimeError):
    """The stage would replace a path it did not write, or a complete output made for another key (names both)."""


REPLACE_HINT = (
    "point the stage elsewhere (--set workdir=DIR, or the stage section's output=DIR), or pass "
    "--set replace_outputs=true to replace it"
)
_LISTED = 5  # paths named in a refusal


class Status(enum.Enum):
    COMPLETE = "complete"
    MISSING = "missing"
    INCOMPLETE = "incomplete"
    STALE = "stale"


@dataclass(frozen=True, kw_only=True)
class Completeness:
    status: Status
    reason: str
    manifest: StageManifest | None = None

    @property
    def complete(self) -> bool:
        return self.status is Status.COMPLETE


@dataclass(frozen=True, kw_only=True)
class Piece:
    """A finished piece of a stage's work inside the partial directory."""

    name: str
    key: str
    files: tuple[FileFingerprint, ...]
    data: dict[str, Any]


class PartialStage:
    """The partial directory of a stage in progress, with the records of the pieces finished so far."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._pieces = root / PIECES_DIRNAME
        self._pieces.mkdir(parents=True, exist_ok=True)

    def find(self, name: str, key: str) -> Piece | None:
        """The piece `name` if it was finished for `key` and its files are still there with their sizes."""
        path = self._pieces / f"{name}.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            piece = Piece(
                name=name,
                key=str(raw["key"]),
                files=tuple(FileFingerprint.from_json(entry) for entry in raw["files"]),
                data=dict(raw["data"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if piece.key != key:
            return None
        for file in piece.files:
            path = self.root / file.name
            if not path.is_file() or path.stat().st_size != file.size:
                return None
        return piece

    def record(self, name: str, key: str, files: Sequence[str], data: dict[str, Any]) -> Piece:
        """Record piece `name` as finished for `key`; `files` are relative to the partial directory."""
        piece = Piece(
            name=name,
            key=key,
            files=tuple(FileFingerprint.of(self.root / file, name=file) for file in files),
            data=data,
        )
        staging = self._pieces / f".{name}.json.tmp"
        staging.write_text(
            json.dumps({"key": key, "files": [file.to_json() for file in piece.files], "data": data}),
            encoding="utf-8",
        )
        staging.replace(self._pieces / f"{name}.json")
        return piece


class StageDirectory:
    """The output directory `target` of one stage, and its partial sibling."""

    def __init__(self, target: Path, *, replace: bool = False) -> None:
        self.target = target
        self.replace = replace  # the explicit option: replace a foreign or stale path instead of refusing
        self.partial = target.parent / f".{target.name}.partial"
        self._replaced = target.parent / f".{target.name}.replaced"
        self._lock_path = target.parent / f".{target.name}.lock"

    def check(self, key: StageKey) -> Completeness:
        """Is the target a complete output for `key`? Missing, partial or foreign directories never are."""
        if not self.target.exists():
            return Completeness(status=Status.MISSING, reason=f"{self.target} does not exist")
        try:
            manifest = StageManifest.read(self.target)
        except ManifestError as error:
            return Completeness(status=Status.INCOMPLETE, reason=f"no valid manifest: {error}")
        for output in manifest.outputs:
            path = self.target / output.name
            if not path.is_file():
                return Completeness(status=Status.INCOMPLETE, reason=f"{path} is missing", manifest=manifest)
            if path.stat().st_size != output.size:
                return Completeness(
                    status=Status.INCOMPLETE,
                    reason=f"{path} has {path.stat().st_size} bytes, the manifest records {output.size}",
                    manifest=manifest,
                )
        if manifest.stage != key.stage or manifest.key != key.digest:
            return Completeness(status=Status.STALE, reason=_describe_change(manifest, key), manifest=manifest)
        return Completeness(status=Status.COMPLETE, reason="manifest matches config and inputs", manifest=manifest)

    def verify_checksums(self) -> list[str]:
        """Names of outputs whose sha256 differs from the manifest (a slow, full check; `check` compares sizes)."""
        manifest = StageManifest.read(self.target)
        return [
            output.name
            for output in manifest.outputs
            if FileFingerprint.of(self.target / output.name, name=output.name).sha256 != output.sha256
        ]

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold an exclusive lock on this stage's output while writing it (fails at once if another run does)."""
        self.target.parent.mkdir(parents=True, exist_ok=True)
        with self._lock_path.open("a+") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as error:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                raise StageBusyError(f"{self.target} is being written by {holder}; wait for it to finish") from error
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()}\n")
            handle.flush()
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def open_partial(self, key: StageKey | None = None) -> PartialStage:
        """The partial directory, kept from an earlier attempt if there is one (its pieces carry their own keys).

        Refuses (`StageOutputConflict`) before any work when the commit would replace what this stage did not
        write, or a complete output for another key; `key` names what changed in that message.
        """
        self.claim(key)
        return PartialStage(self.partial)

    def claim(self, key: StageKey | None = None) -> None:
        """Raise `StageOutputConflict` unless every path this stage will replace is its own (or `replace` is set)."""
        if self.replace:
            return
        problem = self._foreign_sibling() or self._target_conflict(key, stale=True)
        if problem is not None:
            raise StageOutputConflict(f"{problem}; {REPLACE_HINT}")

    def refuse_foreign(self) -> None:
        """`claim` without a key, before planning: refuse only paths that are no d9d stage's output (a preflight:
        whether a complete output is up to date or stale is decided once the stage knows its key)."""
        if self.replace:
            return
        problem = self._foreign_sibling() or self._target_conflict(None, stale=False)
        if problem is not None:
            raise StageOutputConflict(f"{problem}; {REPLACE_HINT}")

    def _foreign_sibling(self) -> str | None:
        if self.partial.exists() and not (self.partial / PIECES_DIRNAME).is_dir():
            return f"{self.partial} exists but is not a d9d partial directory (it has no {PIECES_DIRNAME} record)"
        if self._replaced.exists() and not _has_manifest(self._replaced):
            return f"{self._replaced} exists but is not a d9d stage output (it has no manifest)"
        return None

    def _target_conflict(self, key: StageKey | None, *, stale: bool) -> str | None:
        target = self.target
        if not target.exists() and not target.is_symlink():
            return None
        if target.is_symlink() or not target.is_dir():
            return f"{target} exists and is not a directory: it is not a stage output, refusing to replace it"
        entries = sorted(target.iterdir())
        if not entries:
            return None
        try:
            manifest = StageManifest.read(target)
        except ManifestError as error:
            if (target / MANIFEST_FILENAME).exists():
                return f"{target} has a manifest d9d cannot trust ({error}), refusing to replace it"
            return (
                f"{target} exists and is not a d9d stage output (no valid manifest; it holds "
                f"{_list(entry.name + ('/' if entry.is_dir() else '') for entry in entries)}): refusing to replace it"
            )
        return _manifest_conflict(target, entries, manifest, key, stale=stale)

    def commit(
        self,
        partial: PartialStage,
        key: StageKey,
        *,
        outputs: Sequence[str],
        packages: dict[str, str],
        statistics: dict[str, Any],
        created_at: str,
    ) -> StageManifest:
        """Prune everything but `outputs`, write the manifest, and rename the partial directory onto the target."""
        self.claim(key)  # again: the target may have changed while the stage ran
        keep = {Path(name) for name in outputs}
        for name in outputs:
            if not (partial.root / name).is_file():
                raise FileNotFoundError(f"stage output {name} was not written to {partial.root}")
        _prune(partial.root, keep)
        manifest = StageManifest.for_key(
            key,
            outputs=tuple(FileFingerprint.of(partial.root / name, name=name) for name in sorted(outputs)),
            packages=packages,
            statistics=statistics,
            created_at=created_at,
        )
        manifest.write(partial.root)
        if self._replaced.exists():
            shutil.rmtree(self._replaced)
        if self.target.exists():
            # Two renames, not one: rename() cannot replace a non-empty directory. A crash between them leaves
            # no target, which the next run sees as missing and redoes; it never sees a mixed directory.
            self.target.rename(self._replaced)
        partial.root.rename(self.target)
        _fsync_directory(self.target.parent)
        if self._replaced.exists():
            shutil.rmtree(self._replaced)
        return manifest

    def discard(self) -> None:
        """Delete the target and any partial work (used to force a stage to run again)."""
        for path in (self.target, self.partial, self._replaced):
            if path.exists():
                shutil.rmtree(path)


def _manifest_conflict(
    target: Path, entries: list[Path], manifest: StageManifest, key: StageKey | None, *, stale: bool
) -> str | None:
    """Why `target`, a stage output, may not be replaced by `key`'s stage: another stage's, holding files its
    manifest does not list, or (`stale`) complete for another key; None when it may."""
    stage = key.stage if key is not None else manifest.stage
    if manifest.stage != stage:
        return f"{target} is the output of stage {manifest.stage!r}, not {stage!r}: refusing to replace it"
    own = {MANIFEST_FILENAME, f".{MANIFEST_FILENAME}.tmp"} | {Path(o.name).parts[0] for o in manifest.outputs}
    foreign = [entry for entry in entries if entry.name not in own]
    if foreign:
        return (
            f"{target} holds {_list(str(entry) for entry in foreign)}, which its {stage} manifest does not list: "
            "refusing to replace what this stage did not write"
        )
    if stale and _outputs_present(target, manifest) and (key is None or manifest.key != key.digest):
        change = _describe_change(manifest, key) if key is not None else "its key differs"
        size = sum(output.size for output in manifest.outputs)
        return (
            f"{target} holds a complete {stage} output (made {manifest.created_at or 'earlier'}) for another key "
            f"({change}); replacing it would delete its {len(manifest.outputs)} files, {size / 2**20:.1f} MiB "
            f"({_list(_top_level(manifest))})"
        )
    return None


def _has_manifest(directory: Path) -> bool:
    try:
        StageManifest.read(directory)
    except ManifestError:
        return False
    return True


def _outputs_present(target: Path, manifest: StageManifest) -> bool:
    for output in manifest.outputs:
        path = target / output.name
        if not path.is_file() or path.stat().st_size != output.size:
            return False
    return True


def _top_level(manifest: StageManifest) -> list[str]:
    names: dict[str, None] = {}
    for output in manifest.outputs:
        parts = Path(output.name).parts
        names[parts[0] + ("/" if len(parts) > 1 else "")] = None
    return list(names)


def _list(names: Iterable[str]) -> str:
    shown = list(names)
    more = f" and {len(shown) - _LISTED} more" if len(shown) > _LISTED else ""
    return ", ".join(shown[:_LISTED]) + more


def _prune(root: Path, keep: set[Path]) -> None:
    keep_dirs = {parent for path in keep for parent in path.parents}
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        relative = path.relative_to(root)
        if path.is_dir() and not path.is_symlink():
            if relative not in keep_dirs:
                shutil.rmtree(path)
        elif relative not in keep:
            path.unlink()


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _describe_change(manifest: StageManifest, key: StageKey) -> str:
    if manifest.stage != key.stage:
        return f"it was written by stage {manifest.stage!r}, not {key.stage!r}"
    changes = []
    if manifest.stage_version != key.stage_version:
        changes.append(f"stage version {manifest.stage_version} -> {key.stage_version}")
    if manifest.config_hash != key.config_hash:
        changed = sorted(
            name for name in set(manifest.config) | set(key.config) if manifest.config.get(name) != key.config.get(name)
        )
        changes.append(f"config changed ({', '.join(changed) or 'values'})")
    if manifest.inputs_hash != key.inputs_hash:
        before = {entry.name: entry.sha256 for entry in manifest.inputs}
        after = {entry.name: entry.sha256 for entry in key.inputs}
        changed = sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        changes.append(f"inputs changed ({shown or 'order'})")
    return "; ".join(changes) or "its key differs"
