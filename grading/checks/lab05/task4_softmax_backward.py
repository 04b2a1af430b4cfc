"""Lab 05 task 4: softmax_backward, the gradient of the scores from the probabilities and their gradient,
masked entries (probability 0) included."""

from __future__ import annotations

import random

from grading.checks.common import outcome, reference, unwrap
from grading.checks.lab05.pieces import NoTorchAutograd, raised_or_none, randn, record, tensor_problem, torch_equal
from grading.registry import Check, Mismatch, register

TASK = "lab05 task 4: softmax_backward"
_AUTOGRAD = "infra_lib.training.autograd"


def _backward_case(
    rng: random.Random,
    label: str,
    shape: list[int],
    dtype: str = "float32",
    mask: str = "none",
    scale: float = 1.0,
    layout: str = "contiguous",
) -> dict:
    return {
        "label": label,
        "shape": shape,
        "dtype": dtype,
        "mask": mask,
        "scale": scale,
        "layout": layout,
        "seed": rng.randrange(10**6),
    }


def _softmax_cases(rng: random.Random) -> list[dict]:
    return [
        _backward_case(rng, "attention weights", [2, 2, 5, 5], mask="causal"),
        _backward_case(rng, "one row", [rng.randint(3, 9)]),
        _backward_case(rng, "a batch of rows", [rng.randint(2, 5), rng.randint(4, 12)]),
        _backward_case(rng, "a float64 batch", [3, rng.randint(2, 4), 7], dtype="float64"),
    ]


def _softmax_edges(rng: random.Random) -> list[dict]:
    t = rng.randint(2, 4)
    return [
        _backward_case(rng, "single-element rows", [4, 1]),
        _backward_case(rng, "a one-element tensor", [1]),
        _backward_case(rng, "a causal mask with fewer queries than keys", [2, t, t + 3], mask="causal"),
        _backward_case(rng, "rows masked everywhere but the diagonal", [3, 6, 6], mask="diagonal"),
        _backward_case(
            rng, "fully masked (padding) rows, all-zero probabilities, among causal rows", [2, 6, 6], mask="padded"
        ),
        _backward_case(rng, "probabilities from logits of the order of 1e4", [5, 9], scale=1e4),
        _backward_case(rng, "causal float64 attention weights", [1, 3, 6, 6], dtype="float64", mask="causal"),
        _backward_case(rng, "a transposed (non-contiguous) tensor", [7, 4], layout="transposed"),
        _backward_case(rng, "odd sizes", [3, 1, 5, 7], dtype="float64"),
    ]


def _softmax_inputs(case: dict):
    """(probs, grad_probs) as the case describes them; grad_probs is random at masked entries too."""
    import torch

    scores = randn(case["seed"], case["shape"], "float64", case["scale"])
    if case["layout"] == "transposed":
        scores = scores.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, strided
    if case["mask"] != "none":
        t, s = case["shape"][-2:]
        keep = torch.eye(t, s) > 0 if case["mask"] == "diagonal" else torch.ones(t, s, dtype=torch.bool).tril(s - t)
        if case["mask"] == "padded":
            keep[::3] = False  # every third query row masked everywhere: padding
        scores = scores.masked_fill(~keep, float("-inf"))
    # A fully masked row has no probabilities (softmax gives nan): like attention kernels, it holds zeros.
    probs = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0).to(getattr(torch, case["dtype"]))
    grad = randn(case["seed"] + 1, case["shape"], case["dtype"])
    if case["layout"] == "transposed":
        grad = grad.transpose(-1, -2).contiguous().transpose(-1, -2)
    return probs, grad


def _describe_backward(case: dict) -> str:
    return f"{case['label']}: probs of shape {case['shape']}, {case['dtype']}"


def _drive_softmax(fn, cases: list[dict]) -> list:
    def run(case):
        probs, grad = _softmax_inputs(case)
        before = (probs.clone(), grad.clone())
        result = fn(probs, grad)
        return {
            "result": record(result),
            "changed": not (torch_equal(probs, before[0]) and torch_equal(grad, before[1])),
        }

    with NoTorchAutograd():
        return [outcome(run, case) for case in cases]


def _softmax_variants(case: dict) -> list:
    """Classic mistakes on the case's inputs, in float64: (message, result) pairs."""
    probs, grad = (t.double() for t in _softmax_inputs(case))
    weighted = (grad * probs).sum(-1, keepdim=True)
    variants = {
        "that is probs * grad_probs: every score moves every probability through the normalisation, so the "
        "gradient also has the term - p_i Σ_j g_j p_j": probs * grad,
        "that is only the diagonal of the Jacobian, p_i (1 - p_i) g_i: d p_i / d x_j = - p_i p_j for j ≠ i too": grad
        * probs
        * (1 - probs),
        "the sum over j is weighted by the probabilities: Σ_j g_j p_j, not Σ_j g_j": probs
        * (grad - grad.sum(-1, True)),
        "the sign is flipped: the gradient is p_i (g_i - Σ_j g_j p_j)": -probs * (grad - weighted),
        "the gradient is p_i times (g_i - Σ_j g_j p_j): without the factor p_i a masked entry (p = 0) gets a "
        "gradient": grad - weighted,
    }
    pairs = [(why, value.numpy()) for why, value in variants.items()]
    for dim in range(probs.dim() - 1):
        pairs.append(
            (
                "the sum runs over the wrong dim: the softmax normalises over the last dim, so Σ_j is over "
                "the last dim (keepdim=True, so that it broadcasts)",
                (probs * (grad - (grad * probs).sum(dim, True))).numpy(),
            )
        )
    return pairs


def _compare_softmax(got, expected, cases: list[dict]) -> Mismatch | None:
    import numpy as np

    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results from softmax_backward, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        (kind, value), (_, want) = unwrap(g), unwrap(e)
        where = _describe_backward(case)
        problem = raised_or_none("softmax_backward", kind, value, where)
        if problem:
            return problem
        variants = _softmax_variants(case)
        result = value["result"]
        if "values" in result and result["shape"] == want["result"]["shape"]:
            probs = _softmax_inputs(case)[0].double().numpy()
            zero = probs == 0
            got_values = np.asarray(result["values"], dtype=np.float64)
            if (got_values[zero] != 0).any():
                index = [int(i) for i in np.argwhere(zero & (got_values != 0))[0]]
                note = next((f"; {why}" for why, v in variants if np.allclose(got_values, v, rtol=1e-4, atol=1e-5)), "")
                return Mismatch(
                    "softmax_backward gave a nonzero gradient where the probability is exactly 0 (a masked entry)",
                    f"on {where}: at index {index} probs is 0 and your gradient is "
                    f"{got_values[tuple(index)]:.6g}; it must be exactly 0 whatever grad_probs holds "
                    f"there{note}",
                )
        problem = tensor_problem(
            "softmax_backward",
            result,
            want["result"],
            where,
            variants,
            "softmax_backward returned the wrong gradient",
            noun="the returned gradient",
        )
        if problem:
            return problem
        if value["changed"]:
            return Mismatch(
                "softmax_backward changed its inputs",
                f"on {where}: probs or grad_probs holds other values after the call; compute into new "
                "tensors (the autograd reuses probs for every gradient that passes through)",
            )
    return None


_SOFTMAX_HINT = (
    "every score moves every probability of its row through the normalisation: d p_i / d x_j = "
    "p_i (δ_ij - p_j), over the last dim only; contract that Jacobian with grad_probs without "
    "building it. A masked entry has p exactly 0, and its gradient must come out exactly 0 "
    "(chapter 05, section “1 · The chain rule as a graph”)."
)

register(
    Check(
        check_id="lab05.softmax_backward",
        task=TASK,
        reference=reference(_AUTOGRAD, "softmax_backward"),
        make_inputs=_softmax_cases,
        drive=_drive_softmax,
        compare=_compare_softmax,
        hint=_SOFTMAX_HINT,
    )
)
register(
    Check(
        check_id="lab05.softmax_backward_edges",
        task=TASK,
        reference=reference(_AUTOGRAD, "softmax_backward"),
        make_inputs=_softmax_edges,
        drive=_drive_softmax,
        compare=_compare_softmax,
        hint=_SOFTMAX_HINT + " Single-element rows, rectangular causal masks, rows masked everywhere but the "
        "diagonal (probability 1), fully masked rows (all probabilities 0, so the whole "
        "row's gradient is 0), probabilities from logits of the order of 1e4, float64 "
        "and non-contiguous tensors.",
    )
)
