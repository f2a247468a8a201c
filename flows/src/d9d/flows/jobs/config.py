"""The job configuration: one pydantic model composing the configuration of every stage of the pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from d9d.flows.jobs.convert.config import ConvertConfig
from d9d.flows.jobs.data_prep.config import DataPrepConfig, EmbeddedCorpus, FilesCorpus, FileTokenizer
from d9d.flows.jobs.evaluate.config import EvaluateStageConfig
from d9d.flows.jobs.evaluate.stage import EvaluateInputs
from d9d.flows.jobs.evaluation_tasks import HeldOutSplit
from d9d.flows.jobs.finetune.config import FinetuneStageConfig
from d9d.flows.jobs.finetune.data import FinetuneDataConfig
from d9d.flows.jobs.finetune.stage import inputs_of as finetune_inputs
from d9d.flows.jobs.pretrain.config import PretrainStageConfig
from d9d.flows.jobs.pretrain.stage import tracker_config
from d9d.metrics.trackers import AnyTrackerConfig


class JobConfig(BaseModel):
    """A whole job: the working directory and one section per stage (data preparation, fine-tune data, checkpoint
    conversion, pretraining, fine-tuning, evaluation)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workdir: Path = Field(default=Path("runs/default"), description="stage outputs go under this directory")
    replace_outputs: bool = Field(
        default=False,
        description="let a stage replace an output path it did not write, or a complete output made with another "
        "config or other inputs (default: refuse, naming the path and what replacing it would delete)",
    )
    data_prep: DataPrepConfig = Field(default_factory=DataPrepConfig)
    finetune_data: FinetuneDataConfig = Field(default_factory=FinetuneDataConfig)
    convert: ConvertConfig = Field(default_factory=ConvertConfig)
    pretrain: PretrainStageConfig = Field(default_factory=PretrainStageConfig)
    finetune: FinetuneStageConfig = Field(default_factory=FinetuneStageConfig)
    evaluate: EvaluateStageConfig = Field(default_factory=EvaluateStageConfig)

    @field_validator("workdir", mode="before")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        """`--set workdir=` would otherwise mean the current directory, silently."""
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ValueError("workdir is empty; name a directory for the stage outputs, e.g. --set workdir=runs/mine")
        return value

    @property
    def data_prep_output(self) -> Path:
        return self.data_prep.output if self.data_prep.output is not None else self.workdir / "data"

    @property
    def finetune_data_output(self) -> Path:
        return self.finetune_data.output if self.finetune_data.output is not None else self.workdir / "finetune-data"

    @property
    def finetune_data_prep(self) -> DataPrepConfig:
        """The finetune-data stage as a data-prep config: its corpus, the data-prep stage's tokenizer file."""
        return self.finetune_data.data_prep_config(
            self.data_prep_output, self.data_prep.tokenizer, self.finetune_data_output
        )

    @property
    def convert_output(self) -> Path:
        return self.convert.output if self.convert.output is not None else self.workdir / "model"

    @property
    def pretrain_output(self) -> Path:
        return self.pretrain.output if self.pretrain.output is not None else self.workdir / "pretrain"

    @property
    def pretrain_tracker(self) -> AnyTrackerConfig:
        """The pretrain stage's tracker as it resolves it for its committed output: the run family that evaluation
        runs join (the default JSONL directory is `<pretrain output>/tracker`)."""
        return tracker_config(self.pretrain.tracker, self.pretrain_output)

    def evaluate_inputs(self) -> EvaluateInputs:
        """Where the evaluate stage reads from; with `evaluate.finetune`, the fine-tuned weights and split too."""
        finetune = self.evaluate.finetune
        return EvaluateInputs(
            validation_shards=self.data_prep_output / "validation",
            data_manifest=self.data_prep_output,
            pretrain_output=self.pretrain_output,
            pretrain_model=self.pretrain.model,
            pretrain_seq_len=self.pretrain.seq_len,
            convert_output=self.convert_output,
            finetune_output=self.finetune_output if finetune else None,
            finetune_model=finetune_inputs(self).model if finetune else None,
            finetune_validation_shards=self.finetune_data_output / "validation" if finetune else None,
            tracker=self.pretrain_tracker,
            held_out=self.held_out_splits(),
        )

    def held_out_splits(self) -> dict[str, HeldOutSplit]:
        """Per embedded corpus this job reads, the validation works its data stage holds out: the local evaluation
        tasks of that corpus come from those (the data-prep stage's split wins when both stages read it)."""
        splits: dict[str, HeldOutSplit] = {}
        for corpus, fraction, seed in (
            (self.data_prep.corpus, self.data_prep.validation_fraction, self.data_prep.seed),
            (self.finetune_data.corpus, self.finetune_data.validation_fraction, self.finetune_data.seed),
        ):
            if isinstance(corpus, EmbeddedCorpus) and corpus.name not in splits:
                splits[corpus.name] = HeldOutSplit(validation_fraction=fraction, seed=seed, limit=corpus.limit)
        return splits

    @property
    def finetune_output(self) -> Path:
        return self.finetune.output if self.finetune.output is not None else self.workdir / "finetune"

    @property
    def evaluate_output(self) -> Path:
        return self.evaluate.output if self.evaluate.output is not None else self.workdir / "evaluation"

    def resolved(self, base: Path) -> JobConfig:
        """Relative paths made absolute against `base`, and defaults that depend on `workdir` filled in.

        Flows receive absolute paths so they mean the same thing wherever the flow runs.
        """
        workdir = _absolute(self.workdir, base)
        prep = self.data_prep
        corpus = prep.corpus
        if isinstance(corpus, FilesCorpus):
            corpus = corpus.model_copy(update={"paths": [_absolute(path, base) for path in corpus.paths]})
        tokenizer = prep.tokenizer
        if isinstance(tokenizer, FileTokenizer):
            tokenizer = tokenizer.model_copy(update={"path": _absolute(tokenizer.path, base)})
        output = _absolute(prep.output, base) if prep.output is not None else workdir / "data"
        prep = prep.model_copy(update={"corpus": corpus, "tokenizer": tokenizer, "output": output})
        convert = self.convert.model_copy(
            update={
                "source": _absolute(self.convert.source, base) if self.convert.source is not None else None,
                "output": _absolute(self.convert.output, base)
                if self.convert.output is not None
                else workdir / "model",
            }
        )
        finetune_corpus = self.finetune_data.corpus
        if isinstance(finetune_corpus, FilesCorpus):
            finetune_corpus = finetune_corpus.model_copy(
                update={"paths": [_absolute(path, base) for path in finetune_corpus.paths]}
            )
        finetune_data = self.finetune_data.model_copy(
            update={
                "corpus": finetune_corpus,
                "output": _absolute(self.finetune_data.output, base)
                if self.finetune_data.output
                else workdir / "finetune-data",
            }
        )
        pretrain = self.pretrain.model_copy(
            update={
                "output": _absolute(self.pretrain.output, base) if self.pretrain.output else workdir / "pretrain",
                "tracker": _absolute_tracker(self.pretrain.tracker, base),
            }
        )
        finetune = self.finetune.model_copy(
            update={
                "output": _absolute(self.finetune.output, base) if self.finetune.output else workdir / "finetune",
                "tracker": _absolute_tracker(self.finetune.tracker, base),
                "base": _absolute(self.finetune.base, base) if self.finetune.base is not None else None,
            }
        )
        evaluate = self.evaluate.model_copy(
            update={"output": _absolute(self.evaluate.output, base) if self.evaluate.output else workdir / "evaluation"}
        )
        return self.model_copy(
            update={
                "workdir": workdir,
                "data_prep": prep,
                "finetune_data": finetune_data,
                "convert": convert,
                "pretrain": pretrain,
                "finetune": finetune,
                "evaluate": evaluate,
            }
        )


def _absolute_tracker(tracker: AnyTrackerConfig | None, base: Path) -> AnyTrackerConfig | None:
    """A tracker's directory or repository made absolute, so it means the same wherever the ranks run."""
    if tracker is None:
        return None
    paths = {name: _absolute(value, base) for name, value in tracker if isinstance(value, Path)}
    return tracker.model_copy(update=paths)


def _absolute(path: Path, base: Path) -> Path:
    path = path.expanduser()
    return path if path.is_absolute() else (base / path).resolve()
