"""The data-preparation stage: raw text to a tokenizer and train/validation token shards (no Prefect here)."""

from d9d.flows.jobs.data_prep.config import (
    AnyCorpus,
    AnyTokenizer,
    DataPrepConfig,
    EmbeddedCorpus,
    FilesCorpus,
    FileTokenizer,
    TrainBpeTokenizer,
)
from d9d.flows.jobs.data_prep.corpus import CorpusError
from d9d.flows.jobs.data_prep.prepare import STAGE_NAME, DataPrepPlan, plan_data_prep, preflight, run_data_prep
from d9d.flows.jobs.data_prep.split import SplitError
from d9d.flows.jobs.data_prep.stage import commit, prepare_data, skipped
from d9d.flows.jobs.data_prep.tokenizer import TokenizerError

__all__ = [
    "STAGE_NAME",
    "AnyCorpus",
    "AnyTokenizer",
    "CorpusError",
    "DataPrepConfig",
    "DataPrepPlan",
    "EmbeddedCorpus",
    "FileTokenizer",
    "FilesCorpus",
    "SplitError",
    "TokenizerError",
    "TrainBpeTokenizer",
    "commit",
    "plan_data_prep",
    "preflight",
    "prepare_data",
    "run_data_prep",
    "skipped",
]
