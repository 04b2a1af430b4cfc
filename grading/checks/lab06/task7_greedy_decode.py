"""Task 7's checks: ``greedy_decode`` driving a model that answers from a recording of the reference's greedy
path, so that the check counts the loop's model calls and tokens and sees where it leaves the path."""

from __future__ import annotations

import random

from grading.checks.common import reference
from grading.checks.model_cases import TINY, tiny_model, tiny_prompts
from grading.registry import Check, Mismatch, register

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
        hint=TIE_HINT if ties else "",
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
                    hint=TIE_HINT,
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
                hint=PREFILL_ONCE_HINT,
            )
        if g["calls_with_grad"]:
            return Mismatch(
                "greedy_decode ran the model with gradient recording on",
                f"on {where}: {g['calls_with_grad']} of {g['calls']} model calls recorded gradients",
                hint=NO_GRAD_HINT,
            )
    return None


TIE_HINT = (
    "here the model's two highest logits are equal at every step, and greedy decoding must still be "
    "deterministic: of the ids that share the highest logit it takes the lowest, the one torch.argmax "
    "returns."
)
PREFILL_ONCE_HINT = (
    "prefill is one model call over the whole prompt, [1, len(prompt)], which fills the cache with "
    "every prompt position at once; feeding the prompt a token at a time gives the same cache in "
    "len(prompt) calls, each a matrix-vector product where one matrix product would do."
)
NO_GRAD_HINT = (
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
    """The fields task 7's checks share, with their own inputs."""
    return dict(
        task="lab06 task 7: greedy_decode",
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
