"""Lab 05 task 5: rms_norm_backward, the gradients of x and of the weight through an RMSNorm."""

from __future__ import annotations

import random

from grading.checks.common import outcome, reference, unwrap
from grading.checks.lab05.pieces import NoTorchAutograd, raised_or_none, randn, record, tensor_problem, torch_equal
from grading.registry import Check, Mismatch, register

TASK = "lab05 task 5: rms_norm_backward"
_AUTOGRAD = "infra_lib.training.autograd"


def _rms_case(
    rng: random.Random,
    label: str,
    shape: list[int],
    dtype: str = "float32",
    eps: float = 1e-5,
    scale: float = 1.0,
    weight: str = "random",
) -> dict:
    return {
        "label": label,
        "shape": shape,
        "dtype": dtype,
        "eps": eps,
        "scale": scale,
        "weight": weight,
        "seed": rng.randrange(10**6),
    }


def _rms_cases(rng: random.Random) -> list[dict]:
    return [
        _rms_case(rng, "a batch of rows", [rng.randint(2, 5), 8]),
        _rms_case(rng, "activations [batch, t, d]", [2, rng.randint(2, 5), 16], eps=1e-6),
        _rms_case(rng, "small activations, where eps matters", [4, 6], dtype="float64", eps=1e-3, scale=0.02),
        _rms_case(rng, "one vector", [rng.randint(3, 12)], dtype="float64"),
    ]


def _rms_edges(rng: random.Random) -> list[dict]:
    return [
        _rms_case(rng, "d = 1", [5, 1], dtype="float64"),
        _rms_case(rng, "four leading dims", [2, 3, 2, 4, 6]),
        _rms_case(
            rng, "tiny activations, eps of the same order as mean(x^2)", [3, 10], dtype="float64", eps=1e-6, scale=1e-3
        ),
        _rms_case(rng, "large activations", [4, 8], scale=1e3),
        _rms_case(rng, "a weight with zeros", [3, 2, 9], dtype="float64", weight="zeros"),
        _rms_case(rng, "a large eps", [6, 5], dtype="float64", eps=0.5),
    ]


def _rms_inputs(case: dict):
    """(x, weight, grad_out, eps) as the case describes them."""
    dtype, d = case["dtype"], case["shape"][-1]
    x = randn(case["seed"], case["shape"], dtype, case["scale"])
    weight = 1 + 0.5 * randn(case["seed"] + 1, [d], dtype)
    if case["weight"] == "zeros":
        weight[::2] = 0
    grad = randn(case["seed"] + 2, case["shape"], dtype)
    return x, weight, grad, case["eps"]


def _describe_rms(case: dict) -> str:
    return f"{case['label']}: x of shape {case['shape']}, {case['dtype']}, eps={case['eps']:g}"


def _drive_rms(fn, cases: list[dict]) -> list:
    def run(case):
        x, weight, grad, eps = _rms_inputs(case)
        before = [t.clone() for t in (x, weight, grad)]
        result = fn(x, weight, grad, eps)
        changed = not all(torch_equal(a, b) for a, b in zip((x, weight, grad), before))
        if type(result) not in (tuple, list) or len(result) != 2:
            return {"pair": False, "type": type(result).__name__, "changed": changed}
        return {"pair": True, "grad_x": record(result[0]), "grad_weight": record(result[1]), "changed": changed}

    with NoTorchAutograd():
        return [outcome(run, case) for case in cases]


def _rms_variants(case: dict) -> tuple[dict, dict]:
    """Classic mistakes on the case's inputs, in float64: (for grad_x, for grad_weight), message -> result."""
    x, weight, grad, eps = (t.double() if hasattr(t, "double") else t for t in _rms_inputs(case))
    mean_square = x.pow(2).mean(-1, keepdim=True)
    inv_rms = (mean_square + eps).rsqrt()
    normed, grad_normed = x * inv_rms, grad * weight
    # eps outside the root, 1 / (sqrt(mean(x^2)) + eps), is the reference's rsqrt(mean(x^2) + eps) with this
    # per-row eps in place of the scalar (the checks compare with the library's backward, never a copy of it)
    from infra_lib.training.autograd import rms_norm_backward

    outside = rms_norm_backward(x, weight, grad, (mean_square.sqrt() + eps) ** 2 - mean_square)
    for_x = {
        "that treats the rms as a constant: it depends on every x_j of the row, so the gradient also has the "
        "term through the mean, - x̂_i · mean_j(g_j w_j x̂_j) / rms": inv_rms * grad_normed,
        "the mean's 1/d is missing from the term through the rms": inv_rms
        * (grad_normed - normed * (grad_normed * normed).sum(-1, keepdim=True)),
        "eps belongs inside the square root: rms = sqrt(mean(x^2) + eps)": outside[0],
        "the gradient reaches x̂ through the weight first: use grad_out * weight, not grad_out": inv_rms
        * (grad - normed * (grad * normed).mean(-1, keepdim=True)),
    }
    lead = x.dim() - 1
    for_weight = {
        "grad_weight must be summed over every leading dim (the weight is shared by every row): it is [d]": grad
        * normed,
        "eps belongs inside the square root: rms = sqrt(mean(x^2) + eps)": outside[1],
        "grad_weight is Σ grad_out · x̂ (the normalised x), not Σ grad_out": grad.reshape(-1, x.shape[-1]).sum(0),
    }
    if lead > 1:
        for_weight["grad_weight must be summed over every leading dim, not only the first: it is [d]"] = (
            grad * normed
        ).sum(0)
    return ({why: v.numpy() for why, v in for_x.items()}, {why: v.numpy() for why, v in for_weight.items()})


def _compare_rms(got, expected, cases: list[dict]) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results from rms_norm_backward, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        (kind, value), (_, want) = unwrap(g), unwrap(e)
        where = _describe_rms(case)
        problem = raised_or_none("rms_norm_backward", kind, value, where)
        if problem:
            return problem
        if not value.get("pair"):
            return Mismatch(
                "rms_norm_backward must return (grad_x, grad_weight): two tensors",
                f"on {where}: got a {value.get('type')}",
            )
        for_x, for_weight = _rms_variants(case)
        problem = tensor_problem(
            "rms_norm_backward",
            value["grad_x"],
            want["grad_x"],
            where,
            for_x,
            "rms_norm_backward returned the wrong grad_x",
            noun="grad_x",
        ) or tensor_problem(
            "rms_norm_backward",
            value["grad_weight"],
            want["grad_weight"],
            where,
            for_weight,
            "rms_norm_backward returned the wrong grad_weight",
            noun="grad_weight",
        )
        if problem:
            return problem
        if value["changed"]:
            return Mismatch(
                "rms_norm_backward changed its inputs",
                f"on {where}: x, weight or grad_out holds other values after the call; compute into new tensors",
            )
    return None


_RMS_HINT = (
    "y = x̂ · weight with x̂ = x / rms and rms = sqrt(mean(x^2) + eps) over the last dim: the rms depends on "
    "every element of its row, so each x_j reaches each y_i twice, directly and through the rms. The "
    "weight is shared by every row: its gradient sums over all the leading dims "
    "(chapter 05, section “1 · The chain rule as a graph”)."
)

register(
    Check(
        check_id="lab05.rms_norm_backward",
        task=TASK,
        reference=reference(_AUTOGRAD, "rms_norm_backward"),
        make_inputs=_rms_cases,
        drive=_drive_rms,
        compare=_compare_rms,
        hint=_RMS_HINT,
    )
)
register(
    Check(
        check_id="lab05.rms_norm_backward_edges",
        task=TASK,
        reference=reference(_AUTOGRAD, "rms_norm_backward"),
        make_inputs=_rms_edges,
        drive=_drive_rms,
        compare=_compare_rms,
        hint=_RMS_HINT + " d = 1, four leading dims, tiny activations where eps dominates, large ones, a "
        "weight with zeros, a large eps.",
    )
)
