"""Checks for lab 06 (the KV cache): causal mask, GQA head sharing, the cached attention step,
and a cached greedy decode loop, each compared with the reference on seeded inputs and, plugged
into a real decoder, by the tokens it generates."""

from __future__ import annotations

import random

from grading.checks.common import array_mismatch, reference
from grading.checks.model_cases import (
    TINY,
    case_model,
    case_prompts,
    greedy_through,
    in_model_comparison,
    smollm2_case,
    tiny_model,
    tiny_model_case,
    tiny_prompts,
)
from grading.registry import Check, Mismatch, register, register_shortcuts

register_shortcuts(
    "lab06",
    [
        "infra_lib.model.attention:causal_mask",
        "infra_lib.model.attention:repeat_kv",
        "infra_lib.model.attention:attention",
        "infra_lib.model.attention:cached_attention",
        "infra_lib.model.generation:greedy_decode",
        "infra_lib.model.generation:generate",
        "infra_lib.model.generation:stream",
    ],
)

_ATTENTION = "infra_lib.model.attention"
_ATOL = 1e-5


def _tensor_list(value, who: str) -> list:
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{who} must return a torch.Tensor, got {type(value).__name__}")
    return value.detach().double().tolist()


def _seeded(seed: int, *shape):
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- task 1: causal_mask ------------------------------------------------------------------------


def _prefill_masks(rng: random.Random) -> list[list[int]]:
    return [[1, 1]] + [[n, n] for n in rng.sample(range(2, 12), 4)]


def _offset_masks(rng: random.Random) -> list[list[int]]:
    return [
        [1, rng.randint(2, 20)],
        [1, rng.randint(21, 40)],
        [rng.randint(2, 5), rng.randint(6, 15)],
        [rng.randint(2, 6), rng.randint(7, 12)],
    ]


def _drive_masks(causal_mask, cases):
    import torch

    out = []
    for t, s in cases:
        mask = causal_mask(t, s)
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"causal_mask must return a torch.Tensor, got {type(mask).__name__}")
        out.append({"dtype": str(mask.dtype), "shape": list(mask.shape), "values": mask.int().tolist()})
    return out


def _compare_masks(got, expected, cases):
    for (t, s), g, e in zip(cases, got, expected):
        where = f"causal_mask(t={t}, s={s})"
        if g["dtype"] != "torch.bool":
            return Mismatch("causal_mask must return booleans", f"{where} returned dtype {g['dtype']}")
        if g["shape"] != e["shape"]:
            return Mismatch("causal_mask returned the wrong shape", f"{where}: expected {e['shape']}, got {g['shape']}")
        if g["values"] != e["values"]:
            row = next(i for i, (a, b) in enumerate(zip(g["values"], e["values"])) if a != b)
            return Mismatch(
                "causal_mask hides or shows the wrong keys",
                f"{where}, row {row} (query at position {s - t + row}): expected {e['values'][row]}, "
                f"got {g['values'][row]}",
            )
    return None


register(
    Check(
        check_id="lab06.causal_mask_prefill",
        task="lab06 task 1: causal_mask",
        reference=reference(_ATTENTION, "causal_mask"),
        make_inputs=_prefill_masks,
        drive=_drive_masks,
        compare=_compare_masks,
        hint="causality: a query may see the key at its own position and every earlier one, never a later one, so with "
        "t = s (a prefill) the mask is lower-triangular. Return a torch.bool tensor of shape [t, s], True where "
        "attending is allowed (chapter 06, section “Lab 06”).",
    )
)

register(
    Check(
        check_id="lab06.causal_mask_with_cache",
        task="lab06 task 1: causal_mask",
        reference=reference(_ATTENTION, "causal_mask"),
        make_inputs=_offset_masks,
        drive=_drive_masks,
        compare=_compare_masks,
        hint="with a cache the t queries are the LAST t of the s positions, not the first: every cached key lies in "
        "their past, so the mask's diagonal runs into the bottom-right corner instead of starting at the top-left, "
        "and a decode step (t = 1) sees every key. Rows are queries, columns keys (chapter 06, section “Lab 06”).",
    )
)


# --- task 2: repeat_kv ------------------------------------------------------------------------


def _repeat_cases(rng: random.Random) -> list[dict]:
    cases = [
        {
            "seed": rng.randrange(10**6),
            "batch": rng.randint(1, 2),
            "n_kv_heads": kv,
            "seq": rng.randint(1, 6),
            "head_dim": rng.choice([2, 4, 8]),
            "group": group,
            "dtype": "float32",
        }
        for kv, group in [(rng.randint(2, 3), 3), (1, rng.randint(2, 5)), (rng.randint(2, 4), 1), (3, 2)]
    ]
    cases[rng.choice([0, 1, 3])]["dtype"] = "bfloat16"  # a cache kept in bf16: the copies keep x's dtype
    return cases


def _drive_repeat(repeat_kv, cases):
    import torch

    out = []
    for c in cases:
        x = _seeded(c["seed"], c["batch"], c["n_kv_heads"], c["seq"], c["head_dim"]).to(getattr(torch, c["dtype"]))
        repeated = repeat_kv(x, c["group"])
        out.append({"values": _tensor_list(repeated, "repeat_kv"), "dtype": str(repeated.dtype).removeprefix("torch.")})
    return out


def _describe_repeat(c) -> str:
    return (
        f"x of shape [{c['batch']}, {c['n_kv_heads']}, {c['seq']}, {c['head_dim']}] and dtype {c['dtype']} "
        f"with group={c['group']}"
    )


def _compare_repeat(got, expected, cases):
    for c, g, e in zip(cases, got, expected):
        problem = array_mismatch(
            g["values"],
            e["values"],
            "repeat_kv put the wrong key/value head under a query head",
            _describe_repeat(c),
            atol=0.0,
        )
        if problem:
            return problem
        if g["dtype"] != e["dtype"]:
            return Mismatch(
                "repeat_kv changed the dtype of the keys and values",
                f"on {_describe_repeat(c)}: expected dtype {e['dtype']}, got {g['dtype']}",
                hint="repeating a head copies its numbers, it does not convert them: the result keeps "
                "x's dtype, so a cache kept in bf16 stays bf16 (a new tensor made without x's dtype "
                "gets torch's default, float32).",
            )
    return None


register(
    Check(
        check_id="lab06.repeat_kv",
        task="lab06 task 2: repeat_kv",
        reference=reference(_ATTENTION, "repeat_kv"),
        make_inputs=_repeat_cases,
        drive=_drive_repeat,
        compare=_compare_repeat,
        hint="the query heads that share a KV head are neighbours (the first group of them read KV head 0, the next "
        "group KV head 1), so each KV head's copies must sit side by side, not the whole stack of KV heads tiled group "
        "times. With a group of 1 the heads are unchanged (chapter 06, section “Lab 06”).",
    )
)


# --- task 3: cached_attention on tensors --------------------------------------------------------


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
        keys, values, queries = (_seeded(c["seed"] + i, b, kv if i < 2 else h, total, d) for i in range(3))
        cache = DenseLayerCache(b, kv, total, d)
        if c["past"]:
            cache.append(keys[:, :, : c["past"]], values[:, :, : c["past"]])
        steps = []
        for step in range(c["steps"]):
            lo = c["past"] + step * c["new"]
            hi = lo + c["new"]
            out = cached_attention(queries[:, :, lo:hi], keys[:, :, lo:hi], values[:, :, lo:hi], cache)
            steps.append({"out": _tensor_list(out, "cached_attention"), "cache_length": cache.length})
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
    """The fields task 3's checks on tensors share, with their own inputs."""
    return dict(
        task="lab06 task 3: cached_attention",
        reference=reference(_ATTENTION, "cached_attention"),
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


# --- task 3, plugged into a decoder -------------------------------------------------------------


def _drive_in_model(cached_attention, case):
    """Greedy tokens of a model whose every layer uses ``cached_attention``."""
    model = case_model(case)
    with model.using_attention(cached_attention):
        return greedy_through(model, case_prompts(case), case["new_tokens"])


_QUESTIONS = [
    "What is the capital of France?",
    "What is Python?",
    "Name three primary colours.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
]


def _where_in_model(case, prompt) -> str:
    return (
        f"the {'SmolLM2' if case['model'] == 'smollm2' else 'small random'} model, prompt "
        f"{prompt if isinstance(prompt, str) else f'of {len(prompt)} tokens'}"
    )


def in_model_parts(make_inputs) -> dict:
    """The fields task 3's checks inside a decoder share, with their own inputs."""
    return dict(
        task="lab06 task 3: cached_attention",
        reference=reference(_ATTENTION, "cached_attention"),
        make_inputs=make_inputs,
        drive=_drive_in_model,
        compare=in_model_comparison(
            _where_in_model,
            "the model's logits after prefill differ",
            "greedy decoding with your cached_attention produced different tokens",
            lambda got, expected: (1e-3, 1e-4),
        ),
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
        **in_model_parts(lambda rng: smollm2_case(rng, 8, _QUESTIONS)),
    )
)


# --- task 4: greedy_decode ---------------------------------------------------------------------

# The loop under test drives a model that answers from a record instead of running attention. Where the inputs
# are made (in the grader's process when the kernel is sandboxed, where the reference is a stub), the reference
# greedy_decode runs the small model one token past the case's max_new_tokens, and every row of logits the model
# gave it is recorded by position, with the tokens of that path (the greedy answer). In the kernel each call is
# answered with the recorded rows of the positions it fills, a cache passed in advancing as the model's would. A
# token that leaves that path (another token, a position the path does not reach) has no recorded answer: the
# call raises, and the comparison names the token and where it stood.


class LeftThePath(Exception):
    """A decode loop fed the recording model a token off the greedy answer it was recorded on."""


class _Recorder:
    """The small model, each row of logits it gives recorded by position (in the process that makes inputs)."""

    def __init__(self, model, ties: bool):
        self.model, self.config, self.ties, self.rows = model, model.config, ties, {}

    def __call__(self, tokens, cache=None, last_only=False):
        import torch

        start = cache.seq_len if cache is not None else 0
        with torch.inference_mode():
            logits = _tied(self.model(tokens, cache), self.ties)
        for offset, row in enumerate(logits[0].tolist()):
            self.rows[start + offset] = row
        return logits[:, -1:] if last_only else logits


def _tied(logits, ties: bool):
    """With ``ties`` the two highest logits made equal at every position: greedy takes the lower id."""
    return logits.clamp(max=logits.topk(2, dim=-1).values[..., 1:]) if ties else logits


def _recorded(case: dict) -> dict:
    """The case with, for each prompt, the reference's greedy path one token past ``new_tokens`` and the logits
    the model gave it at each position but the last, and the stop token ``stop_at`` chooses."""
    greedy_decode = reference("infra_lib.model.generation", "greedy_decode")()
    model = tiny_model(case["seed"])
    case["records"] = []
    for prompt in case["prompts"]:
        recorder = _Recorder(model, case.get("ties", False))
        path = list(prompt) + greedy_decode(recorder, list(prompt), case["new_tokens"] + 1, None)
        case["records"].append(
            {
                "path": path,
                "logits": [recorder.rows[p] for p in range(len(path) - 1)],
                "stop_id": None if case["stop_at"] is None else path[len(prompt) + case["stop_at"] - 1],
            }
        )
    return case


class CountingModel:
    """The model a learner's decode loop drives: counts calls, tokens fed in and calls made with gradient
    recording on, and answers each call from the record of the reference's greedy path (``_recorded``)."""

    def __init__(self, record: dict):
        from infra_lib.model.config import LlamaConfig

        self.config = LlamaConfig(**TINY)
        self._path, self._rows = record["path"], record["logits"]
        self.calls, self.tokens_in, self.calls_with_grad = 0, 0, 0
        self.left_path: dict | None = None

    def __call__(self, tokens, cache=None, last_only=False):
        import torch

        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[0] != 1:
            shape = list(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"the model takes tokens as a tensor [1, t], got {shape}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor (torch.long), got {tokens.dtype}")
        self.calls += 1
        self.calls_with_grad += int(torch.is_grad_enabled())
        self.tokens_in += int(tokens.shape[-1])
        start = cache.seq_len if cache is not None else 0
        fed = [int(token) for token in tokens[0].tolist()]
        for offset, token in enumerate(fed):
            position = start + offset
            expected = self._path[position] if position < len(self._rows) else None
            if token != expected:
                self.left_path = {"call": self.calls, "position": position, "fed": token, "expected": expected}
                raise LeftThePath(
                    f"model call {self.calls} fed token {token} at position {position}, off the greedy "
                    "answer the check's model was recorded on"
                )
        if cache is not None:  # the positions these tokens fill, as the model's own layers would append them
            for index in range(self.config.n_layers):
                blank = torch.zeros(1, self.config.n_kv_heads, len(fed), self.config.head_dim)
                cache.layer(index).append(blank, blank)
        rows = self._rows[start : start + len(fed)]
        rows = rows[-1:] if last_only else rows
        return torch.tensor(rows, dtype=torch.float32).reshape(1, len(rows), self.config.vocab_size)


def _draw_decode(rng: random.Random) -> dict:
    return {
        "seed": rng.randrange(10**6),
        "new_tokens": rng.randint(6, 12),
        "prompts": tiny_prompts(rng, (1, rng.randint(3, 12))),
        "stop_at": None,
    }


def _decode_case(rng: random.Random) -> dict:
    return _recorded(_draw_decode(rng))


def _stop_case(rng: random.Random) -> dict:
    case = _draw_decode(rng)
    case["stop_at"] = rng.randint(2, 5)  # the token generated at this step becomes the stop token
    case["ties"] = True  # and the model's two highest logits are equal at every step
    return _recorded(case)


def _drive_decode(greedy_decode, case):
    results = []
    for prompt, record in zip(case["prompts"], case["records"]):
        counted = CountingModel(record)
        try:
            tokens = greedy_decode(counted, list(prompt), case["new_tokens"], record["stop_id"])
        except Exception:
            if counted.left_path is None:
                raise
            tokens = None  # whatever the loop raised after it left the path, leaving it comes first
        if counted.left_path is None and (not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens)):
            raise TypeError(f"greedy_decode must return a list of ints, got {tokens!r:.80}")
        results.append(
            {
                "tokens": tokens,
                "calls": counted.calls,
                "tokens_in": counted.tokens_in,
                "calls_with_grad": counted.calls_with_grad,
                "stop_id": record["stop_id"],
                "prompt_length": len(prompt),
                "left_path": counted.left_path,
            }
        )
    return results


def _left_path(left: dict, expected: list[int], prompt: list[int], where: str, ties: bool) -> Mismatch:
    """What a loop that left the recorded greedy answer fed the model, and where."""
    at, fed, call = left["position"], left["fed"], left["call"]
    if at < len(prompt):
        return Mismatch(
            "greedy_decode fed the model a sequence that does not continue the prompt",
            f"on {where}: model call {call} put token {fed} at position {at}, where the prompt holds {prompt[at]}",
            hint=_CONTINUE_HINT,
        )
    step = at - len(prompt)
    if left["expected"] is None:
        return Mismatch(
            "greedy_decode generated more tokens than max_new_tokens",
            f"on {where}: model call {call} fed back new token {step + 1}; expected {expected}",
        )
    return Mismatch(
        "greedy_decode produced different tokens" + (" where two logits tie for the highest" if ties else ""),
        f"on {where}: the first {step} tokens agree, then new token {step + 1}, fed back to the model in "
        f"call {call}, is {fed} instead of {left['expected']} (expected {expected}); the check's model "
        "answers only along the greedy answer, so the loop stopped there",
        hint=_TIE_HINT if ties else "",
    )


def _compare_decode(got, expected, case):
    ties = case.get("ties", False)
    for prompt, g, e in zip(case["prompts"], got, expected):
        where = (
            f"a prompt of {g['prompt_length']} tokens, max_new_tokens={case['new_tokens']}, stop_id={g['stop_id']}"
            + (", a model whose two highest logits tie at every step" if ties else "")
        )
        if g.get("left_path"):
            return _left_path(g["left_path"], e["tokens"], prompt, where, ties)
        if g["tokens"] != e["tokens"]:
            if ties:
                return Mismatch(
                    "greedy_decode produced different tokens where two logits tie for the highest",
                    f"on {where}: expected {e['tokens']}, got {g['tokens']}",
                    hint=_TIE_HINT,
                )
            return Mismatch(
                "greedy_decode produced different tokens", f"on {where}: expected {e['tokens']}, got {g['tokens']}"
            )
        if g["tokens_in"] != e["tokens_in"]:
            one_more = g["calls"] == e["calls"] + 1 and g["tokens_in"] == e["tokens_in"] + 1
            return Mismatch(
                "greedy_decode fed the model more tokens than a cached loop needs",
                f"on {where}: expected {e['tokens_in']} tokens over {e['calls']} model calls (the prompt once, "
                f"then each new token but the last), got {g['tokens_in']} over {g['calls']} calls",
                hint=_LAST_CALL_HINT if one_more else "",
            )
        if g["calls"] != e["calls"]:
            return Mismatch(
                "greedy_decode called the model another number of times than a cached loop needs",
                f"on {where}: expected {e['calls']} model calls (the whole prompt in one, then one per new "
                f"token but the last), got {g['calls']} (the tokens fed in were right: {g['tokens_in']})",
                hint=_PREFILL_ONCE_HINT,
            )
        if g["calls_with_grad"]:
            return Mismatch(
                "greedy_decode ran the model with gradient recording on",
                f"on {where}: {g['calls_with_grad']} of {g['calls']} model calls recorded gradients",
                hint=_NO_GRAD_HINT,
            )
    return None


_TIE_HINT = (
    "here the model's two highest logits are equal at every step, and greedy decoding must still be "
    "deterministic: of the ids that share the highest logit it takes the lowest, the one torch.argmax "
    "returns."
)
_PREFILL_ONCE_HINT = (
    "prefill is one model call over the whole prompt, [1, len(prompt)], which fills the cache with "
    "every prompt position at once; feeding the prompt a token at a time gives the same cache in "
    "len(prompt) calls, each a matrix-vector product where one matrix product would do."
)
_NO_GRAD_HINT = (
    "nothing in a decode loop is trained: with gradient recording on, every call keeps a graph of its "
    "work alive (through the cache, for the whole answer), costing memory and time; the whole loop runs "
    "with it off, under torch.inference_mode()."
)


_CONTINUE_HINT = (
    "each call's tokens continue the sequence its cache holds: their positions start at the cache's "
    "length, so the decode steps pass the cache the prefill filled (a fresh cache, or none, starts again "
    "at position 0)."
)
_LAST_CALL_HINT = (
    "the answer is complete as soon as its last token is chosen (max_new_tokens reached, or stop_id): "
    "the tokens were right, but your loop ran the model once more to feed that last token back, a call "
    "whose logits nobody reads."
)


def decode_parts(make_inputs) -> dict:
    """The fields task 4's checks share, with their own inputs."""
    return dict(
        task="lab06 task 4: greedy_decode",
        reference=reference("infra_lib.model.generation", "greedy_decode"),
        make_inputs=make_inputs,
        drive=_drive_decode,
        compare=_compare_decode,
    )


register(
    Check(
        check_id="lab06.greedy_decode",
        **decode_parts(_decode_case),
        hint="with a KV cache the model sees the prompt once (the prefill) and then only each new token, because one "
        "cache with room for the prompt and the answer already holds the keys and values of everything before it; "
        "greedy means the most likely token at the last position. Return the generated ids as a list of Python ints "
        "(chapter 06, section “4 · Inside `generate`: prefill and decode by hand”).",
    )
)

register(
    Check(
        check_id="lab06.greedy_decode_stop",
        **decode_parts(_stop_case),
        hint="stop_id ends the answer and is its last token; once the last token is known (stop_id, or max_new_tokens "
        "reached) the loop is over, and running the model once more to feed that token back is work the check "
        "counts as a token too many. stop_id None means never stop early.",
    )
)
