"""The `finetune_data` section: the fine-tune corpus, tokenized with the pretrain data's own tokenizer.

The finetune-data stage is the data-prep stage's code with a `FileTokenizer` on `<data-prep output>/tokenizer.json`,
so the two shard sets share one vocabulary (a model trained on one reads the other) and a retrained tokenizer
retokenizes the fine-tune corpus too (the tokenizer file is an input of the stage's key).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from d9d.flows.jobs.data_prep.config import AnyCorpus, AnyTokenizer, DataPrepConfig, EmbeddedCorpus, FileTokenizer
from d9d.flows.jobs.data_prep.corpus import check_readable, corpus_files, text_field_of
from d9d.flows.jobs.data_prep.prepare import TOKENIZER_FILE, DataPrepPlan, plan_data_prep
from d9d.flows.jobs.data_prep.stage import check, run_stage, skipped
from d9d.flows.jobs.stage_spec import StageSpec

if TYPE_CHECKING:
    from d9d.flows.jobs.config import JobConfig


class FinetuneDataConfig(BaseModel):
    """Which text to fine-tune on and how to split it; the tokenizer is always the pretrain data's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    corpus: AnyCorpus = Field(default_factory=lambda: EmbeddedCorpus(name="milton"))
    validation_fraction: float = Field(default=0.15, gt=0.0, lt=1.0, description="whole documents, seeded")
    # With the 7 embedded Milton works (one document each), seed 7 holds out The Poetical Works: 4% of its lines
    # also appear in another file, where Comus, in two files, would be 58% memorised text.
    seed: int = Field(default=7, description="chooses which documents form the validation split")
    chunk_bytes: int = Field(default=1 << 19, ge=1024)
    workers: int = Field(default=2, ge=1)
    output: Path | None = Field(default=None, description="default: <workdir>/finetune-data")
    retries: int = Field(default=1, ge=0)
    retry_delay_seconds: float = Field(default=2.0, ge=0.0)

    def data_prep_config(self, pretrain_data: Path, pretrain_tokenizer: AnyTokenizer, output: Path) -> DataPrepConfig:
        """The data-prep config that tokenizes this corpus with the tokenizer in `pretrain_data` into `output`."""
        return DataPrepConfig(
            corpus=self.corpus,
            tokenizer=FileTokenizer(path=pretrain_data / TOKENIZER_FILE, eos_token=pretrain_tokenizer.eos_token),
            output=output,
            validation_fraction=self.validation_fraction,
            seed=self.seed,
            chunk_bytes=self.chunk_bytes,
            workers=self.workers,
            retries=self.retries,
            retry_delay_seconds=self.retry_delay_seconds,
            # The tokenizer follows the data-prep stage's; when that one changes, this shard set must follow.
            allow_tokenizer_change=True,
        )


def preflight(config: JobConfig) -> None:
    """The fine-tune corpus' files are readable (its tokenizer is the data-prep stage's, made before it runs)."""
    section = config.finetune_data
    for file in corpus_files(section.corpus, field="finetune_data.corpus"):
        check_readable(file, text_field=text_field_of(section.corpus))


SPEC: StageSpec[DataPrepPlan] = StageSpec(
    name="finetune-data",
    section="finetune_data",
    summary="the fine-tune corpus to train/validation token shards with the pretrain data's tokenizer",
    reads=lambda config: {"data-prep": config.data_prep_output},
    output=lambda config: config.finetune_data_output,
    preflight=preflight,
    plan=lambda config, progress: plan_data_prep(config.finetune_data_prep, config.finetune_data_output),
    check=check,
    run=run_stage,
    skipped=skipped,
)
