"""Cases for the checks that run a model: the small random decoder they share, its prompts, SmolLM2's
prompts, greedy decoding through a model, and the comparison of that decoding with the reference's."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from grading.checks.common import array_mismatch, token_difference
from grading.registry import Mismatch

# The small random decoder's LlamaConfig fields: 6 query heads over 2 KV heads of 8 dimensions, 96 token ids.
TINY = dict(
    vocab_size=96,
    hidden_size=48,
    n_layers=2,
    n_heads=6,
    n_kv_heads=2,
    head_dim=8,
    intermediate_size=96,
    max_position=64,
    rope_theta=1000.0,
)


def tiny_model(seed: int):
    """A small random decoder, the same for every caller with the same seed."""
    import torch

    from infra_lib.model.config import LlamaConfig
    from infra_lib.model.model import Llama

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Llama(LlamaConfig(**TINY))
        for p in model.parameters():  # larger weights than nn.Linear's init: clear winners for argmax
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.35)
    return model.eval()


def tiny_prompts(rng: random.Random, lengths: Iterable[int]) -> list[list[int]]:
    """One prompt of random token ids of the small decoder for each length."""
    return [[rng.randrange(TINY["vocab_size"]) for _ in range(n)] for n in lengths]


def tiny_model_case(rng: random.Random, new_tokens: int) -> dict:
    """A case for the small decoder: its seed, and two prompts, of 1 token and of 3 to 12."""
    return {
        "model": "tiny",
        "seed": rng.randrange(10**6),
        "new_tokens": new_tokens,
        "prompts": tiny_prompts(rng, (1, rng.randint(3, 12))),
    }


def smollm2_case(rng: random.Random, new_tokens: int, prompts: list[str], **extra) -> dict:
    """A case for SmolLM2: one of ``prompts``, as text, and any ``extra`` fields."""
    return {"model": "smollm2", "new_tokens": new_tokens, "prompts": [rng.choice(prompts)], **extra}


def case_model(case: dict):
    """The case's model: the small decoder of its seed, or SmolLM2 (loaded once per process)."""
    if case["model"] == "tiny":
        return tiny_model(case["seed"])
    from infra_lib.model.loaders import load_default

    return load_default().model


def case_prompts(case: dict, chat: bool = True) -> list[list[int]]:
    """The case's prompts as token ids: SmolLM2's texts encoded, as a chat's user turn with ``chat``."""
    if case["model"] == "tiny":
        return case["prompts"]
    from infra_lib.model.loaders import load_default

    tokenizer = load_default().tokenizer
    if chat:
        return [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in case["prompts"]]
    return [tokenizer.encode(p) for p in case["prompts"]]


def greedy_through(model, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Greedy decoding of each prompt through a dense KV cache: ``{"tokens", "first_logits"}``, the
    tokens and the first 8 logits after the prompt."""
    import torch

    from infra_lib.model.cache import DenseKVCache

    results = []
    with torch.inference_mode():
        for prompt in prompts:
            cache = DenseKVCache.for_model(model.config, capacity=len(prompt) + new_tokens)
            logits = model(torch.tensor([prompt]), cache, last_only=True)
            tokens, first_logits = [int(logits[0, -1].argmax())], logits[0, -1, :8].double().tolist()
            while len(tokens) < new_tokens:
                logits = model(torch.tensor([[tokens[-1]]]), cache, last_only=True)
                tokens.append(int(logits[0, -1].argmax()))
            results.append({"tokens": tokens, "first_logits": first_logits})
    return results


def in_model_comparison(
    where: Callable[[dict, object], str],
    logits_differ: str,
    tokens_differ: str,
    tolerance: Callable[[dict, dict], tuple[float, float]],
):
    """The comparison of greedy runs through a model (``greedy_through``'s records) with the reference's:
    the logits after the prompt where the reference recorded them (``tolerance(got, expected)`` gives
    (atol, rtol)), then the tokens. ``where(case, prompt)`` names the input in the message."""

    def compare(got, expected, case):
        for prompt, g, e in zip(case["prompts"], got, expected):
            at = where(case, prompt)
            if "first_logits" in e:
                atol, rtol = tolerance(g, e)
                problem = array_mismatch(g["first_logits"], e["first_logits"], logits_differ, at, atol=atol, rtol=rtol)
                if problem:
                    return problem
            if g["tokens"] != e["tokens"]:
                return Mismatch(tokens_differ, f"on {at}: {token_difference(g['tokens'], e['tokens'])}")
        return None

    return compare
