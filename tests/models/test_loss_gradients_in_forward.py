"""`DecoderConfig.loss_gradients_in_forward`: the LM head computes the gradients of the loss sum in forward.

Compared with the same model computing them in backward (the default), float32: the same softmax and matmuls in a
different order, so 1e-5. The HF parity and Triton-block parity tests also run with it on.
"""

import pytest
import torch
from tiny import EAGER, VOCAB, d9d_from_hf, hf_dense, hf_moe
from torch.distributed.tensor import DTensor

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.models import materialize_
from d9d.models.blocks.compilation import compile_model
from d9d.models.qwen3 import Qwen3DenseForCausalLM, parallelize_qwen3_dense, qwen3_dense_parameters_from_hf
from d9d.parallel import FsdpConfig

FP32 = {"atol": 1e-5, "rtol": 1e-5}
IN_FORWARD = EAGER.model_copy(update={"loss_gradients_in_forward": True})


def _batch(rows=4, seq=9):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=generator)
    labels = torch.randint(0, VOCAB, (rows, seq), generator=generator)
    labels[0, :3] = -100
    return ids, labels


def _grads(model):
    return {name: p.grad for name, p in model.named_parameters()}


def _assert_same_grads(got, want):
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, **FP32, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_micro_batches_accumulate_the_same_gradients_as_backward_computed_ones(family):
    hf = hf_dense() if family == "dense" else hf_moe()
    ids, labels = _batch()
    tokens = (labels != -100).sum()
    models = {"backward": d9d_from_hf(hf)[0], "forward": d9d_from_hf(hf, config=IN_FORWARD)[0]}
    losses = {}
    for name, model in models.items():
        per_token = []
        for rows in (slice(0, 2), slice(2, 4)):  # two micro-batches, each forward forms its own gradients
            output = model(ids[rows], labels=labels[rows])
            (output.loss_sum / tokens).backward()
            per_token.append(output.losses)
        losses[name] = torch.cat(per_token)
    assert not losses["forward"].requires_grad  # detached: metrics only
    torch.testing.assert_close(losses["forward"], losses["backward"].detach(), **FP32)
    _assert_same_grads(_grads(models["forward"]), _grads(models["backward"]))


def test_per_token_losses_cannot_be_trained_through_when_gradients_come_from_forward():
    model = d9d_from_hf(hf_dense(), config=IN_FORWARD)[0]
    ids, labels = _batch()
    output = model(ids, labels=labels)
    torch.testing.assert_close(output.loss_sum, output.losses.sum(), **FP32)
    with pytest.raises(RuntimeError, match="does not require grad"):
        output.losses.sum().backward()  # a caller weighting tokens differently gets an error, never wrong gradients


def test_whole_model_compile_with_gradients_in_forward_matches_eager():
    hf = hf_dense()
    ids, labels = _batch()
    eager = d9d_from_hf(hf)[0]
    compiled = d9d_from_hf(hf, config=IN_FORWARD)[0]
    compile_model(compiled, backend="aot_eager")
    want = eager(ids, labels=labels)
    (want.loss_sum * 0.1).backward()
    got = compiled(ids, labels=labels)
    (got.loss_sum * 0.1).backward()
    torch.testing.assert_close(got.loss_sum, want.loss_sum, **FP32)
    _assert_same_grads(_grads(compiled), _grads(eager))


@pytest.mark.distributed(world_size=2, timeout=240)
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")
@pytest.mark.filterwarnings("ignore:Slicing a flattened dim:UserWarning")
def test_tensor_parallel_head_with_gradients_in_forward_matches_one_process():
    """tp=2 with sequence parallelism: the vocabulary-parallel loss forms its gradients in forward too."""
    ctx = DistributedContext.build(MeshDegrees(tp=2), device="cpu")
    params = qwen3_dense_parameters_from_hf(hf_dense().config.to_dict())
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(params, config=IN_FORWARD)
        reference = Qwen3DenseForCausalLM(params, config=EAGER)
    parallelize_qwen3_dense(model, ctx, FsdpConfig())
    for built in (model, reference):
        torch.manual_seed(0)
        materialize_(built, "cpu")  # sharded parameters get the single-process values
    ids, labels = _batch(seq=8)  # the sequence splits over the tp ranks
    got, want = model(ids, labels=labels), reference(ids, labels=labels)
    (got.loss_sum * 0.1).backward()
    (want.loss_sum * 0.1).backward()
    torch.testing.assert_close(got.loss_sum, want.loss_sum, **FP32)
    assert not got.losses.requires_grad
    grads = {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for name, p in model.named_parameters()
    }
    _assert_same_grads(grads, _grads(reference))
