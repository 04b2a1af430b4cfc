"""Task 1's checks: ``rms_norm(x, weight, eps)`` on seeded vectors, then on the edges where eps and the mean matter."""

from __future__ import annotations

import random

from grading.checks.common import array_mismatch
from grading.checks.lab06.decoder import LLAMA
from grading.checks.lab06.tensors import seeded, tensor_list
from grading.registry import Check, Mismatch, register

_ATOL, _RTOL = 1e-5, 1e-4  # what the lab's text states


def course_rms_norm():
    """The reference as the task's function: the course's RMSNorm module holding ``weight``."""
    import torch

    from infra_lib.model.model import RMSNorm

    def rms_norm(x, weight, eps):
        norm = RMSNorm(weight.shape[-1], eps)
        with torch.no_grad():
            norm.weight.copy_(weight)
        return norm(x)

    return rms_norm


course_rms_norm.target = f"{LLAMA}:RMSNorm"  # what grading.hidden_reference hides from a sandboxed kernel


def _case(rng: random.Random, shape: list[int], scale: float = 1.0, offset: float = 0.0, eps: float = 1e-5) -> dict:
    return {"seed": rng.randrange(10**6), "shape": shape, "scale": scale, "offset": offset, "eps": eps}


def _plain_cases(rng: random.Random) -> list[dict]:
    d = rng.choice([8, 16, 48])
    return [
        _case(rng, [rng.randint(1, 4), d]),
        _case(rng, [rng.randint(1, 3), rng.randint(1, 5), d], eps=1e-6),
        _case(rng, [2, rng.randint(2, 6), rng.choice([4, 64])], scale=3.0),
    ]


def _edge_cases(rng: random.Random) -> list[dict]:
    return [
        _case(rng, [3, rng.choice([16, 32])], scale=1e-3),  # mean(x^2) of the order of eps: eps decides
        _case(rng, [2, 3, 24], eps=rng.choice([0.25, 1.0])),  # a large eps
        _case(rng, [4, 8], offset=rng.choice([-2.0, 3.0])),  # vectors far from zero mean: no mean is subtracted
        _case(rng, [5, 1]),  # one channel
        _case(rng, [2, 2, 3, 12], scale=0.01, eps=1e-6),  # four leading dimensions
    ]


def _inputs(case: dict):
    """x and weight of a case, the same on both sides."""
    x = seeded(case["seed"], *case["shape"]) * case["scale"] + case["offset"]
    weight = seeded(case["seed"] + 1, case["shape"][-1])
    return x, weight


def _drive(rms_norm, cases):
    out = []
    for c in cases:
        x, weight = _inputs(c)
        result = rms_norm(x, weight, c["eps"])
        out.append({"values": tensor_list(result, "rms_norm"), "dtype": str(result.dtype)})
    return out


def _describe(c: dict) -> str:
    spread = f"normal values times {c['scale']:g}" + (f" plus {c['offset']:g}" if c["offset"] else "")
    return f"x of shape {c['shape']} ({spread}), eps={c['eps']:g}"


NO_EPS_HINT = (
    "eps is part of the contract, not a detail: it is added to the mean of the squares before the root is taken, "
    "so it decides the result where the activations are as small as eps, and a large eps shrinks every vector."
)
MEAN_HINT = (
    "RMSNorm subtracts no mean (that is LayerNorm): each vector is divided by its root mean square as it is, so a "
    "vector far from zero mean keeps its offset."
)


def _mistake(c: dict, got) -> str:
    """The hint of the mistake the learner's output matches, if it matches one."""
    import torch

    x, weight = _inputs(c)
    got = torch.tensor(got, dtype=torch.float64)
    x = x.double()
    mistakes = {
        NO_EPS_HINT: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * weight,
        MEAN_HINT: (x - x.mean(-1, keepdim=True))
        * torch.rsqrt((x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + c["eps"])
        * weight,
    }
    for hint, values in mistakes.items():
        if torch.allclose(got, values, atol=_ATOL, rtol=_RTOL, equal_nan=False):
            return hint
    return ""


def _compare(got, expected, cases):
    for c, g, e in zip(cases, got, expected):
        if g["dtype"] != "torch.float32":
            return Mismatch(
                "rms_norm changed the dtype", f"on {_describe(c)}: expected torch.float32, got {g['dtype']}"
            )
        problem = array_mismatch(g["values"], e["values"], "rms_norm's output differs", _describe(c), _ATOL, _RTOL)
        if problem:
            shaped = "wrong shape" in problem.what
            return Mismatch(problem.what, problem.detail, hint="" if shaped else _mistake(c, g["values"]))
    return None


def rms_norm_parts(make_inputs) -> dict:
    """The fields task 1's checks share, with their own inputs."""
    return dict(
        task="lab06 task 1: rms_norm",
        reference=course_rms_norm,
        make_inputs=make_inputs,
        drive=_drive,
        compare=_compare,
    )


register(
    Check(
        check_id="lab06.rms_norm",
        hint="RMSNorm works on each vector of the last dimension on its own: it scales the vector to unit root mean "
        "square (eps keeping the division safe), then multiplies each channel by its weight; the result has x's "
        "shape and dtype (chapter 06, section “1 · The model on the table”).",
        **rms_norm_parts(_plain_cases),
    )
)

register(
    Check(
        check_id="lab06.rms_norm_edges",
        hint="the edges: activations as small as eps, a large eps, vectors far from zero mean, a single channel, "
        "four leading dimensions. The normalisation runs over the last dimension only.",
        **rms_norm_parts(_edge_cases),
    )
)
