"""Model directories d9d writes, checked the way a user would: `d9d convert --mapping qwen3-d9d-to-hf` of it, then
`transformers` loads the result and gives our model's logits (a plain module, shared by tests/flows and tests/peft)."""

import json
from pathlib import Path

import torch

from d9d.flows.cli import main as d9d
from d9d.models import materialize_
from d9d.models.catalogue import read_parameters
from d9d.models.config import DecoderConfig
from d9d.models.qwen3 import Qwen3DenseForCausalLM

EAGER = {"attention": {"kind": "eager"}, "grouped_mm": {"kind": "eager"}}


def d9d_model(directory: Path) -> Qwen3DenseForCausalLM:
    """A plain (unsharded) d9d model with the weights of a d9d-layout directory (its parameters.json says which)."""
    from d9d.states import load_model_state

    parameters = read_parameters(directory)
    with torch.device("meta"):
        model = Qwen3DenseForCausalLM(parameters, config=DecoderConfig.model_validate(EAGER))
    materialize_(model, "cpu")
    load_model_state(directory, model)
    return model


def convert_to_hf(directory: Path, destination: Path) -> None:
    """`d9d convert --mapping qwen3-d9d-to-hf` (collective inside a process group: every rank calls it)."""
    assert d9d(["convert", "--mapping", "qwen3-d9d-to-hf", str(directory), str(destination)]) == 0


def assert_loads_in_transformers_with_the_same_logits(directory: Path, converted: Path, ids: torch.Tensor) -> None:
    import transformers

    assert json.loads((converted / "config.json").read_text())["model_type"] == "qwen3"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(converted, attn_implementation="eager")
    ours = d9d_model(directory)
    with torch.no_grad():
        # fp32 both sides over the same weights: only the kernels' summation order differs (observed ~1e-6).
        torch.testing.assert_close(loaded.float()(ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-4)
