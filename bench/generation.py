"""Decoding throughput of the dense anchor model (Qwen3-0.6B shape, ../shared/reference/anchors.md): d9d's
KV-cached `generate`, eager and with `torch.compile`, next to `transformers`' `generate` on the same weights.

Random weights (seeded) in bf16, moved into a `transformers` Qwen3ForCausalLM through our HF mapper, so both sides
run the same function. Prompts are uniform-random tokens of `--prompt` length; every row decodes exactly
`--new-tokens` tokens greedily (no stop token: `eos_token_id=None` on the HF side). Each configuration runs once to
warm up (and compile), then `--repeats` timed runs (CUDA synchronised); a row reports the median generated
tokens/s (batch x new tokens / wall time, prefill included) and the peak allocated memory. The last column says
how many of HF's greedy tokens ours reproduces (bf16: the two may part ways after a near-tie, then differ).

Each row is printed (and flushed) as soon as it is measured. `--max-seconds` bounds the whole command: a row whose
warm-up would start after it is skipped (said so in its row), and a row takes fewer timed runs when the budget would
not hold them all.

    python bench/generation.py                          # batch 1 and 32, prompt 512, 256 new tokens, on the GPU
    python bench/generation.py --tiny --device cpu      # a seconds-long smoke run of the script itself
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from anchor_models import DENSE, tiny
from d9d.kernels.attention import SdpaAttentionConfig
from d9d.models import DecoderConfig, materialize_
from d9d.models.generation import GenerationConfig, generate
from d9d.models.qwen3 import Qwen3DenseForCausalLM, Qwen3DenseParameters, mapper_to_huggingface_qwen3_dense


def build_models(
    params: Qwen3DenseParameters, device: torch.device, dtype: torch.dtype
) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        ours = Qwen3DenseForCausalLM(params, config=DecoderConfig(attention=SdpaAttentionConfig()))
    torch.manual_seed(0)
    materialize_(ours, device)
    ours = ours.to(dtype).eval()
    mapper = mapper_to_huggingface_qwen3_dense(params)
    state = {name: tensor.detach() for name, tensor in ours.state_dict().items()}
    hf_state: dict[str, torch.Tensor] = {}
    for group in mapper.state_dependency_groups():
        hf_state.update(mapper.apply({name: state[name] for name in group.inputs}))
    config = Qwen3Config(
        vocab_size=params.vocab_size,
        hidden_size=params.hidden_size,
        intermediate_size=params.intermediate_size,
        num_hidden_layers=params.num_layers,
        num_attention_heads=params.num_attention_heads,
        num_key_value_heads=params.num_key_value_heads,
        head_dim=params.head_dim,
        rope_theta=params.rope_theta,
        rms_norm_eps=params.rms_norm_eps,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    with torch.device(device):  # not meta: transformers computes its RoPE buffers at construction
        hf = Qwen3ForCausalLM(config).to(dtype)
    hf.load_state_dict(hf_state, strict=True)
    hf = hf.eval()
    return ours, hf


class OutOfTime(Exception):
    """The --max-seconds budget is spent: the rows measured so far are printed; the rest are skipped."""


class Clock:
    """The whole command's time budget (`--max-seconds`): a configuration starts only if it is likely to finish."""

    def __init__(self, max_seconds: float) -> None:
        self.start = time.perf_counter()
        self.max_seconds = max_seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.max_seconds - self.elapsed()


def timed(
    run: Callable[[], list[list[int]]], device: torch.device, repeats: int, clock: Clock
) -> tuple[float, list[list[int]], int]:
    """Median seconds of `repeats` runs after a warm-up (and compilation); fewer repeats when the budget would not
    hold them all (at least one). Returns the median, the last tokens and the repeats made."""
    if clock.left() <= 0:
        raise OutOfTime
    tokens = run()  # warm-up (and compilation)
    seconds: list[float] = []
    for _ in range(repeats):
        if seconds and clock.left() < max(seconds) * 1.2:
            break
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        tokens = run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - begin)
    return statistics.median(seconds), tokens, len(seconds)


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Mean fraction of each row's tokens before the first difference."""
    fractions = []
    for a, b in zip(ours, theirs, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        fractions.append(same / len(a))
    return statistics.mean(fractions)


def say(line: str) -> None:
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per row after the warm-up")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, prompt 16, 8 new tokens (smoke run)")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=360.0,
        help="stop starting rows after this long (rows measured so far are printed as they finish)",
    )
    args = parser.parse_args()
    clock = Clock(args.max_seconds)
    device = torch.device(args.device)
    params, dtype = (tiny(DENSE), torch.float32) if args.tiny else (DENSE, torch.bfloat16)
    prompt, new = (16, 8) if args.tiny else (args.prompt, args.new_tokens)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    say(f"# {device_name}, torch {torch.__version__}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d}")
    say(f"# prompt {prompt}, {new} new tokens, {'tiny' if args.tiny else 'dense anchor (Qwen3-0.6B shape)'}, {dtype}")
    ours, hf = build_models(params, device, dtype)
    say(f"# models built in {clock.elapsed():.1f} s; a row: a warm-up (compiles), up to {args.repeats} timed runs")
    say("| run | batch | generated tokens/s | seconds | timed runs | peak GiB | greedy tokens equal to HF |")
    say("|---|---|---|---|---|---|---|")
    rows = []
    for batch in args.batches:
        ids = torch.randint(0, params.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(batch))
        prompts = ids.tolist()

        def run_hf(ids: torch.Tensor = ids) -> list[list[int]]:
            with torch.no_grad():
                out = hf.generate(
                    ids.to(device),
                    attention_mask=torch.ones_like(ids, device=device),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            return out[:, prompt:].tolist()

        runs: dict[str, Callable[[], list[list[int]]]] = {"transformers generate (eager, DynamicCache)": run_hf}
        for compiled in (False, True) if not args.no_compile else (False,):
            config = GenerationConfig(max_new_tokens=new, compile=compiled)
            label = f"d9d generate ({'torch.compile' if compiled else 'eager'}, static KV cache)"
            runs[label] = lambda config=config, prompts=prompts: generate(ours, prompts, config).tokens
        reference: list[list[int]] | None = None
        for label, run in runs.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                seconds, tokens, made = timed(run, device, args.repeats, clock)
            except OutOfTime:
                say(f"| {label} | {batch} | skipped: --max-seconds {args.max_seconds:.0f} spent | | | | |")
                continue
            if label.startswith("transformers"):
                reference = tokens  # HF's greedy tokens: what each d9d row is compared with
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
            row = {
                "run": label,
                "batch": batch,
                "tokens_per_s": batch * new / seconds,
                "seconds": seconds,
                "timed_runs": made,
                "peak_gib": peak,
                "greedy_agreement_with_hf": agreement(tokens, reference) if reference is not None else float("nan"),
            }
            rows.append(row)
            say(
                f"| {label} | {batch} | {row['tokens_per_s']:,.0f} | {seconds:.2f} | {made} | {peak:.1f} | "
                f"{row['greedy_agreement_with_hf']:.0%} |"
            )
    say(f"# done in {clock.elapsed():.0f} s")
    say(json.dumps(rows))


if __name__ == "__main__":
    main()
