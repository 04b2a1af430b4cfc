"""Task 6's checks: ``cached_attention`` on seeded tensors (prefill, decode, chunks over a cache, MQA to MHA),
then plugged into every layer of the learner's decoder (task 3), whose greedy tokens must be the reference's."""

from __future__ import annotations

import random

from grading.checks.common import array_mismatch, reference
from grading.checks.lab06.decoder import CachedDecoder, build, seeded_weights, smollm2_config, smollm2_model
from grading.checks.lab06.tensors import ATTENTION, seeded, tensor_list
from grading.checks.model_cases import (
    TINY,
    case_prompts,
    greedy_through,
    in_model_comparison,
    smollm2_case,
    tiny_model_case,
)
from grading.registry import Check, Mismatch, register

_ATOL = 1e-5

# --- on tensors ---------------------------------------------------------------------------------


def _attention_case(
    rng: random.Random, past: int, new: int, steps: int = 1, n_kv: int | None = None, group: int | None = None
) -> dict:
    return {
        "seed": rng.randrange(10**6),
        "batch": rng.randint(1, 2),
        "n_kv_heads": n_kv or rng.randint(1, 3),
        "group": group or rng.choice([1, 2, 3]),
        "head_dim": rng.choice([4, 8, 16]),
        "past": past,
        "new": new,
        "steps": steps,
    }


def _prefill_cases(rng):
    return [_attention_case(rng, 0, rng.randint(2, 9)) for _ in range(3)] + [_attention_case(rng, 0, 1)]


def _decode_cases(rng):
    return [_attention_case(rng, rng.randint(1, 10), 1, steps=3) for _ in range(3)]


def _chunked_gqa_cases(rng):
    return [
        _attention_case(rng, rng.randint(2, 8), rng.randint(2, 5), steps=2, n_kv=1, group=4),  # MQA
        _attention_case(rng, rng.randint(2, 8), rng.randint(2, 5), steps=2, n_kv=3, group=1),  # MHA
        _attention_case(rng, rng.randint(2, 8), rng.randint(2, 5), steps=2, n_kv=3, group=3),
    ]  # SmolLM2's 9/3


def _describe_attention(c) -> str:
    n_heads = c["n_kv_heads"] * c["group"]
    return (
        f"batch={c['batch']}, n_heads={n_heads}, n_kv_heads={c['n_kv_heads']}, head_dim={c['head_dim']}, "
        f"{c['past']} tokens already cached, then {c['steps']} call(s) with t={c['new']}"
    )


def _drive_attention(cached_attention, cases):
    """Each call's output and the cache length after it; the cache starts with ``past`` tokens."""
    from infra_lib.model.cache import DenseLayerCache

    results = []
    for c in cases:
        b, kv, d = c["batch"], c["n_kv_heads"], c["head_dim"]
        h = kv * c["group"]
        total = c["past"] + c["new"] * c["steps"]
        keys, values, queries = (seeded(c["seed"] + i, b, kv if i < 2 else h, total, d) for i in range(3))
        cache = DenseLayerCache(b, kv, total, d)
        if c["past"]:
            cache.append(keys[:, :, : c["past"]], values[:, :, : c["past"]])
        steps = []
        for step in range(c["steps"]):
            lo = c["past"] + step * c["new"]
            hi = lo + c["new"]
            out = cached_attention(queries[:, :, lo:hi], keys[:, :, lo:hi], values[:, :, lo:hi], cache)
            steps.append({"out": tensor_list(out, "cached_attention"), "cache_length": cache.length})
        results.append(steps)
    return results


def _compare_attention(got, expected, cases):
    for c, g_steps, e_steps in zip(cases, got, expected):
        where = _describe_attention(c)
        for step, (g, e) in enumerate(zip(g_steps, e_steps)):
            at = f"{where} (call {step + 1})"
            if g["cache_length"] != e["cache_length"]:
                return Mismatch(
                    "the cache holds the wrong number of tokens after cached_attention",
                    f"on {at}: expected {e['cache_length']} tokens cached, found {g['cache_length']}; "
                    "append this call's keys and values exactly once",
                )
            problem = array_mismatch(
                g["out"], e["out"], "cached_attention's output differs from full attention", at, atol=_ATOL, rtol=1e-4
            )
            if problem:
                return problem
    return None


_ATTENTION_HINT = (
    "cached attention must give what attention recomputed over the whole sequence gives at its last t "
    "positions: this call's keys and values enter the cache once, and the queries attend over all s "
    "tokens the cache then holds, each query head reading its group's KV head, with scaled scores and "
    "the causal mask (chapter 06, section “4 · Inside `generate`: prefill and decode by hand”)."
)


def attention_parts(make_inputs) -> dict:
    """The fields task 6's checks on tensors share, with their own inputs."""
    return dict(
        task="lab06 task 6: cached_attention",
        reference=reference(ATTENTION, "cached_attention"),
        make_inputs=make_inputs,
        drive=_drive_attention,
        compare=_compare_attention,
    )


register(
    Check(
        check_id="lab06.cached_attention_prefill",
        hint=_ATTENTION_HINT + " Prefill: the cache starts empty and t = s.",
        **attention_parts(_prefill_cases),
    )
)

register(
    Check(
        check_id="lab06.cached_attention_decode",
        hint=_ATTENTION_HINT
        + " Decode: one new token per call sees every cached key, the earlier calls' as well as its "
        "own.",
        **attention_parts(_decode_cases),
    )
)

register(
    Check(
        check_id="lab06.cached_attention_chunked_gqa",
        hint=_ATTENTION_HINT
        + " Several new tokens on top of a cache are the last t positions, so the mask is offset (a "
        "mask aligned to the top-left, as scaled_dot_product_attention's is_causal is, hides keys they may see); "
        "n_kv_heads may be 1 (MQA) or n_heads (MHA).",
        **attention_parts(_chunked_gqa_cases),
    )
)


# --- plugged into the learner's decoder --------------------------------------------------------


def course_pieces() -> dict:
    """The reference side: the course's decoder and cached attention step, under the names the test cell passes."""
    from infra_lib.model.attention import cached_attention
    from infra_lib.model.model import Llama

    return {"Llama": Llama, "cached_attention": cached_attention}


course_pieces.target = f"{ATTENTION}:cached_attention"  # what grading.hidden_reference hides from a sandboxed kernel


def _drive_in_model(pieces, case):
    """Greedy tokens of the learner's model (task 3) whose every layer attends with their ``cached_attention``, and
    the model's own logits without a cache (which must be the course's before the attention can be judged)."""
    import torch

    from infra_lib.model.config import LlamaConfig

    if type(pieces) is not dict or not {"Llama", "cached_attention"} <= set(pieces):
        raise TypeError(
            'this check takes {"Llama": Llama, "cached_attention": cached_attention}, your class of task 3 and your '
            f"function of task 6, got {type(pieces).__name__}"
        )
    if case["model"] == "tiny":
        config = LlamaConfig(**TINY)
        model, prompts = build(pieces["Llama"], config, seeded_weights(config, case["seed"])), case["prompts"]
    else:
        model, prompts = smollm2_model(pieces["Llama"], case["config"]), case["prompt_ids"]
    with torch.inference_mode():
        own = [model(torch.tensor([prompt]))[0, -1, :8].double().tolist() for prompt in prompts]
    results = greedy_through(CachedDecoder(model, pieces["cached_attention"]), prompts, case["new_tokens"])
    return [{**result, "model_logits": logits} for result, logits in zip(results, own)]


_QUESTIONS = [
    "What is the capital of France?",
    "What is Python?",
    "Name three primary colours.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
]


def _smollm2_case(rng: random.Random) -> dict:
    """A SmolLM2 case with its question encoded here (the graded kernel cannot load the course's model)."""
    case = smollm2_case(rng, 8, _QUESTIONS)
    case["prompt_ids"], case["config"] = case_prompts(case), smollm2_config()
    return case


def _where_in_model(case, prompt) -> str:
    return (
        f"the {'SmolLM2' if case['model'] == 'smollm2' else 'small random'} model, prompt "
        f"{prompt if isinstance(prompt, str) else f'of {len(prompt)} tokens'}"
    )


MODEL_FIRST_HINT = (
    "this check runs your cached_attention inside your Llama of task 3, whose modules already give other logits than "
    "the course's model without a cache (look at its norms, rope and mlp): make task 3's checks pass first, then "
    "come back here."
)

_in_model = in_model_comparison(
    _where_in_model,
    "the model's logits after prefill differ",
    "greedy decoding with your cached_attention produced different tokens",
    lambda got, expected: (1e-3, 1e-4),
)


def _compare_in_model(got, expected, case):
    """The cached run decides; where it differs and the learner's model differs without a cache too, the message
    names the model (task 3) rather than the attention step. (The model's own attention plays no part in the cached
    run, so a slip there costs task 3 alone.)"""
    problem = _in_model(got, expected, case)
    if problem is None:
        return None
    for prompt, g, e in zip(case["prompts"], got, expected):
        where = _where_in_model(case, prompt)
        differs = array_mismatch(g["model_logits"], e["model_logits"], "", where, atol=1e-3, rtol=1e-4)
        if differs:
            return Mismatch(
                "your Llama (task 3) gives other logits than the course's model, with and without a cache",
                f"{problem.detail}; without a cache, {differs.detail.removeprefix(f'on {where}: ')}",
                hint=MODEL_FIRST_HINT,
            )
    return problem


def in_model_parts(make_inputs) -> dict:
    """The fields task 6's checks inside a decoder share, with their own inputs."""
    return dict(
        task="lab06 task 6: cached_attention",
        reference=course_pieces,
        make_inputs=make_inputs,
        drive=_drive_in_model,
        compare=_compare_in_model,
    )


_IN_MODEL_HINT = (
    "prefill calls cached_attention with t = prompt length on an empty cache, then each decode step with "
    "t = 1; if the tensor checks pass but this fails, look at the mask when t > 1."
)

register(
    Check(
        check_id="lab06.cached_attention_in_model",
        hint=_IN_MODEL_HINT,
        **in_model_parts(lambda rng: tiny_model_case(rng, 10)),
    )
)

register(
    Check(
        check_id="lab06.cached_attention_smollm2",
        hint=_IN_MODEL_HINT + " This one runs SmolLM2-135M-Instruct itself.",
        **in_model_parts(_smollm2_case),
    )
)
