"""Qwen3 and Qwen3-MoE match transformers: logits and gradients, fp32 and bf16, weights moved by our HF mapper.

Tolerances:
- float32: 1e-5 absolute/relative on logits and gradients. The arithmetic is the same operations on the same values;
  only summation orders differ (chunked loss, expert combine), each rounding at float32's 6e-8.
- bfloat16: no fixed bound is meaningful (bf16 keeps 8 bits, so two correct implementations differ by about 1% on
  each activation). Instead both bf16 models are compared with the float32 reference, and ours must be no further
  from it than transformers' own bf16 run, within a factor of 2 (plus a floor for values transformers happens to
  round luckily). The same rule holds for gradients, by relative L2 error per parameter.
- Both hold with the LM head's loss gradients computed in forward (`loss_gradients_in_forward`, design note 0023):
  the same float32 softmax and the same matmuls, so the same tolerances.
- MoE routing is held identical (our routers replay transformers' expert choices): near-tied router scores flip
  top-k choices under bf16 rounding, which changes the function itself, not its precision.
"""

import contextlib

import pytest
import torch
from tiny import EAGER, VOCAB, d9d_from_hf, d9d_tensors_in_hf_names, hf_dense, hf_moe, map_tensors
from torch.nn import functional

from d9d.models import materialize_
from d9d.models.blocks.moe import TopKRouter, force_routing
from d9d.models.qwen3 import (
    Qwen3DenseForCausalLM,
    mapper_from_huggingface_qwen3_dense,
    qwen3_dense_parameters_from_hf,
)

FP32 = {"atol": 1e-5, "rtol": 1e-5}


def _batch(seed=0, batch=2, seq=11):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    labels[0, :3] = -100  # prompt tokens without loss
    return ids, labels


def _hf_loss(hf, ids, labels):
    logits = hf(ids).logits
    return functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


@contextlib.contextmanager
def _hf_routing_captured(hf):
    """Record the experts transformers' routers choose, per layer index."""
    choices, hooks = {}, []
    top_k = hf.config.num_experts_per_tok
    for index, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue

        def hook(module, args, output, index=index):
            if isinstance(output, tuple):  # transformers >= 5: (logits, weights, indices)
                choices[index] = output[2].detach()
            else:  # transformers < 5: the gate is a Linear returning logits
                choices[index] = torch.topk(torch.softmax(output.float(), -1), top_k, dim=-1).indices

        hooks.append(gate.register_forward_hook(hook))
    try:
        yield choices
    finally:
        for handle in hooks:
            handle.remove()


def _routers(model) -> dict[int, TopKRouter]:
    return {int(index): moe.router for index, moe in model.model.moe_layers().items()}


def _run_both(hf, model, ids, labels):
    """Forward and backward on both sides (our routing replaying theirs); returns (our logits, their logits)."""
    with _hf_routing_captured(hf) if hasattr(hf.config, "num_experts_per_tok") else contextlib.nullcontext({}) as ch:
        theirs = hf(ids).logits
        _hf_loss(hf, ids, labels).backward()
    routers = _routers(model) if ch else {}
    with force_routing({routers[i]: ch[i] for i in routers}):
        ours = model(ids).logits
        model(ids, labels=labels).loss_sum.backward()
    return ours, theirs


def _relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


GRADIENTS_IN_FORWARD = pytest.mark.parametrize("in_forward", [False, True], ids=["loss-backward", "loss-in-forward"])


@pytest.mark.parametrize("family", ["dense", "moe"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@GRADIENTS_IN_FORWARD
def test_fp32_logits_and_gradients_match_transformers(family, attention, in_forward):
    hf = hf_dense() if family == "dense" else hf_moe()
    config = EAGER if attention == "eager" else EAGER.model_copy(update={"attention": None})
    config = config.model_copy(update={"loss_gradients_in_forward": in_forward})
    model, params = d9d_from_hf(hf, config=config)
    ids, labels = _batch()
    ours, theirs = _run_both(hf, model, ids, labels)
    torch.testing.assert_close(ours, theirs, **FP32)
    grads = d9d_tensors_in_hf_names(model, params, hf.state_dict())
    hf_params = dict(hf.named_parameters())
    assert grads.keys() == hf_params.keys()
    for name, param in hf_params.items():
        torch.testing.assert_close(grads[name], param.grad, **FP32, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", ["dense", "moe"])
@GRADIENTS_IN_FORWARD
def test_bf16_is_as_close_to_fp32_as_transformers_bf16(family, in_forward):
    make = hf_dense if family == "dense" else hf_moe
    ids, labels = _batch(seed=1)
    reference = make()
    ref_model, _ = d9d_from_hf(reference)
    _, ref_theirs = _run_both(reference, ref_model, ids, labels)
    hf = make().to(torch.bfloat16)
    model, params = d9d_from_hf(hf, config=EAGER.model_copy(update={"loss_gradients_in_forward": in_forward}))
    model.to(torch.bfloat16)
    ours, theirs = _run_both(hf, model, ids, labels)
    assert ours.dtype == torch.bfloat16
    our_error, their_error = _relative(ours, ref_theirs), _relative(theirs, ref_theirs)
    assert our_error <= 2 * their_error + 1e-3, f"logits: ours {our_error:.2e} vs transformers {their_error:.2e}"
    grads = d9d_tensors_in_hf_names(model, params, hf.state_dict())
    ref_grads = dict(reference.named_parameters())
    for name, param in hf.named_parameters():
        ours_e, theirs_e = _relative(grads[name], ref_grads[name].grad), _relative(param.grad, ref_grads[name].grad)
        assert ours_e <= 2 * theirs_e + 5e-3, f"{name}: ours {ours_e:.2e} vs transformers {theirs_e:.2e}"


def test_fp32_routing_chooses_the_same_experts_without_replay():
    hf = hf_moe()
    model, _ = d9d_from_hf(hf)
    ids, _ = _batch()
    ours, hooks = {}, []
    for index, router in _routers(model).items():
        hooks.append(router.register_forward_hook(lambda m, a, out, i=index: ours.__setitem__(i, out.expert_indices)))
    with _hf_routing_captured(hf) as theirs:
        hf(ids)
    model(ids)
    for handle in hooks:
        handle.remove()
    assert ours.keys() == theirs.keys() == {0, 2}  # layer 1 is dense (mlp_only_layers)
    for index, chosen in ours.items():
        assert torch.equal(chosen.sort(-1).values, theirs[index].sort(-1).values)


def test_tied_hf_checkpoint_loads_untied_with_the_same_logits():
    hf = hf_dense(tie_word_embeddings=True)
    assert "lm_head.weight" not in hf.state_dict() or hf.lm_head.weight is hf.model.embed_tokens.weight
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # what a tied checkpoint holds
    model, _ = d9d_from_hf(hf, state=state)
    ids, _ = _batch()
    torch.testing.assert_close(model(ids).logits, hf(ids).logits, **FP32)
    head = model.lm_head.segments["regular"].weight
    assert head.data_ptr() != model.model.embed_tokens.segments["regular"].weight.data_ptr()


def test_split_vocabulary_segments_load_and_train_separately():
    hf = hf_dense()
    ids, labels = _batch()
    params = qwen3_dense_parameters_from_hf(hf.config.to_dict())
    split = params.model_copy(update={"vocab_segments": {"regular": 80, "special": 16}})
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(split, config=EAGER)
    materialize_(model, "cpu")
    model.load_state_dict(map_tensors(mapper_from_huggingface_qwen3_dense(split), hf.state_dict()))
    torch.testing.assert_close(model(ids).logits, hf(ids).logits, **FP32)
    embedding = model.model.embed_tokens.segments
    assert embedding["special"].weight.shape == (16, 64)
    torch.testing.assert_close(embedding["special"].weight, hf.model.embed_tokens.weight[80:])
    embedding["regular"].weight.requires_grad_(False)
    model(ids, labels=labels).losses.sum().backward()
    assert embedding["regular"].weight.grad is None
    assert embedding["special"].weight.grad is not None
