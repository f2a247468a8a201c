"""A logger whose lines say which rank, at which mesh coordinate, wrote them."""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

_ABBREVIATIONS = {"pp": "pp", "dp_replicate": "dpr", "dp_shard": "dps", "cp": "cp", "tp": "tp"}


class RankLoggerAdapter(logging.LoggerAdapter[logging.Logger]):
    """Prefixes every message with the rank and its regular-mesh coordinate, e.g. `[r5 pp1 dpr0 dps0 cp1 tp1]`."""

    def __init__(self, logger: logging.Logger, prefix: str) -> None:
        super().__init__(logger, {"rank_prefix": prefix})
        self.prefix = prefix

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{self.prefix} {msg}", kwargs


def rank_prefix(rank: int, coordinate: Mapping[str, int]) -> str:
    parts = [f"r{rank}"] + [f"{_ABBREVIATIONS.get(name, name)}{index}" for name, index in coordinate.items()]
    return "[" + " ".join(parts) + "]"


def build_rank_logger(rank: int, coordinate: Mapping[str, int], name: str = "d9d") -> RankLoggerAdapter:
    return RankLoggerAdapter(logging.getLogger(name), rank_prefix(rank, coordinate))
