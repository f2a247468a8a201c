"""A d9d causal LM as an lm-evaluation-harness language model (`lm_eval`, an optional extra: `d9d-models[eval]`).

This module imports `lm_eval` when it is imported; nothing else in d9d imports it, so the harness stays optional.

    from d9d.models.generation.harness import D9dHarnessLM, TokenizersCodec
    lm = D9dHarnessLM(model, TokenizersCodec(tokenizer), max_length=2048, batch_size=16)
    results = lm_eval.simple_evaluate(model=lm, tasks=[...])

Scoring (`loglikelihood`, `loglikelihood_rolling`) runs the whole model forward over right-padded batches (the
causal mask makes padding after a row invisible to it) and sums the log-probabilities of the continuation tokens;
`generate_until` runs `generate` with the request's stop strings. Context and continuation are encoded separately,
so the continuation's tokens are exactly what the tokenizer makes of the continuation text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn
from torch.nn import functional

from d9d.models.generation.generate import GenerationConfig, check_whole_sequences, generate
from d9d.models.generation.sampling import SamplingConfig
from d9d.parallel import compute_device


class TextCodec(Protocol):
    """Text to token ids and back, and the token that ends a document (the prefix of an empty context)."""

    @property
    def eos_token_id(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class TokenizersCodec:
    """A `tokenizers.Tokenizer` (what the data-prep stage trains or loads) as a `TextCodec`, without special tokens
    added, as the shards were tokenized."""

    def __init__(self, tokenizer: Any, *, eos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self._eos = eos_token_id if eos_token_id is not None else _find_eos(tokenizer)

    @property
    def eos_token_id(self) -> int:
        return self._eos

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        return text


def _find_eos(tokenizer: Any) -> int:
    for name in ("<|endoftext|>", "</s>", "<eos>", "<|im_end|>"):
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    raise ValueError("the tokenizer has none of <|endoftext|>, </s>, <eos>, <|im_end|>; pass eos_token_id")


@dataclass(frozen=True)
class _Scored:
    logprob: float
    is_greedy: bool


class D9dHarnessLM(LM):  # type: ignore[misc]  # lm_eval ships no type information
    """`model`: a whole causal LM of the catalogue on its device (eval mode is set). `max_length`: the longest
    sequence one forward sees (longer contexts lose their oldest tokens). `batch_size`: requests per forward.

    An FSDP-sharded or tensor-parallel model (`TensorParallelConfig(sequence_parallel=False)`) works when every rank
    of `process_group` runs the same requests (lm_eval sees one process: `rank` 0, `world_size` 1): scoring then
    makes the same forwards everywhere (a tp model's logits come back whole on each rank), and generation keeps
    stepping until every rank has stopped."""

    def __init__(
        self,
        model: nn.Module,
        codec: TextCodec,
        *,
        max_length: int = 2048,
        batch_size: int = 8,
        max_gen_toks: int = 256,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if max_length < 2:
            raise ValueError(f"max_length={max_length} must be at least 2 (a context token and a target)")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        check_whole_sequences(model)
        self.model = model.eval()
        self.codec = codec
        self.max_length, self.batch_size, self.max_gen_toks = max_length, batch_size, max_gen_toks
        self._device = compute_device(model)  # the GPU for CPU-offloaded FSDP shards, not their CPU
        self.process_group = process_group

    @property
    def tokenizer_name(self) -> str:
        return type(self.codec).__name__

    # Scoring

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = request.args
            context_ids = self.codec.encode(context) if context else [self.codec.eos_token_id]
            pairs.append((context_ids, self.codec.encode(continuation)))
        return [(scored.logprob, scored.is_greedy) for scored in self.score_pairs(pairs)]

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            for window in get_rolling_token_windows(
                token_list=self.codec.encode(text),
                prefix_token=self.codec.eos_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            ):
                windows.append(make_disjoint_window(window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, scored in zip(owners, self.score_pairs(windows), strict=True):
            totals[owner] += scored.logprob
        return totals

    def score_pairs(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[_Scored]:
        """Log-probability of each continuation after its context (and whether greedy decoding would produce it),
        longest first in batches of `batch_size`, returned in the given order."""
        if any(not continuation for _, continuation in pairs):
            raise ValueError("a continuation encodes to no tokens; lm_eval requests must score some text")
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        results: list[_Scored | None] = [None] * len(pairs)
        for chunk in _chunks(order, self.batch_size):
            for index, scored in zip(chunk, self._score_batch([pairs[i] for i in chunk]), strict=True):
                results[index] = scored
        return [scored for scored in results if scored is not None]

    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[_Scored]:
        # The model reads every token but the last; the last max_length of them (oldest context dropped).
        inputs = [(context + continuation)[:-1][-self.max_length :] for context, continuation in pairs]
        width = max(len(ids) for ids in inputs)
        padded = torch.zeros(len(inputs), width, dtype=torch.long)
        for row, ids in enumerate(inputs):
            padded[row, : len(ids)] = torch.tensor(ids)
        with torch.no_grad():
            logits = self.model(padded.to(self._device)).logits.float()
        log_probs = functional.log_softmax(logits, dim=-1)
        scored = []
        for row, (ids, (_, continuation)) in enumerate(zip(inputs, pairs, strict=True)):
            # Position t predicts token t + 1: the continuation's predictions are the last len(continuation).
            span = log_probs[row, len(ids) - len(continuation) : len(ids)]
            target = torch.tensor(continuation, device=span.device)
            logprob = span.gather(-1, target[:, None]).sum()
            scored.append(_Scored(float(logprob), bool((span.argmax(-1) == target).all())))
        return scored

    # Generation

    def generate_until(self, requests: list[Any]) -> list[str]:
        outputs: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            config = self._generation_config(kwargs)
            budget = self.max_length - config.max_new_tokens
            for chunk in _chunks(indices, self.batch_size):
                prompts = [
                    (self.codec.encode(requests[i].args[0]) or [self.codec.eos_token_id])[-budget:] for i in chunk
                ]
                result = generate(
                    self.model, prompts, config, decode=self.codec.decode, process_group=self.process_group
                )
                for index, text in zip(chunk, result.texts or [], strict=True):
                    outputs[index] = text
        return [text or "" for text in outputs]

    def _generation_config(self, kwargs: dict[str, Any]) -> GenerationConfig:
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0))
        top_k, top_p = kwargs.pop("top_k", None), kwargs.pop("top_p", None)
        if kwargs:
            raise ValueError(
                f"unsupported generation arguments {sorted(kwargs)}; this adapter knows until, "
                "max_gen_toks, do_sample, temperature, top_k, top_p"
            )
        sampling = (
            SamplingConfig(do_sample=True, temperature=temperature or 1.0, top_k=top_k, top_p=top_p)
            if do_sample and temperature != 0.0
            else SamplingConfig()
        )
        if max_new >= self.max_length:
            raise ValueError(f"max_gen_toks={max_new} leaves no room for a prompt within max_length={self.max_length}")
        return GenerationConfig(
            max_new_tokens=max_new,
            sampling=sampling,
            stop_strings=[stop for stop in until if stop],
            stop_token_ids=[self.codec.eos_token_id],
        )


def _chunks(items: Sequence[int], size: int) -> Iterable[list[int]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])
