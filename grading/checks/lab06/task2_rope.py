"""Task 2's checks: ``rope(x, positions, theta)``, the rotary embedding in the rotate-half layout, on a prefill's
positions and then on any positions (a chunk after a cache, a decode step, the ragged positions of a batched step)."""

from __future__ import annotations

import random

from grading.checks.common import array_mismatch
from grading.checks.lab06.decoder import LLAMA
from grading.checks.lab06.tensors import seeded, tensor_list
from grading.registry import Check, Mismatch, register

_ATOL, _RTOL = 1e-4, 1e-4  # what the lab's text states: angles of positions up to 1000 in float32


def course_rope():
    """The reference as the task's function: the course's RoPE tables at ``positions``, applied to ``x``."""
    from infra_lib.model.model import apply_rope, rope_tables

    def rope(x, positions, theta):
        cos, sin = rope_tables(x.shape[-1], int(positions.max()) + 1, theta)
        return apply_rope(x, cos[positions], sin[positions])

    return rope


course_rope.target = f"{LLAMA}:apply_rope"  # what grading.hidden_reference hides from a sandboxed kernel


def _case(rng: random.Random, batch: int, heads: int, head_dim: int, positions: list[int], theta: float) -> dict:
    return {
        "seed": rng.randrange(10**6),
        "shape": [batch, heads, len(positions), head_dim],
        "positions": positions,
        "theta": theta,
    }


def _prefill_cases(rng: random.Random) -> list[dict]:
    return [
        _case(rng, 1, rng.randint(1, 3), rng.choice([4, 8, 16]), list(range(rng.randint(2, 9))), 10000.0),
        _case(rng, 1, 2, 64, list(range(rng.randint(3, 12))), 100000.0),  # SmolLM2's head_dim and base
    ]


def _any_position_cases(rng: random.Random) -> list[dict]:
    start = rng.randint(5, 400)
    return [
        _case(rng, rng.randint(2, 3), 3, 8, list(range(start, start + rng.randint(2, 6))), 10000.0),  # after a cache
        _case(rng, 2, rng.randint(1, 4), 16, [rng.randint(1, 999)], rng.choice([500.0, 1000.0])),  # one decode step
        _case(rng, 1, 2, 32, rng.sample(range(600), 7), 100000.0),  # ragged: any positions, in any order
        _case(rng, 2, 1, 2, [0, rng.randint(1, 50), rng.randint(51, 300)], 10000.0),  # one pair per head
    ]


def _drive(rope, cases):
    import torch

    out = []
    for c in cases:
        x = seeded(c["seed"], *c["shape"])
        result = rope(x, torch.tensor(c["positions"], dtype=torch.long), c["theta"])
        out.append({"values": tensor_list(result, "rope"), "dtype": str(result.dtype)})
    return out


def describe(c: dict) -> str:
    shown = c["positions"] if len(c["positions"]) <= 8 else f"{c['positions'][:3]} ... {c['positions'][-1]}"
    return f"x of shape {c['shape']} at positions {shown}, theta={c['theta']:g}"


INTERLEAVED_HINT = (
    "the pairs that rotate together are dimension i and dimension i + head_dim/2 (the rotate-half layout), not the "
    "neighbours 2i and 2i + 1: the course's loader has already un-permuted the GGUF file's query and key rows into "
    "this layout, so interleaved pairs rotate the wrong coordinates together."
)
POSITIONS_HINT = (
    "each row is rotated by the angle of its own position, the value in positions, not by its index in x: after "
    "a cache the first new token sits at the cache's length, and a batched step passes positions in any order."
)
THETA_HINT = "the base of the rotation speeds is the theta passed in (the model's config.rope_theta), not a default."


def rotate_mistakes(reference_rope, x, positions, theta) -> dict:
    """hint -> what a rotary embedding with that mistake returns (computed with ``reference_rope``)."""
    import torch

    head_dim = x.shape[-1]
    # interleaved pairs: the reference rotates (i, i + half); reorder so that those are the neighbours (2i, 2i + 1)
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    back = torch.argsort(order)
    return {
        INTERLEAVED_HINT: reference_rope(x[..., order], positions, theta)[..., back],
        POSITIONS_HINT: reference_rope(x, torch.arange(len(positions)), theta),
        THETA_HINT: reference_rope(x, positions, 10000.0 if theta != 10000.0 else 100000.0),
    }


def mistake_hint(got, mistakes: dict) -> str:
    """The hint of the one mistake ``got`` matches, or "" (none, or several alike on this input)."""
    import torch

    got = torch.tensor(got, dtype=torch.float64)
    found = [hint for hint, values in mistakes.items() if torch.allclose(got, values.double(), atol=_ATOL, rtol=_RTOL)]
    return found[0] if len(found) == 1 else ""


def _compare(got, expected, cases):
    import torch

    for c, g, e in zip(cases, got, expected):
        if g["dtype"] != "torch.float32":
            return Mismatch("rope changed the dtype", f"on {describe(c)}: expected torch.float32, got {g['dtype']}")
        problem = array_mismatch(g["values"], e["values"], "rope's output differs", describe(c), _ATOL, _RTOL)
        if problem:
            if "wrong shape" in problem.what:
                return problem
            x, positions = seeded(c["seed"], *c["shape"]), torch.tensor(c["positions"])
            hint = mistake_hint(g["values"], rotate_mistakes(course_rope(), x, positions, c["theta"]))
            return Mismatch(problem.what, problem.detail, hint=hint)
    return None


def rope_parts(make_inputs) -> dict:
    """The fields task 2's checks share, with their own inputs."""
    return dict(
        task="lab06 task 2: rope", reference=course_rope, make_inputs=make_inputs, drive=_drive, compare=_compare
    )


register(
    Check(
        check_id="lab06.rope",
        hint="RoPE turns each pair of coordinates of a query or key by an angle proportional to its position, each "
        "pair at its own speed, the first pair fastest; the pairs are dimension i and i + head_dim/2, and the "
        "result has x's shape and dtype (chapter 06, section “1 · The model on the table”).",
        **rope_parts(_prefill_cases),
    )
)

register(
    Check(
        check_id="lab06.rope_any_positions",
        hint="positions are any non-negative integers, not always 0 .. t-1: tokens after a cache, one decode "
        "step, the ragged positions of a batched step; and batch and heads are any size.",
        **rope_parts(_any_position_cases),
    )
)
