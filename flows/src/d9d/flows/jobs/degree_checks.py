"""Preflight of a launched stage's topology: its degrees against the ranks, the model, the sequence and the batch.

Every check here is one the rank programs would otherwise fail on after `torchrun` started (or, worse, one they
would not fail on); each error names the field with its section (`pretrain.degrees.tp`), its value and what would
be valid. Combinations the libraries do not cover with a parity test yet are refused here too (`UNSUPPORTED`,
docs/design/0015), so a user learns it before any rank starts.
"""

from __future__ import annotations

from d9d.core.dist import MeshDegrees
from d9d.flows.jobs.stage_spec import PreflightError
from d9d.flows.jobs.topology import RankTopology
from d9d.models.catalogue import AnyModelConfig, Qwen3MoeModelConfig
from d9d.models.qwen3.tensor_parallel import check_qwen3_tp_degrees
from d9d.parallel import ReplicateConfig, SingleDeviceConfig
from d9d.parallel.context import check_context_parallel
from d9d.pipeline import plan_pipeline

# Degree pairs the libraries refuse or have no parity test for yet, and why (docs/design/0015). Empty since pp x cp got
# its parity test (tests/pipeline/test_pipeline_context_parallel.py, design note 0016): every pair of degrees runs.
UNSUPPORTED: dict[tuple[str, str], str] = {}


def check_topology(
    section: str,
    topology: RankTopology,
    model: AnyModelConfig,
    *,
    seq_len: int,
    microbatches_per_step: int | None,
) -> MeshDegrees:
    """Check `topology` (the `section` of a job) for `model` at `seq_len`; `microbatches_per_step` is what each
    data-parallel rank runs per step (None: the batch check reports a batch that does not split). Returns the
    resolved degrees.

    Raises:
        PreflightError: naming the field, its value and what would be valid.
    """
    degrees = _resolve(section, topology)
    _check_pairs(section, degrees)
    _check_replicate(section, topology, degrees)
    _check_single(section, topology, degrees)
    if degrees.tp > 1:
        _check_tensor(section, model, degrees, seq_len)
    if degrees.cp > 1:
        try:
            check_context_parallel(seq_len, degrees)
        except ValueError as error:
            raise PreflightError(f"{section}.degrees.cp={degrees.cp} does not fit seq_len={seq_len}: {error}") from None
    if degrees.ep > 1:
        _check_experts(section, model, degrees)
    if degrees.pp > 1 and model.decoder.compile_model:
        raise PreflightError(
            f"{section}.model.decoder.compile_model=true with {section}.degrees.pp={degrees.pp}: a pipeline's split "
            f"backward needs each layer's autograd graph; set {section}.model.decoder.compile_layers=true instead"
        )
    if degrees.pp > 1 and microbatches_per_step is not None:
        _check_pipeline(section, topology, model, degrees, microbatches_per_step)
    return degrees


def _resolve(section: str, topology: RankTopology) -> MeshDegrees:
    try:
        return topology.resolved_degrees()
    except ValueError as error:
        raise PreflightError(
            f"{section}.degrees do not fit {topology.world_size()} ranks ({section}.nproc_per_node="
            f"{topology.nproc_per_node} on {topology.node_count()} node(s)): {error}"
        ) from None


def _check_pairs(section: str, degrees: MeshDegrees) -> None:
    for (first, second), reason in UNSUPPORTED.items():
        a, b = getattr(degrees, first), getattr(degrees, second)
        if a > 1 and b > 1:
            raise PreflightError(
                f"{section}.degrees.{first}={a} with {section}.degrees.{second}={b} is not supported yet ({reason}); "
                f"set {section}.degrees.{first}=1 or {section}.degrees.{second}=1"
            )


# Why each degree needs FSDP or HSDP rather than `replicate` data parallelism.
_NOT_WITH_REPLICATE = {
    "tp": "FSDP reduces the tensor-parallel gradients of the replicated norms",
    "pp": "no parity test covers replicate with pipeline stages yet",
}


def _check_replicate(section: str, topology: RankTopology, degrees: MeshDegrees) -> None:
    if not isinstance(topology.data_parallel, ReplicateConfig):
        return
    for name, reason in _NOT_WITH_REPLICATE.items():
        if (value := getattr(degrees, name)) > 1:
            raise PreflightError(
                f"{section}.data_parallel.kind=replicate with {section}.degrees.{name}={value} is not supported "
                f"({reason}); use kind=fsdp or kind=hsdp"
            )
    # Replicated dense parameters beside experts that live on one rank each (design 0031); experts shared by several
    # ranks would need a reduction replicate does not do.
    if degrees.ep > 1 and degrees.expert_replicate() > 1:
        raise PreflightError(
            f"{section}.data_parallel.kind=replicate with {section}.degrees.ep={degrees.ep} needs every expert on one "
            f"rank (ep = dp_replicate*dp_shard*cp = {degrees.expert_fold}), but each expert shard would live on "
            f"{degrees.expert_replicate()} ranks; set {section}.degrees.ep={degrees.expert_fold}, or use kind=fsdp "
            "or kind=hsdp"
        )


def _check_single(section: str, topology: RankTopology, degrees: MeshDegrees) -> None:
    """`kind=single` trains one rank's whole model (no FSDP): refused before any rank starts, as its builder would."""
    if not isinstance(topology.data_parallel, SingleDeviceConfig):
        return
    shared = {"dp_replicate": degrees.dp_replicate, "dp_shard": degrees.dp_shard, "cp": degrees.cp}
    shared |= {"tp": degrees.tp, "ep": degrees.ep}
    if over := {name: value for name, value in shared.items() if value > 1}:
        found = ", ".join(f"{section}.degrees.{name}={value}" for name, value in over.items())
        raise PreflightError(
            f"{section}.data_parallel.kind=single trains one rank without FSDP, but {found}; use kind=fsdp "
            f"(or kind=hsdp / replicate), or run on one rank ({section}.nproc_per_node=1)"
        )


def _check_tensor(section: str, model: AnyModelConfig, degrees: MeshDegrees, seq_len: int) -> None:
    try:
        # Sequence parallelism splits each rank's (context-sharded) sequence over tp.
        check_qwen3_tp_degrees(model.parameters, degrees.tp, seq_len=seq_len // degrees.cp)
    except ValueError as error:
        raise PreflightError(f"{section}.degrees.tp={degrees.tp}: {error}") from None


def _check_experts(section: str, model: AnyModelConfig, degrees: MeshDegrees) -> None:
    if not isinstance(model, Qwen3MoeModelConfig):
        raise PreflightError(
            f"{section}.degrees.ep={degrees.ep} needs a model with experts, but the model is {model.kind}; "
            f"use ep=1, or a qwen3_moe model"
        )
    experts = model.parameters.num_experts
    if experts % degrees.ep:
        valid = [ep for ep in range(1, experts + 1) if experts % ep == 0 and degrees.expert_fold % ep == 0]
        raise PreflightError(
            f"{section}.degrees.ep={degrees.ep} does not divide the model's num_experts={experts}; valid ep "
            f"(dividing num_experts and dp_replicate*dp_shard*cp={degrees.expert_fold}): {valid}"
        )


def _check_pipeline(
    section: str, topology: RankTopology, model: AnyModelConfig, degrees: MeshDegrees, microbatches: int
) -> None:
    try:
        plan_pipeline(
            topology.pipeline,
            pp=degrees.pp,
            num_layers=model.parameters.num_layers,
            num_microbatches=microbatches,
            dp_shard=degrees.dp_shard,
            tp=degrees.tp,
        )
    except ValueError as error:
        raise PreflightError(
            f"{section}.degrees.pp={degrees.pp} with {section}.pipeline.schedule.kind="
            f"{topology.pipeline.schedule.kind} ({microbatches} micro-batches per step, "
            f"{model.parameters.num_layers} layers): {error}"
        ) from None
