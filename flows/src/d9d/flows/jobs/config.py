"""The job configuration: one pydantic model composing the configuration of every stage of the pipeline."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from d9d.flows.jobs.convert.config import ConvertConfig
from d9d.flows.jobs.data_prep.config import DataPrepConfig, FilesCorpus, FileTokenizer


class JobConfig(BaseModel):
    """A whole job: the working directory and one section per stage (data preparation, checkpoint conversion)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workdir: Path = Field(default=Path("runs/default"), description="stage outputs go under this directory")
    data_prep: DataPrepConfig = Field(default_factory=DataPrepConfig)
    convert: ConvertConfig = Field(default_factory=ConvertConfig)

    @property
    def data_prep_output(self) -> Path:
        return self.data_prep.output if self.data_prep.output is not None else self.workdir / "data"

    @property
    def convert_output(self) -> Path:
        return self.convert.output if self.convert.output is not None else self.workdir / "model"

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
        return self.model_copy(update={"workdir": workdir, "data_prep": prep, "convert": convert})


def _absolute(path: Path, base: Path) -> Path:
    path = path.expanduser()
    return path if path.is_absolute() else (base / path).resolve()
