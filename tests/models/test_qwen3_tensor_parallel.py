"""Qwen3 under tensor parallelism: the degree check, HF import/export of a tp x dp model, logits and the Inference loop.

float32; the tp model differs from the single-process one only in summation order, so 1e-5 on logits and losses.
Exported tensors are gathered copies of the same values: compared exactly.
"""

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tiny import DENSE_HF, EAGER, MOE_HF, VOCAB, d9d_from_hf, hf_dense, hf_moe, map_tensors
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import Inference, LossResult, SyntheticTokenSource, TokenBatch
from d9d.models import materialize_
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    Qwen3MoeForCausalLM,
    check_qwen3_tp_degrees,
    detect_experts_format,
    mapper_from_huggingface_qwen3_dense,
    mapper_from_huggingface_qwen3_moe,
    mapper_to_huggingface_qwen3_dense,
    mapper_to_huggingface_qwen3_moe,
    parallelize_qwen3_dense,
    parallelize_qwen3_moe,
    qwen3_dense_parameters_from_hf,
    qwen3_moe_parameters_from_hf,
)
from d9d.parallel import FsdpConfig, ReplicateConfig
from d9d.states import load_model_state, save_model_state

pytestmark = [
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:Slicing a flattened dim:UserWarning"),
]

FP32 = {"atol": 1e-5, "rtol": 1e-5}


def test_degree_check_names_each_dimension_and_the_valid_degrees():
    params = qwen3_dense_parameters_from_hf(DENSE_HF)  # 4 heads, 2 kv heads, FFN 80, vocabulary 96
    check_qwen3_tp_degrees(params, 2)
    with pytest.raises(ValueError, match=r"tp=4 .*num_key_value_heads=2.*valid tp degrees: \[1, 2\]"):
        check_qwen3_tp_degrees(params, 4)  # more tp ranks than key/value heads: refused, not replicated
    with pytest.raises(ValueError, match=r"tp=3 .*num_attention_heads=4, num_key_value_heads=2, intermediate_size=80"):
        check_qwen3_tp_degrees(params, 3)
    check_qwen3_tp_degrees(params, 2, seq_len=4096)
    with pytest.raises(ValueError, match=r"tp=2 .*seq_len=4097.*valid tp degrees: \[1\]"):
        check_qwen3_tp_degrees(params, 2, seq_len=4097)  # sequence parallelism splits every sequence evenly
    segmented = params.model_copy(update={"vocab_segments": {"regular": 90, "special": 6}})
    with pytest.raises(ValueError, match="several segments"):
        check_qwen3_tp_degrees(segmented, 2)
    # MoE experts are not split by tp: only attention, the dense layers' FFN and the vocabulary count
    moe = qwen3_moe_parameters_from_hf({**MOE_HF, "intermediate_size": 81, "mlp_only_layers": []})
    check_qwen3_tp_degrees(moe, 2)


@pytest.mark.distributed(world_size=2, timeout=120)
def test_replicate_with_tp_is_refused_naming_the_alternative():
    ctx = DistributedContext.build(MeshDegrees(tp=2), device="cpu")
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(qwen3_dense_parameters_from_hf(DENSE_HF), config=EAGER)
    with pytest.raises(ValueError, match=r"kind='replicate' with tp=2 is not supported.*use kind='fsdp'"):
        parallelize_qwen3_dense(model, ctx, ReplicateConfig())


class _CausalLM:
    def count_tokens(self, batch: TokenBatch) -> int:
        return int((batch.labels != -100).sum())

    def compute_loss(self, model: nn.Module, batch: TokenBatch) -> LossResult:
        return LossResult(loss_sum=model(batch.input_ids, labels=batch.labels).losses.sum())

    def count_bytes(self, batch: TokenBatch) -> int:
        return 4 * self.count_tokens(batch)


def _saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for backward in one training forward (local shards of DTensors)."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids, labels=ids).losses.sum()
    return total


def _source(dp_rank: int, dp_size: int) -> SyntheticTokenSource:
    return SyntheticTokenSource(
        seed=1, global_rows=4, microbatch_rows=1, seq_len=8, vocab_size=VOCAB, dp_rank=dp_rank, dp_size=dp_size,
        ignore_fraction=0.3,
    )  # fmt: skip


@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.distributed(world_size=4, timeout=300)
def test_tp_model_imports_exports_and_evaluates_like_the_single_process_one(family, tmp_path):
    hf = hf_dense(seed=4) if family == "dense" else hf_moe(seed=4)
    if dist.get_rank() == 0:
        hf.save_pretrained(tmp_path / "hf")
    dist.barrier()
    config = hf.config.to_dict()
    if family == "dense":
        params = qwen3_dense_parameters_from_hf(config)
        cls, parallelize = Qwen3DenseForCausalLM, parallelize_qwen3_dense
        from_hf, to_hf = mapper_from_huggingface_qwen3_dense(params), mapper_to_huggingface_qwen3_dense(params)
    else:
        params = qwen3_moe_parameters_from_hf(config)
        on_disk = {}
        for file in (tmp_path / "hf").glob("*.safetensors"):
            on_disk.update(load_file(file))
        layout = detect_experts_format(on_disk)  # transformers may save experts per expert though it holds them fused
        cls, parallelize = Qwen3MoeForCausalLM, parallelize_qwen3_moe
        from_hf = mapper_from_huggingface_qwen3_moe(params, experts_format=layout)
        to_hf = mapper_to_huggingface_qwen3_moe(params, experts_format=layout)
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2, tp=2), device="cpu")
    with torch.device("meta"):
        model = cls(params, config=EAGER)
    parallelize(model, ctx, FsdpConfig())
    materialize_(model, "cpu")
    load_model_state(tmp_path / "hf", model, from_hf)  # each rank reads its shards only

    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    reference, _ = d9d_from_hf(hf)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, **FP32)

    # Sequence parallelism: between blocks each rank holds half the sequence, and the activations saved for
    # backward (per rank, same batch) shrink accordingly.
    between = []
    hook = model.model.layers["0"].register_forward_hook(lambda _m, _a, out: between.append(out))
    tp_saved, single_saved = _saved_bytes(model, ids), _saved_bytes(reference, ids)
    hook.remove()
    assert between[0].placements == (Shard(1),) and between[0].to_local().shape[1] == 8 // 2
    if dist.get_rank() == 0:
        print(f"{family}: saved activations per rank {tp_saved} B under tp2, {single_saved} B in one process")
    assert tp_saved < 0.8 * single_saved

    # the Inference loop: tp ranks share their dp rank's rows; the result is global
    dp = ctx.coordinate("batch")["dp"]
    evaluated = Inference(ctx, model=model, task=_CausalLM(), data=_source(dp, 2)).run(steps=2)
    expected = Inference(None, model=reference, task=_CausalLM(), data=_source(0, 1)).run(steps=2)
    assert evaluated.tokens == expected.tokens
    assert evaluated.loss == pytest.approx(expected.loss, abs=1e-5)

    with torch.no_grad():  # train-like drift, identical in both models, so the export is not the import echoed back
        for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
            scale = 1.0 + 0.01 * (len(name) % 7)
            param.mul_(scale)
            ref.mul_(scale)
    save_model_state(tmp_path / "export", model, to_hf)  # DTensor shards gathered group by group
    if dist.get_rank() == 0:
        expected_tensors = map_tensors(to_hf, reference.state_dict())
        exported = {}
        for file in sorted((tmp_path / "export").glob("*.safetensors")):
            exported.update(load_file(file))
        assert exported.keys() == expected_tensors.keys()
        for name, tensor in expected_tensors.items():
            assert torch.equal(exported[name], tensor), name
    dist.barrier()
