"""Lab 09 task 4: the acceptance rule on one-hot (greedy) distributions, where its output is fixed, and the
context that puts a rule into speculative decoding."""

from __future__ import annotations

import contextlib
import random

from grading.checks.common import outcome, reference, unwrap
from grading.checks.lab09.tasks import SPEC, TASKS
from grading.registry import Check, Mismatch, register

# --- task 4: the acceptance rule, plugged into speculative decoding --------------------------------


@contextlib.contextmanager
def using_acceptance_rule(rule):
    """Run ``infra_lib.serving.speculative.speculative_decode`` with ``rule`` as its acceptance rule
    inside the ``with`` block (the loop looks the rule up as a module global at every step)."""
    from infra_lib.serving import speculative

    previous = speculative.accept_or_resample
    speculative.accept_or_resample = rule
    try:
        yield
    finally:
        speculative.accept_or_resample = previous


def as_step(result, vocab: int) -> tuple[list[int] | None, int | None, str]:
    """(accepted, next token, problem) from what a rule returned; problem is "" when well formed."""
    if type(result) not in (tuple, list) or len(result) != 2:
        return None, None, f"returned {type(result).__name__} {str(result)[:60]}, not (accepted, next_token)"
    accepted, token = result
    try:
        accepted = [int(t) for t in accepted]
    except (TypeError, ValueError, RuntimeError):
        return None, None, f"returned accepted = {str(accepted)[:60]}: a list of token ids is needed"
    try:
        token = int(token)
    except (TypeError, ValueError, RuntimeError):
        return accepted, None, f"returned next_token = {str(token)[:60]}: one token id (an int) is needed"
    if not 0 <= token < vocab:
        return accepted, token, f"returned next_token = {token}, outside the vocabulary 0..{vocab - 1}"
    return accepted, token, ""


# one-hot (greedy) distributions: the output is fixed


def _greedy_cases(rng: random.Random) -> list[dict]:
    vocab = rng.randint(6, 10)

    def case(gamma: int, first_miss: int | None, label: str, seeded: bool = True) -> dict:
        target = [rng.randrange(vocab) for _ in range(gamma + 1)]
        draft = list(target[:gamma])
        if first_miss is not None:
            draft[first_miss] = (target[first_miss] + rng.randint(1, vocab - 1)) % vocab
            for i in range(first_miss + 1, gamma):  # after a miss the draft guesses anything
                draft[i] = rng.randrange(vocab)
        return {
            "vocab": vocab,
            "target": target,
            "draft": draft,
            "label": label,
            "seed": rng.randrange(10**6) if seeded else None,
        }

    g = rng.randint(3, 5)
    return [
        case(g, None, "every draft token is the target's choice"),
        case(g, 0, "the first draft token is wrong"),
        case(g, rng.randint(1, g - 1), "a draft token after the first is wrong"),
        case(g, g - 1, "only the last draft token is wrong"),
        case(1, None, "one draft token, the target's choice", seeded=False),
        case(0, None, "no draft tokens (gamma = 0): only the target's token"),
        case(2, 1, "the second of two draft tokens is wrong (no generator: generator=None)", seeded=False),
    ]


def _one_hot(indices: list[int], vocab: int):
    import torch

    if not indices:
        return torch.zeros(0, vocab)
    return torch.nn.functional.one_hot(torch.tensor(indices), vocab).float()


def _drive_greedy(rule, cases: list[dict]) -> list:
    import torch

    results = []
    for case in cases:
        p, q = _one_hot(case["target"], case["vocab"]), _one_hot(case["draft"], case["vocab"])
        p_given, q_given = p.clone(), q.clone()
        generator = torch.Generator().manual_seed(case["seed"]) if case["seed"] is not None else None
        item = outcome(rule, p, q, list(case["draft"]), generator)
        if item[0] == "value":
            accepted, token, problem = as_step(item[1], case["vocab"])
            problem = problem or _not_python_ints(item[1])
            item = [
                "value",
                {"problem": problem}
                if problem
                else {
                    "accepted": accepted,
                    "next": token,
                    "changed": [
                        name
                        for name, now, given in (("p", p, p_given), ("q", q, q_given))
                        if not torch.equal(now, given)
                    ],
                },
            ]
        results.append(item)
    return results


def _not_python_ints(result) -> str:
    """What is not as the task states in a well-formed step: a list of Python ints and a Python int."""
    accepted, token = result
    if type(accepted) is not list:
        return f"returned accepted as a {type(accepted).__name__}: a list is needed"
    wrong = next((t for t in accepted if type(t) is not int), None)
    if wrong is not None:
        return f"returned an accepted token as a {type(wrong).__name__} ({str(wrong)[:40]}): Python ints are needed"
    if type(token) is not int:
        return f"returned next_token as a {type(token).__name__} ({str(token)[:40]}): a Python int is needed"
    return ""


def _describe_greedy(case: dict) -> str:
    return (
        f"{case['label']}: gamma={len(case['draft'])}, one-hot p on the target's tokens {case['target']}, "
        f"one-hot q on the draft tokens {case['draft']}"
    )


def _greedy_problem(case: dict, got: dict, want: dict) -> str:
    draft, target = case["draft"], case["target"]
    k = len(want["accepted"])
    if got["accepted"] != draft[: len(got["accepted"])]:
        return (
            "your accepted tokens are not the draft's first tokens: keep draft tokens in order and stop at the "
            "first rejection"
        )
    if k == len(draft) and got["accepted"] + [got["next"]] == want["accepted"]:
        return (
            "you returned the last accepted draft token as next_token: when all gamma are accepted, return all of "
            "them as accepted, and a bonus token drawn from p[gamma] as next_token"
        )
    if len(got["accepted"]) > k:
        return (
            f"you accepted draft token {k} ({draft[k]}), where the target's token is {target[k]}: p(x) = 0 "
            "there, so min(1, p(x) / q(x)) = 0 and it must be rejected"
        )
    if len(got["accepted"]) < k or (
        len(got["accepted"]) < len(draft) and draft[len(got["accepted"])] == target[len(got["accepted"])]
    ):
        i = len(got["accepted"])
        return (
            f"you rejected draft token {i} ({draft[i]}), which is the target's token: p(x) = q(x) = 1 there, "
            "so it is accepted with probability 1 (accept when u < p(x) / q(x), u from torch.rand)"
        )
    if k == len(draft):
        if draft and got["next"] == draft[-1]:
            return (
                "after accepting every draft token you returned the last one again: the next token is the bonus "
                "token, drawn from p[gamma], the target's row after the last draft token"
            )
        earlier = " (the target's token of an earlier position)" if got["next"] in target[:-1] else ""
        return (
            f"every draft token was accepted, so the next token is the bonus drawn from p[gamma], the row after "
            f"the last draft token (here the target's token {target[-1]}); yours is {got['next']}{earlier}"
        )
    if got["next"] in target[k + 1 :] and got["next"] != target[k]:
        return (
            f"draft token {k} was rejected, so the step ends there with a token from max(0, p[{k}] - q[{k}]) "
            f"(here {target[k]}); your next token is the target's token of a later position: stop at the first "
            "rejection"
        )
    if got["next"] == draft[k]:
        return (
            "at the rejection you returned the rejected draft token: draw the replacement from "
            "max(0, p - q), normalised (here the target's token)"
        )
    return (
        f"at the rejection of draft token {k} the replacement comes from max(0, p[{k}] - q[{k}]), normalised: "
        f"here the target's token {target[k]}"
    )


def _compare_greedy(got, expected, cases):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        where = _describe_greedy(case)
        (got_kind, value), (_, want) = unwrap(g), unwrap(e)
        if got_kind == "raised":
            return Mismatch(
                f"accept_or_resample raised {str(value).split(':')[0]}", f"on {where}: your code raised {value}"
            )
        if got_kind != "value" or type(value) is not dict:
            return Mismatch("the check recorded a malformed result", f"on {where}: {g!r:.80}")
        if value.get("problem"):
            return Mismatch(
                "accept_or_resample must return (accepted, next_token): a list of accepted draft token "
                "ids and one token id",
                f"on {where}: your function {value['problem']}",
            )
        if value.get("changed"):
            return Mismatch(
                "accept_or_resample changed its inputs in place",
                f"on {where}: {' and '.join(value['changed'])} differed after the call; the loop reads "
                "them again, so the rule must leave them as it got them",
            )
        if value != want:
            return Mismatch(
                "accept_or_resample gave the wrong step on one-hot (greedy) distributions",
                f"on {where}: expected accepted={want['accepted']}, next_token={want['next']}; got "
                f"accepted={value['accepted']}, next_token={value['next']}\n  " + _greedy_problem(case, value, want),
            )
    return None


ACCEPT_HINT = (
    "draft tokens are checked in order, each kept with probability min(1, p/q) at its own position; the "
    "first rejection ends the step with a replacement drawn from the target's leftover mass (where p "
    "exceeds q), and when every draft token is kept a bonus token comes from the target's row after the "
    "last one (chapter 09, section “2 · The acceptance rule”). Return the kept draft tokens as a list and "
    "the next token, all as Python ints, and take every random draw from the given generator, which may "
    "be None."
)


register(
    Check(
        check_id="lab09.accept_greedy",
        task=TASKS[4],
        reference=reference(SPEC, "accept_or_resample"),
        make_inputs=_greedy_cases,
        drive=_drive_greedy,
        compare=_compare_greedy,
        hint=ACCEPT_HINT + " With one-hot p and q, a draft token is kept exactly when it is the target's "
        "token, and the replacement or bonus is the target's token.",
    )
)
