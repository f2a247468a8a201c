"""Checks of the training and evaluation sections that can fail before any process starts (names field and value)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from d9d.core.dist import MeshDegrees
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.contract import ManifestError, StageManifest
from d9d.flows.jobs.data_prep.config import TrainBpeTokenizer
from d9d.flows.jobs.data_prep.corpus import check_readable, corpus_files, text_field_of


class PreflightError(ValueError):
    """A stage section cannot run as configured; the message names the fields, their values and a fix."""


def data_parallel_size(degrees: MeshDegrees, nproc: int) -> int | None:
    """The data-parallel size on `nproc` ranks when only data parallelism is used (else None: not checked here)."""
    if degrees == MeshDegrees(dp_shard=-1):
        return nproc
    return None


def require_inputs(config: JobConfig, stage: str, running: Collection[str]) -> None:
    """The outputs `stage` reads must be complete unless a stage running before it in this run writes them."""
    needs: dict[str, dict[str, Path]] = {
        "finetune-data": {"data-prep": config.data_prep_output},
        "pretrain": {"data-prep": config.data_prep_output},
        "finetune": {"pretrain": config.pretrain_output, "finetune-data": config.finetune_data_output},
        "evaluate": {"data-prep": config.data_prep_output, "pretrain": config.pretrain_output},
    }
    if config.evaluate.finetune:
        needs["evaluate"] |= {"finetune-data": config.finetune_data_output, "finetune": config.finetune_output}
    for earlier, output in needs.get(stage, {}).items():
        if earlier in running:
            continue
        try:
            StageManifest.read(output)
        except ManifestError as error:
            raise PreflightError(
                f"{stage} reads the output of {earlier} at {output}, which is not complete ({error}); "
                f"run `d9d run {earlier}` (or the pipeline) first"
            ) from error


def preflight_pretrain(config: JobConfig) -> None:
    section = config.pretrain
    parameters = section.model.parameters
    tokenizer = config.data_prep.tokenizer
    if isinstance(tokenizer, TrainBpeTokenizer) and parameters.vocab_size < tokenizer.vocab_size:
        raise PreflightError(
            f"pretrain.model.parameters.vocab_size={parameters.vocab_size} is smaller than "
            f"data_prep.tokenizer.vocab_size={tokenizer.vocab_size}; token ids would fall outside the embedding "
            f"table; set it to at least {tokenizer.vocab_size}"
        )
    if section.seq_len > parameters.max_position_embeddings:
        raise PreflightError(
            f"pretrain.seq_len={section.seq_len} exceeds pretrain.model.parameters.max_position_embeddings="
            f"{parameters.max_position_embeddings}; lower seq_len or raise max_position_embeddings"
        )
    dp = data_parallel_size(section.degrees, section.nproc_per_node)
    if dp is not None and section.global_batch_rows % (dp * section.microbatch_rows):
        raise PreflightError(
            f"pretrain.global_batch_rows={section.global_batch_rows} cannot be split into micro-batches of "
            f"pretrain.microbatch_rows={section.microbatch_rows} over pretrain.nproc_per_node={section.nproc_per_node} "
            f"ranks; make it a multiple of {dp * section.microbatch_rows}"
        )


def preflight_finetune_data(config: JobConfig) -> None:
    """The fine-tune corpus' files are readable (its tokenizer is the data-prep stage's, made before it runs)."""
    section = config.finetune_data
    for file in corpus_files(section.corpus, field="finetune_data.corpus"):
        check_readable(file, text_field=text_field_of(section.corpus))


def preflight_finetune(config: JobConfig) -> None:
    section = config.finetune
    dp = data_parallel_size(section.degrees, section.nproc_per_node)
    if dp is not None and section.global_batch_rows % (dp * section.microbatch_rows):
        raise PreflightError(
            f"finetune.global_batch_rows={section.global_batch_rows} cannot be split into micro-batches of "
            f"finetune.microbatch_rows={section.microbatch_rows} over finetune.nproc_per_node={section.nproc_per_node} "
            f"ranks; make it a multiple of {dp * section.microbatch_rows}"
        )
    if dp is not None and section.validation_rows_per_step % dp:
        raise PreflightError(
            f"finetune.validation_rows_per_step={section.validation_rows_per_step} is not a multiple of "
            f"finetune.nproc_per_node={section.nproc_per_node}; every rank evaluates the same number of rows"
        )


def preflight_evaluate(config: JobConfig) -> None:
    section = config.evaluate
    if section.rows_per_step % section.nproc_per_node:
        raise PreflightError(
            f"evaluate.rows_per_step={section.rows_per_step} is not a multiple of evaluate.nproc_per_node="
            f"{section.nproc_per_node}; every rank evaluates the same number of rows per step"
        )
