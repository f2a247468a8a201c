"""The stage's tokenizer: a byte-level BPE trained here, or a `tokenizer.json` loaded as it is."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, assert_never

from d9d.flows.jobs.contract import digest_json
from d9d.flows.jobs.data_prep.config import AnyTokenizer, FileTokenizer, TrainBpeTokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class TokenizerError(ValueError):
    """A tokenizer file is missing or unusable, or does not match an existing shard set (names both)."""


@dataclass(frozen=True, kw_only=True)
class TokenizerInfo:
    """What the shard sets record about their tokenizer."""

    sha256: str  # of the tokenizer's canonical JSON: equal tokenizers, equal digests
    spec: str  # digest of what the config asked for; an existing shard set with another spec is a mismatch
    vocab_size: int
    eos_token_id: int | None
    trained: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "sha256": self.sha256,
            "spec": self.spec,
            "vocab_size": self.vocab_size,
            "eos_token_id": self.eos_token_id,
            "trained": self.trained,
        }


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def load_tokenizer_file(path: Path, *, field: str = "data_prep.tokenizer.path") -> Tokenizer:
    from tokenizers import Tokenizer

    if not path.is_file():
        raise TokenizerError(f"{field} = {path}: no such file; give the path of a tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for an unparsable file
        raise TokenizerError(f"{field} = {path}: not a tokenizer.json that `tokenizers` can load ({error})") from error


def tokenizer_spec(config: AnyTokenizer) -> str:
    """What identifies the requested tokenizer before it exists: its training settings, or the file's contents."""
    match config:
        case TrainBpeTokenizer():
            return digest_json(config.model_dump(mode="json"))
        case FileTokenizer():
            return tokenizer_sha256(load_tokenizer_file(config.path))
        case _:
            assert_never(config)


def train_bpe(texts: Iterable[str], config: TrainBpeTokenizer) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style: every byte is a token, so any text encodes without unknowns)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(config.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def describe(tokenizer: Tokenizer, config: AnyTokenizer, *, spec: str) -> TokenizerInfo:
    eos = config.eos_token
    eos_id = None
    if eos is not None:
        eos_id = tokenizer.token_to_id(eos)
        if eos_id is None:
            raise TokenizerError(
                f"data_prep.tokenizer.eos_token = {eos!r} is not a token of this tokenizer; use one of its special "
                "tokens or leave eos_token unset"
            )
    return TokenizerInfo(
        sha256=tokenizer_sha256(tokenizer),
        spec=spec,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        eos_token_id=eos_id,
        trained=isinstance(config, TrainBpeTokenizer),
    )
