"""`d9d-states convert --mapping MODULE:FACTORY SRC DST` and `d9d-states inspect PATH`.

Under `torchrun`, `convert` splits the work across the ranks (each writes its share; rank 0 publishes the index).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from d9d.states.cli.convert_command import ConvertCommand, run_convert
from d9d.states.cli.inspect_command import run_inspect
from d9d.states.errors import StatesError
from d9d.states.io.shards import DEFAULT_SHARD_BYTES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d9d-states", description="Streaming conversion of safetensors checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="map a checkpoint into a new one, group by group")
    convert.add_argument("--mapping", required=True, help="MODULE:FACTORY, a mapper or a factory(source_metas)")
    convert.add_argument("--shard-size", default=str(DEFAULT_SHARD_BYTES), help="largest shard, e.g. 5GB (default)")
    convert.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    convert.add_argument("--allow-unused", action="store_true", help="ignore source tensors the mapping skips")
    convert.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="default: on a TTY")
    convert.add_argument("source", type=Path)
    convert.add_argument("destination", type=Path)
    inspect = commands.add_parser("inspect", help="list tensors and check a checkpoint's consistency")
    inspect.add_argument("path", type=Path)
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    try:
        if arguments.command == "inspect":
            return run_inspect(arguments.path, as_json=arguments.json)
        command = ConvertCommand(
            source=arguments.source,
            destination=arguments.destination,
            mapping=arguments.mapping,
            max_shard_bytes=arguments.shard_size,
            overwrite=arguments.overwrite,
            allow_unused=arguments.allow_unused,
            progress=arguments.progress,
        )
        return run_convert(command)
    except (StatesError, ValueError, ImportError, AttributeError) as error:
        sys.stderr.write(f"d9d-states: error: {error}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
