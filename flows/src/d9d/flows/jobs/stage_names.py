"""The stages a job has, by command-line name, and the order the pipeline runs them in (no Prefect here)."""

from __future__ import annotations

# command-line name -> the JobConfig field holding that stage's config
STAGE_SECTIONS: dict[str, str] = {"data-prep": "data_prep", "convert": "convert"}
# Later stages (pretraining, fine-tuning, evaluation) append here as they land.
PIPELINE: tuple[str, ...] = ("data-prep", "convert")
