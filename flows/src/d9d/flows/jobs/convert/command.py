"""`d9d convert --list` and `d9d convert --mapping NAME SRC DST`: one named conversion, run in this process.

Every conversion leaves a record of the files it wrote (`.d9d-convert.json` in DST). `--overwrite` replaces a
destination only when it holds nothing but what such a record lists (an earlier conversion's output) or is empty;
anything else in it is refused, named, and left alone. A destination that is the source, inside it, or holding it
is refused too (d9d-states' `convert_checkpoint` checks that for every caller).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from d9d.core.checkpoint import write_durable
from d9d.core.dist import on_first_rank
from d9d.models.conversions import describe_mappings, named_mapping
from d9d.states import DEFAULT_SHARD_BYTES, StatesError, convert_checkpoint
from d9d.states.convert import refuse_overlap

RECORD_FILE = ".d9d-convert.json"  # the files a conversion wrote into its destination (hidden: tools ignore it)
_LISTED = 5


class DestinationError(ValueError):
    """The destination holds files no earlier conversion wrote (names them)."""


def add_convert_command(commands: Any) -> None:
    """Register `convert` on the `d9d` command line's subparsers."""
    convert = commands.add_parser(
        "convert",
        help="convert a checkpoint with a named mapping (--list shows them)",
        description="Convert a safetensors checkpoint with a named mapping, streaming one tensor group at a time.",
        epilog=f"mappings:\n{describe_mappings()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    convert.add_argument("--list", action="store_true", help="list the named mappings and exit")
    convert.add_argument("--mapping", metavar="NAME", help="a name from --list")
    convert.add_argument(
        "--overwrite", action="store_true", help="replace DST if it holds only an earlier conversion's output"
    )
    convert.add_argument("source", nargs="?", type=Path, metavar="SRC")
    convert.add_argument("destination", nargs="?", type=Path, metavar="DST")


def run_convert_command(args: argparse.Namespace) -> int:
    """0 on success, 2 on bad input (unknown mapping, missing arguments, an unreadable or mismatched checkpoint)."""
    if args.list:
        sys.stdout.write(describe_mappings() + "\n")
        return 0
    if args.mapping is None or args.source is None or args.destination is None:
        sys.stderr.write("d9d: error: convert needs --mapping NAME SRC DST (or --list)\n")
        return 2
    try:
        mapping = named_mapping(args.mapping)
        refuse_overlap(args.source, args.destination)
        if args.overwrite:
            refuse_foreign_files(args.destination)
        report = convert_checkpoint(
            args.source,
            args.destination,
            mapping.factory,
            max_shard_bytes=DEFAULT_SHARD_BYTES,
            overwrite=args.overwrite,
        )
        on_first_rank(lambda: write_side_files(args.source, args.destination, args.mapping))
    except (KeyError, StatesError, DestinationError, FileNotFoundError, FileExistsError) as error:
        message = error.args[0] if isinstance(error, KeyError) else str(error)
        sys.stderr.write(f"d9d: error: {message}\n")
        return 2
    sys.stdout.write(
        f"wrote {args.destination} ({len(report.files)} files, {report.bytes_written / 2**20:.1f} MiB) with "
        f"{args.mapping} in {report.seconds:.1f} s\n"
    )
    if args.mapping.endswith("-to-hf") and not (args.destination / "config.json").is_file():
        # A d9d model directory written before it recorded its parameters (e.g. an older fine-tune's merged/).
        sys.stderr.write(
            f"d9d: note: {args.source} has no parameters.json, so {args.destination} has no config.json and "
            "transformers cannot load it yet; write the model's parameters there (the job's `pretrain.model."
            'parameters` as JSON, with "kind") and convert again, or rerun the stage that wrote it\n'
        )
    return 0


def write_side_files(source: Path, destination: Path, mapping_name: str) -> None:
    """The destination's config (`config.json` or `parameters.json`, when the source has one) and its record."""
    named_mapping(mapping_name).convert_config(source, destination, None)
    write_record(destination, mapping_name, source)


def refuse_foreign_files(destination: Path) -> None:
    """`DestinationError` unless `destination` is absent, empty, or holds only what an earlier conversion's record
    lists (the files `--overwrite` may replace)."""
    if not destination.exists() and not destination.is_symlink():
        return
    if destination.is_symlink() or not destination.is_dir():
        raise DestinationError(f"{destination} exists and is not a directory; choose another destination")
    entries = {path.name for path in destination.iterdir()}
    if not entries:
        return
    try:
        written = set(json.loads((destination / RECORD_FILE).read_text(encoding="utf-8"))["files"])
    except (OSError, ValueError, KeyError, TypeError):
        written = set()
    foreign = sorted(entries - {Path(name).parts[0] for name in written} - {RECORD_FILE})
    if foreign:
        more = f" and {len(foreign) - _LISTED} more" if len(foreign) > _LISTED else ""
        raise DestinationError(
            f"{destination} holds {', '.join(foreign[:_LISTED])}{more}, which no earlier `d9d convert` wrote; "
            "--overwrite replaces only an earlier conversion's output: move them or choose another destination"
        )


def write_record(destination: Path, mapping: str, source: Path) -> None:
    """Record the files this conversion wrote into `destination` (what a later `--overwrite` may replace)."""
    files = sorted(str(path.relative_to(destination)) for path in destination.rglob("*") if path.is_file())
    record = {"mapping": mapping, "source": str(source.resolve()), "files": [f for f in files if f != RECORD_FILE]}
    write_durable(destination / RECORD_FILE, (json.dumps(record, indent=2) + "\n").encode("utf-8"))
