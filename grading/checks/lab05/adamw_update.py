"""Lab 05 task 5: adamw_update, one AdamW step in place, over several steps and from a resumed state."""

from __future__ import annotations

import random

from grading.checks.common import outcome, reference, unwrap
from grading.checks.lab05.pieces import NoTorchAdam, randn, record, tensor_problem, torch_equal
from grading.registry import Check, Mismatch, register

TASK = "lab05 task 5: adamw_update"
_SCRATCH = "infra_lib.training.scratch_train"


def _adamw_case(
    rng: random.Random,
    label: str,
    shape: list[int],
    *,
    dtype: str = "float32",
    steps: int = 4,
    start: int = 1,
    lr: float = 1e-2,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    grad_scale: float = 1.0,
) -> dict:
    return {
        "label": label,
        "shape": shape,
        "dtype": dtype,
        "steps": steps,
        "start": start,
        "lr": lr,
        "beta1": beta1,
        "beta2": beta2,
        "eps": eps,
        "weight_decay": weight_decay,
        "grad_scale": grad_scale,
        "seed": rng.randrange(10**6),
    }


def _adamw_cases(rng: random.Random) -> list[dict]:
    return [
        _adamw_case(rng, "a weight matrix", [rng.randint(2, 5), rng.randint(3, 6)], weight_decay=0.1),
        _adamw_case(
            rng, "small gradients, as a network's are", [rng.randint(5, 20)], lr=1e-3, beta2=0.95, grad_scale=1e-4
        ),
        _adamw_case(rng, "a float64 tensor over 6 steps", [3, 4], dtype="float64", steps=6, lr=3e-2, weight_decay=0.05),
    ]


def _adamw_edges(rng: random.Random) -> list[dict]:
    return [
        _adamw_case(rng, "no weight decay", [4, 3], weight_decay=0.0),
        _adamw_case(rng, "one step (step 1)", [6], steps=1, weight_decay=0.1),
        _adamw_case(rng, "a large eps", [5], dtype="float64", eps=1e-3, grad_scale=1e-2),
        _adamw_case(rng, "zero gradients", [2, 3], grad_scale=0.0, weight_decay=0.1),
        _adamw_case(rng, "beta1 = 0", [7], dtype="float64", beta1=0.0),
        _adamw_case(
            rng, "resuming at step 1000 with moments already there", [3, 3], dtype="float64", start=1000, steps=3
        ),
        _adamw_case(rng, "odd shape, 12 steps", [3, 1, 2], steps=12, beta2=0.9, weight_decay=0.3),
    ]


def _adamw_state(case: dict):
    """(param, exp_avg, exp_avg_sq) before the first step: zero moments at step 1, else seeded ones."""
    import torch

    dtype = case["dtype"]
    param = randn(case["seed"], case["shape"], dtype)
    if case["start"] == 1:
        return param, torch.zeros_like(param), torch.zeros_like(param)
    scale = case["grad_scale"]
    return (
        param,
        0.3 * scale * randn(case["seed"] + 1, case["shape"], dtype),
        (scale * randn(case["seed"] + 2, case["shape"], dtype)) ** 2,
    )


def _adamw_grads(case: dict):
    return [
        randn(case["seed"] + 10 + i, case["shape"], case["dtype"], case["grad_scale"]) for i in range(case["steps"])
    ]


def _drive_adamw(fn, cases: list[dict]) -> list:
    def run(case):
        param, exp_avg, exp_avg_sq = _adamw_state(case)
        rows = []
        for i, grad in enumerate(_adamw_grads(case)):
            before = grad.clone()
            returned = fn(
                param,
                grad,
                exp_avg,
                exp_avg_sq,
                case["start"] + i,
                case["lr"],
                case["beta1"],
                case["beta2"],
                case["eps"],
                case["weight_decay"],
            )
            rows.append(
                {
                    "param": record(param),
                    "exp_avg": record(exp_avg),
                    "exp_avg_sq": record(exp_avg_sq),
                    "grad_changed": not torch_equal(grad, before),
                    "returned": None if returned is None else type(returned).__name__,
                }
            )
        return rows

    with NoTorchAdam():
        return [outcome(run, case) for case in cases]


def _adamw_variant(
    case: dict, *, bias_correction=True, l2=False, eps_inside=False, from_zero=False, decay_lr=True
) -> list:
    """The parameter after each step with one classic mistake, in float64."""
    import torch

    param, m, v = (t.double() for t in _adamw_state(case))
    lr, b1, b2, eps, wd = (case[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    out = []
    for i, grad in enumerate(_adamw_grads(case)):
        grad, step = grad.double(), case["start"] + i + (1 if from_zero else 0)
        if l2:
            grad = grad + wd * param
        else:
            param = param * (1 - (lr * wd if decay_lr else wd))
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * grad * grad
        c1, c2 = (1 - b1**step, 1 - b2**step) if bias_correction else (1.0, 1.0)
        denom = (v / c2 + eps).sqrt() if eps_inside else (v / c2).sqrt() + eps
        param = param - lr * (m / c1) / denom
        out.append(param.numpy() if torch.isfinite(param).all() else None)
    return out


_ADAMW_MISTAKES = {
    "the moments start at zero, so early steps need the bias corrections of both moments, each by its own beta "
    "and the step number": {"bias_correction": False},
    "that is Adam's L2 penalty (the decay added to the gradient, so it enters the moments): AdamW decouples it, "
    "shrinking the weight itself before the moments are updated": {"l2": True},
    "eps goes outside the square root: it is added to the square root of the corrected second moment": {
        "eps_inside": True
    },
    "step is 1 on the first update (the step being taken now): do not add 1 to it": {"from_zero": True},
    "the decoupled decay is scaled by the learning rate, as torch's AdamW does": {"decay_lr": False},
}


def _describe_adamw(case: dict) -> str:
    steps = f"steps {case['start']}..{case['start'] + case['steps'] - 1}"
    return (
        f"{case['label']}: param of shape {case['shape']}, {case['dtype']}, {steps}, lr={case['lr']:g}, "
        f"beta1={case['beta1']:g}, beta2={case['beta2']:g}, eps={case['eps']:g}, "
        f"weight_decay={case['weight_decay']:g}"
    )


def _compare_adamw(got, expected, cases: list[dict]) -> Mismatch | None:
    import numpy as np

    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results from adamw_update, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        (kind, rows), (_, want_rows) = unwrap(g), unwrap(e)
        where = _describe_adamw(case)
        if kind == "raised":
            return Mismatch("adamw_update raised an exception", f"on {where}: your code raised {rows}")
        if kind != "value" or type(rows) is not list or len(rows) != len(want_rows):
            return Mismatch("the check recorded a malformed result", f"on {where}: {rows!r:.80}")
        initial = _adamw_state(case)[0].double().numpy()
        for i, (row, want) in enumerate(zip(rows, want_rows)):
            at = f"{where}, after step {case['start'] + i}"
            param = row["param"]
            if (
                i == 0
                and param.get("values") is not None
                and np.array_equal(param["values"], initial)
                and (not np.array_equal(want["param"]["values"], initial))
            ):
                return Mismatch(
                    "adamw_update left param unchanged: it updates param, exp_avg and exp_avg_sq in place",
                    f"on {at}: param still holds its starting values; a new tensor made by "
                    "`param = param - ...` is lost when the function returns: write into the tensor "
                    "(mul_, add_, addcdiv_, or param.copy_(...))",
                )
            variants = {
                why: steps_[i]
                for why, flags in _ADAMW_MISTAKES.items()
                if (steps_ := _adamw_variant(case, **flags))[i] is not None
            }
            problem = tensor_problem(
                "adamw_update",
                param,
                want["param"],
                at,
                variants,
                "adamw_update left the wrong values in param",
                tight=True,
                noun="param",
                why_as_hint=True,
            )
            if problem:
                return problem
            for name in ("exp_avg", "exp_avg_sq"):
                problem = tensor_problem(
                    "adamw_update",
                    row[name],
                    want[name],
                    at,
                    {},
                    f"adamw_update left the wrong values in {name}",
                    noun=name,
                )
                if problem:
                    return Mismatch(
                        problem.what,
                        problem.detail + "; the moments are updated in place too: the "
                        "next step starts from them (they are not bias-corrected in place)",
                    )
            if row["grad_changed"]:
                return Mismatch(
                    "adamw_update changed grad", f"on {at}: grad holds other values after the call; it is read only"
                )
            if row.get("returned") is not None:
                return Mismatch(
                    "adamw_update returned a value: it works in place and returns None",
                    f"on {at}: it returned a {row['returned']}; the caller reads param, exp_avg and "
                    "exp_avg_sq themselves, as torch.optim's step leaves them",
                )
    return None


_ADAMW_HINT = (
    "AdamW as torch.optim.AdamW takes it (Loshchilov and Hutter's Algorithm 2): the weight decay is decoupled "
    "(it shrinks the weight itself, scaled by the learning rate, and never enters the moments), both moments are "
    "bias-corrected for starting at zero, eps is added after the square root, step counts from 1, and param, "
    "exp_avg and exp_avg_sq are updated in place "
    "(chapter 05, section “2 · One training step, measured: memory, mixed precision, checkpointing”)."
)

register(
    Check(
        check_id="lab05.adamw_update",
        task=TASK,
        reference=reference(_SCRATCH, "adamw_update"),
        make_inputs=_adamw_cases,
        drive=_drive_adamw,
        compare=_compare_adamw,
        hint=_ADAMW_HINT,
    )
)
register(
    Check(
        check_id="lab05.adamw_edges",
        task=TASK,
        reference=reference(_SCRATCH, "adamw_update"),
        make_inputs=_adamw_edges,
        drive=_drive_adamw,
        compare=_compare_adamw,
        hint=_ADAMW_HINT + " No weight decay, a single step, a large eps, zero gradients, beta1 = 0, resuming "
        "at step 1000 with moments already there, 12 steps.",
    )
)
