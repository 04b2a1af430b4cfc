"""Speculative decoding: a cheap draft guesses γ tokens, the target checks them in one pass.

One step, with the target's cache holding every token but the last:

    draft:   d_1 .. d_γ ~ q            (γ cheap forward passes, or a lookup in the text so far)
    target:  one forward over [last, d_1 .. d_γ] -> p_1 .. p_{γ+1}   (γ + 1 positions at once)
    accept:  d_i with probability min(1, p_i(d_i) / q_i(d_i)), left to right
    reject:  at the first rejection, draw from norm(max(0, p_i - q_i)) and stop
    bonus:   if all γ are accepted, draw one more token from p_{γ+1}

The output is distributed exactly as the target sampling alone would (Leviathan et al., 2023;
Chen et al., 2023): the draft changes the speed, never the text. With greedy sampling p and q
are one-hot and the rule reduces to "keep the draft's tokens while they equal the target's
argmax". Each step emits between 1 and γ + 1 tokens for one target pass; both caches are rolled
back to exactly the accepted prefix.

With acceptance rate a (per token, assumed independent) the expected tokens per target pass is
E = (1 - a^(γ+1)) / (1 - a), and with c = cost of a draft pass / cost of a target pass the
predicted speedup over plain decoding is E / (γc + 1).

Drafts:
* ``LayerSkipDraft``: self-speculative, the target's first k decoder layers with its own final
  norm and head (no extra weights; c ≈ k / n_layers).
* ``NgramDraft``: prompt lookup, the tokens that followed the latest earlier occurrence of the
  last n tokens (no model at all; c ≈ 0; strong when the answer repeats the prompt).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from infra_lib.model.cache import DenseKVCache
from infra_lib.model.model import Llama
from infra_lib.model.sampling import SamplingParams, probabilities


def accept_or_resample(
    p: torch.Tensor, q: torch.Tensor, draft_tokens: list[int], generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """The speculative acceptance rule for one step.

    Args:
        p: the target's distributions ``[γ + 1, vocab]``: row i is for the position of draft token i
            (row γ, after the last draft token, gives the bonus token).
        q: the draft's distributions ``[γ, vocab]`` (a deterministic draft: one-hot rows).
        draft_tokens: the γ proposed token ids.
        generator: the random source (uniform draws and the resample).
    Returns:
        (accepted draft tokens, the next token): the resampled token at the first rejection, or
        the bonus token drawn from ``p[γ]`` when every draft token was accepted.
    """
    gamma = len(draft_tokens)
    if p.dim() != 2 or q.dim() != 2 or p.shape[0] != gamma + 1 or q.shape != (gamma, p.shape[1]):
        raise ValueError(
            f"expected p [γ+1, vocab] and q [γ, vocab] with γ = {gamma}, got p {list(p.shape)} and q {list(q.shape)}"
        )
    accepted: list[int] = []
    for i, token in enumerate(draft_tokens):
        p_x, q_x = float(p[i, token]), float(q[i, token])
        u = float(torch.rand((), generator=generator))
        if q_x > 0 and u < min(1.0, p_x / q_x):
            accepted.append(int(token))
            continue
        residual = torch.clamp(p[i] - q[i], min=0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]  # p == q: a rejection cannot happen; guard anyway
        return accepted, int(torch.multinomial(dist, 1, generator=generator))
    return accepted, int(torch.multinomial(p[gamma], 1, generator=generator))


def expected_tokens_per_step(acceptance: float, gamma: int) -> float:
    """E = (1 - a^(γ+1)) / (1 - a): tokens one target pass yields on average (γ + 1 when a = 1), a float.

    Raises:
        ValueError: ``acceptance`` lies outside [0, 1] (the ints 0 and 1 are inside) or ``gamma`` is negative.
    """
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance must lie in [0, 1], got {acceptance}; pass the chance a draft token is kept")
    if gamma < 0:
        raise ValueError(f"gamma must be an int >= 0, got {gamma}; pass the number of draft tokens per step")
    if acceptance == 1:
        return float(gamma + 1)
    return float((1 - acceptance ** (gamma + 1)) / (1 - acceptance))


def predicted_speedup(acceptance: float, gamma: int, cost_ratio: float) -> float:
    """E / (γc + 1): the speedup over plain decoding with a draft pass costing c target passes."""
    return expected_tokens_per_step(acceptance, gamma) / (gamma * cost_ratio + 1)


# --- drafts ------------------------------------------------------------------------------------


class LayerSkipDraft:
    """The target's first ``num_layers`` decoder layers, its final norm and its head, as a draft.

    It shares every weight with the target (no memory), keeps its own KV cache, and rolls the
    cache back to the longest prefix it shares with the sequence it is asked to continue.
    """

    def __init__(self, target: Llama, num_layers: int, capacity: int | None = None):
        n = target.config.n_layers
        if not 1 <= num_layers < n:
            raise ValueError(f"num_layers must lie in [1, {n - 1}] for a {n}-layer target, got {num_layers}")
        from dataclasses import replace

        from infra_lib.model.loaders import without_init

        config = replace(target.config, n_layers=num_layers)
        # A one-layer shell with untouched (undrawn) weights, every module then replaced by the
        # target's; the meta device would do as well but pulls in torch's Python meta kernels,
        # seconds on their first use.
        with without_init():
            model = Llama(replace(config, n_layers=1), target.attention_fn)
        model.config = config
        model.embed_tokens, model.norm, model.lm_head = target.embed_tokens, target.norm, target.lm_head
        model.layers = nn.ModuleList(target.layers[:num_layers])
        model.rope_cos, model.rope_sin = target.rope_cos, target.rope_sin
        self.model, self.num_layers = model.eval(), num_layers
        weight = target.embed_tokens.weight
        self.cache = DenseKVCache.for_model(config, capacity=capacity, dtype=weight.dtype, device=weight.device)
        self.cached: list[int] = []

    @property
    def name(self) -> str:
        return f"first {self.num_layers} layers"

    @torch.inference_mode()
    def prefill(self, tokens: list[int]) -> None:
        """Cache the prompt before decoding starts (so its cost counts as prefill, not as drafting)."""
        self._sync(tokens)

    def _sync(self, tokens: list[int]) -> None:
        """Make the cache hold ``tokens[:-1]`` (the last token is fed by ``propose``)."""
        keep = 0
        for a, b in zip(self.cached, tokens[:-1]):
            if a != b:
                break
            keep += 1
        self.cache.truncate(keep)
        self.cached = self.cached[:keep]
        rest = tokens[keep:-1]
        if rest:
            self.model(torch.tensor([rest], device=self.cache.layers[0].k.device), self.cache, last_only=True)
            self.cached += rest

    @torch.inference_mode()
    def propose(
        self, tokens: list[int], gamma: int, params: SamplingParams, generator: torch.Generator | None = None
    ) -> tuple[list[int], torch.Tensor]:
        """``gamma`` draft tokens continuing ``tokens`` and their distributions ``[gamma, vocab]``."""
        self._sync(tokens)
        last, out, dists = tokens[-1], [], []
        device = self.cache.layers[0].k.device
        for _ in range(gamma):
            logits = self.model(torch.tensor([[last]], device=device), self.cache)[0, -1]
            self.cached.append(last)
            q = probabilities(logits, params)
            last = int(q.argmax()) if params.greedy else int(torch.multinomial(q, 1, generator=generator))
            out.append(last)
            dists.append(q)
        return out, torch.stack(dists) if dists else torch.zeros(0, self.model.config.vocab_size)


class NgramDraft:
    """Prompt lookup: find the latest earlier occurrence of the last ``n`` tokens (trying n = ``max_n``
    down to ``min_n``) and propose the tokens that followed it; deterministic (one-hot q)."""

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.vocab_size, self.max_n, self.min_n = vocab_size, max_n, min_n

    @property
    def name(self) -> str:
        return f"{self.max_n}-gram lookup"

    def prefill(self, tokens: list[int]) -> None:
        """Nothing to cache: the lookup reads the tokens themselves."""

    def lookup(self, tokens: list[int], gamma: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence first, not the tail itself
                if tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + gamma]
        return []

    def propose(
        self, tokens: list[int], gamma: int, params: SamplingParams, generator: torch.Generator | None = None
    ) -> tuple[list[int], torch.Tensor]:
        found = self.lookup(tokens, gamma)
        q = torch.zeros(len(found), self.vocab_size)
        if found:
            q[torch.arange(len(found)), torch.tensor(found)] = 1.0
        return found, q


# --- the loop ----------------------------------------------------------------------------------


@dataclass
class SpeculativeResult:
    """The generated tokens and how the draft fared.

    Attributes:
        token_ids: the generated tokens (prompt excluded).
        target_passes: target forward passes after the prefill (one per step).
        proposed / accepted: draft tokens proposed and accepted over all steps.
        rejections: steps that ended in a rejected draft token (the others accepted all they were given).
        accepted_per_step: accepted draft tokens of each step.
        draft_seconds / target_seconds: time in the draft's proposals and in the target's passes.
        finish_reason: "stop" (a stop token) or "length".
    """

    token_ids: list[int] = field(default_factory=list)
    target_passes: int = 0
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0
    finish_reason: str = "length"

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (nan when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def position_acceptance_rate(self) -> float:
        """The chance a draft token that was checked is accepted: accepted / (accepted + rejections).

        This is the a of E = (1 - a^(γ+1)) / (1 - a); ``acceptance_rate`` (accepted / proposed) is
        lower, because the tokens after a rejection are proposed but never checked.
        """
        checked = self.accepted + self.rejections
        return self.accepted / checked if checked else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_per_step) / len(self.accepted_per_step) if self.accepted_per_step else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return len(self.token_ids) / self.target_passes if self.target_passes else float("nan")

    @property
    def decode_seconds(self) -> float:
        return self.draft_seconds + self.target_seconds


@torch.inference_mode()
def speculative_decode(
    target: Llama,
    prompt_ids: list[int],
    draft,
    gamma: int = 4,
    params: SamplingParams = SamplingParams(),
    stop_ids: tuple[int, ...] = (),
    on_step=None,
    accept=None,
) -> SpeculativeResult:
    """Generate with ``target`` from ``prompt_ids``, ``draft`` proposing up to ``gamma`` tokens a step.

    Args:
        draft: ``LayerSkipDraft``, ``NgramDraft`` or anything with ``propose(tokens, gamma, params,
            generator) -> (tokens, q [k, vocab])``; it may propose fewer than ``gamma`` (even none).
        params: sampling (temperature 0: greedy) and ``max_new_tokens``; ``seed`` makes it reproducible.
        stop_ids: tokens that end generation (kept in the output).
        on_step: ``on_step(target_cache, tokens)`` after every step (tests check the rollback there).
        accept: the acceptance rule, ``accept_or_resample``'s signature (None: this module's).
    """
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if not prompt_ids:
        raise ValueError("the prompt needs at least one token")
    weight = target.embed_tokens.weight
    capacity = min(target.config.max_position, len(prompt_ids) + params.max_new_tokens + gamma + 1)
    cache = DenseKVCache.for_model(target.config, capacity=capacity, dtype=weight.dtype, device=weight.device)
    generator = params.generator()
    result = SpeculativeResult()
    tokens = [int(t) for t in prompt_ids]
    start = time.perf_counter()
    if len(tokens) > 1:  # the cache holds every token but the last
        target(torch.tensor([tokens[:-1]], device=weight.device), cache, last_only=True)
    if gamma and hasattr(draft, "prefill"):
        draft.prefill(tokens)
    result.prefill_seconds = time.perf_counter() - start
    stops = set(stop_ids)
    while len(result.token_ids) < params.max_new_tokens:
        room = params.max_new_tokens - len(result.token_ids)
        step_gamma = max(0, min(gamma, room - 1, capacity - len(tokens) - 1))
        t0 = time.perf_counter()
        draft_tokens, q = draft.propose(tokens, step_gamma, params, generator) if step_gamma else ([], None)
        draft_tokens = [int(t) for t in draft_tokens[:step_gamma]]
        q = q[: len(draft_tokens)] if q is not None else torch.zeros(0, target.config.vocab_size)
        t1 = time.perf_counter()
        before = cache.seq_len
        logits = target(torch.tensor([[tokens[-1]] + draft_tokens], device=weight.device), cache)[0]
        p = probabilities(logits, params).to(q.device)
        rule = accept if accept is not None else accept_or_resample
        accepted, next_token = rule(p, q.float(), draft_tokens, generator)
        accepted, next_token = [int(t) for t in accepted], int(next_token)
        if accepted != draft_tokens[: len(accepted)]:
            raise ValueError(
                f"the acceptance rule accepted {accepted}, which is not a prefix of the draft's {draft_tokens}"
            )
        cache.truncate(before + 1 + len(accepted))  # keep the last token and the accepted drafts
        result.draft_seconds += t1 - t0
        result.target_seconds += time.perf_counter() - t1
        result.target_passes += 1
        result.proposed += len(draft_tokens)
        result.accepted += len(accepted)
        result.rejections += len(accepted) < len(draft_tokens)
        result.accepted_per_step.append(len(accepted))
        new = accepted + [next_token]
        for token in new:
            tokens.append(token)
            result.token_ids.append(token)
            if token in stops:
                result.finish_reason = "stop"
                break
        if on_step is not None:
            on_step(cache, list(tokens))
        if result.finish_reason == "stop":
            break
    return result


@torch.inference_mode()
def plain_decode(
    target: Llama, prompt_ids: list[int], params: SamplingParams = SamplingParams(), stop_ids: tuple[int, ...] = ()
) -> SpeculativeResult:
    """The baseline: one target pass per token, through the same loop with no draft."""
    return speculative_decode(target, prompt_ids, NgramDraft(target.config.vocab_size), 0, params, stop_ids)
