"""Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingConfig(BaseModel):
    """`do_sample=False`: greedy (argmax; the other fields are ignored). Otherwise logits are divided by
    `temperature`, cut to the `top_k` most likely tokens, then to the smallest set whose probability reaches
    `top_p`, and a token is drawn from what is left with the generation's seeded `torch.Generator`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    do_sample: bool = False
    temperature: float = Field(default=1.0, gt=0.0)
    top_k: int | None = Field(default=None, gt=0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)


def filter_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """`(batch, vocab)` float logits with the tokens `config` excludes set to -inf (temperature applied)."""
    logits = logits.float() / config.temperature
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the most likely token always stays.
        drop_sorted = (cumulative - ordered.softmax(dim=-1)) >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """`(batch,)` token ids chosen from `(batch, vocab)` logits."""
    if not config.do_sample:
        return logits.argmax(dim=-1)
    probabilities = filter_logits(logits, config).softmax(dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)
