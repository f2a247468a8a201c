"""`d9d-states convert`: arguments validated at the boundary, the mapping imported by path, every rank joining."""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from d9d.states.convert import MappingFactory, convert_checkpoint
from d9d.states.errors import StatesError
from d9d.states.io.shards import DEFAULT_SHARD_BYTES
from d9d.states.mapper.api import ModelStateMapper

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: object) -> object:
    """`5GB`, `500MiB`, `1048576`: a byte count (decimal and binary units, as transformers accepts)."""
    if not isinstance(text, str):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 5GB, 500MiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


class ConvertCommand(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Path
    destination: Path
    mapping: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$", description="MODULE:FACTORY")
    max_shard_bytes: Annotated[int, BeforeValidator(parse_size), Field(gt=0)] = DEFAULT_SHARD_BYTES
    overwrite: bool = False
    allow_unused: bool = False
    progress: bool | None = None


def load_mapping(reference: str) -> ModelStateMapper | MappingFactory:
    """Import `module:attribute`: a mapper, or a factory taking the source's tensor metadata."""
    module_name, _, attribute = reference.partition(":")
    target: object = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    if isinstance(target, ModelStateMapper) or callable(target):
        return target  # a callable is trusted to follow the factory contract
    raise StatesError(f"{reference} is a {type(target).__name__}, neither a mapper nor a factory of one")


def run_convert(command: ConvertCommand) -> int:
    context = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from d9d.core.dist import DistributedContext

        context = DistributedContext.build(device="cpu")
    try:
        report = convert_checkpoint(
            command.source,
            command.destination,
            load_mapping(command.mapping),
            max_shard_bytes=command.max_shard_bytes,
            overwrite=command.overwrite,
            allow_unused=command.allow_unused,
            progress=command.progress,
        )
    finally:
        if context is not None:
            context.close()
    if context is None or context.is_main_process:
        sys.stdout.write(
            f"wrote {command.destination} ({len(report.files)} files) in {report.seconds:.1f}s; largest group "
            f"{report.largest_group_bytes / 2**20:.1f} MiB\n"
        )
    return 0
