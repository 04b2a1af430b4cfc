"""Choosing the next token from the logits: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token.

    Attributes:
        temperature: 0 means greedy (always the most likely token); above 0, logits are divided
            by it before the softmax (below 1 sharpens, above 1 flattens).
        top_k: keep only the k most likely tokens (0: keep all).
        top_p: keep the smallest set of most likely tokens whose probabilities sum to at least
            top_p (1.0: keep all).
        seed: seeds the random draw, so a sampled answer can be reproduced.
        max_new_tokens: stop after this many generated tokens.
        stop_ids: stop when one of these is generated (the tokenizer's end-of-turn by default).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 64
    stop_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator().manual_seed(self.seed)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits`` ``[batch, vocab]`` with the tokens top-k/top-p drop set to -inf."""
    logits = logits.clone()
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # probability mass of the more likely tokens
        drop_sorted = before >= top_p  # the most likely token always stays (before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``sample`` draws from, ``[..., vocab]``: one-hot on the argmax when greedy,
    else the softmax of the temperature-scaled, top-k/top-p filtered logits."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(torch.float32)
    flat = logits.reshape(-1, logits.shape[-1]).float() / params.temperature
    return torch.softmax(filter_logits(flat, params.top_k, params.top_p), dim=-1).reshape(logits.shape)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids ``[batch]`` from ``logits`` ``[batch, vocab]``."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {list(logits.shape)}")
    if params.greedy:
        return logits.argmax(dim=-1)
    filtered = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(filtered, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
