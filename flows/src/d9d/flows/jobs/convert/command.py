"""`d9d convert --list` and `d9d convert --mapping NAME SRC DST`: one named conversion, run in this process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from d9d.models.conversions import describe_mappings, named_mapping
from d9d.states import DEFAULT_SHARD_BYTES, StatesError, convert_checkpoint


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
    convert.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
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
        report = convert_checkpoint(
            args.source,
            args.destination,
            mapping.factory,
            max_shard_bytes=DEFAULT_SHARD_BYTES,
            overwrite=args.overwrite,
        )
        mapping.convert_config(args.source, args.destination, None)
    except (KeyError, StatesError, FileNotFoundError, FileExistsError) as error:
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
            "parameters` as JSON, with \"kind\") and convert again, or rerun the stage that wrote it\n"
        )
    return 0
