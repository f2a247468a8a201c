"""The stages a job has, by command-line name, and the order the pipeline runs them in (no Prefect here)."""

from __future__ import annotations

# command-line name -> the JobConfig field holding that stage's config
STAGE_SECTIONS: dict[str, str] = {
    "data-prep": "data_prep",
    "finetune-data": "finetune_data",
    "convert": "convert",
    "pretrain": "pretrain",
    "finetune": "finetune",
    "evaluate": "evaluate",
}
PIPELINE: tuple[str, ...] = ("data-prep", "finetune-data", "convert", "pretrain", "finetune", "evaluate")
