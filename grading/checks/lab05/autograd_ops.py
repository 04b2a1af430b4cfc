"""Lab 05 tasks 2 to 4: the ops of the autograd contract, each compared with torch.autograd.

A case names an op, its inputs (plain data: shapes, a dtype, a seed) and its keyword arguments. The driver
makes the inputs, wraps each float tensor in the namespace's ``Value``, calls the op, then calls the
result's ``backward_fn`` with a seeded gradient directly (tasks 2 to 4 need task 1's constructor, not its
``backward``), and records the output, which arguments came back as parents, and every share. The
reference side runs the same driver on ``torch_reference()``: torch's forward and torch.autograd's shares.
"""

from __future__ import annotations

import functools
import random
from typing import Callable

from grading.checks.common import outcome, unwrap
from grading.checks.lab05.autograd_cases import (
    READING,
    TASK_ELEMENTWISE,
    TASK_MODEL_OPS,
    TASK_NAMES,
    TASK_REDUCTIONS,
    first_problem,
    is_value,
    learner_names,
    torch_reference_for,
)
from grading.checks.lab05.pieces import NoTorchAutograd, randn, record, tensor_problem, tolerance_for, torch_equal
from grading.registry import Check, Mismatch, register

# what each op's Value arguments are called, in argument order
ARGUMENTS = {
    "add": ("a", "b"),
    "mul": ("a", "b"),
    "exp": ("x",),
    "log": ("x",),
    "matmul": ("a", "b"),
    "reduce_sum": ("x",),
    "reduce_mean": ("x",),
    "softmax": ("x",),
    "rms_norm": ("x", "weight"),
    "embedding": ("table",),
    "cross_entropy": ("logits",),
}

BROADCAST = (
    "broadcasting stretched a dim of size 1 of that parent (or added leading dims): its share must be brought "
    "back to the parent's own shape, gathering every position its elements were copied to"
)
REDUCTION = (
    "a reduction gathers every element of the reduced dims into one output: that output's gradient reaches "
    "every element it gathered, so the share is put back along the reduced dims, to the input's shape "
    "(keepdim decides whether the reduced dim is still there in the output)"
)
EXP = (
    "e to the x changes at the rate e to the x itself: each element's share scales the incoming gradient by "
    "the op's own output at that element (not by x, nor by one)"
)
LOG = (
    "the natural log changes at the rate of the reciprocal of its input: each element's share is the incoming "
    "gradient divided by that element of x, so small inputs get large shares"
)
MEAN = "a mean divides the sum by the number of elements it averages, and each element's share carries that division"
ROW = (
    "the normalisation depends on every element of the row: moving one score moves every probability of its "
    "row, so each score's share gathers the gradient of the whole row"
)
MASKED = (
    "a masked key's probability is exactly 0 whatever its score, so its share is exactly 0; a query placed "
    "before every key sees nothing: its whole row is 0, in value and in share (never nan)"
)
RMS = (
    "the rms depends on every element of the row: each x reaches the output directly and through the "
    "normalisation, and its share has both parts"
)
WEIGHT = "the weight multiplies every row: its share gathers the contributions of all rows, back to [d]"
REPEAT = "an id that appears several times receives the sum of the gradients of all its positions"
POSITIONS = "the loss is the mean over every position: each position's share is scaled the way its loss is in that mean"
HUGE = (
    "exp of a logit of the order of 1e4 overflows: shift each row by its own maximum first (the softmax and "
    "the loss do not change), so that every exp stays finite"
)


def _case(rng: random.Random, op: str, label: str, inputs: list[dict], dtype: str = "float64", **kwargs) -> dict:
    extra = [kwargs.pop("eps")] if "eps" in kwargs else []
    return {
        "op": op,
        "label": label,
        "inputs": inputs,
        "extra": extra,
        "kwargs": kwargs,
        "dtype": dtype,
        "seed": rng.randrange(10**6),
    }


def _value(shape: list[int], scale: float = 1.0, kind: str = "normal") -> dict:
    return {"kind": kind, "shape": shape, "scale": scale}


def _ids(shape: list[int], high: int, same: bool = False) -> dict:
    return {"kind": "ids", "shape": shape, "high": high, "same": same}


def case_tensors(case: dict) -> list:
    """The case's arguments as tensors: float ones (to be wrapped as Values) and int64 ones (ids, targets)."""
    import torch

    tensors = []
    for i, spec in enumerate(case["inputs"]):
        seed = case["seed"] + i
        if spec["kind"] == "ids":
            generator = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, spec["high"], spec["shape"], generator=generator)
            tensors.append(ids.fill_(int(ids.reshape(-1)[0])) if spec["same"] and ids.numel() else ids)
        elif spec["kind"] == "positive":  # for log: 0.1 and more
            tensors.append((randn(seed, spec["shape"], "float64", spec["scale"]).exp() + 0.1).to(_dtype(case)))
        elif spec["kind"] == "weight":  # a norm's weight: around 1, none 0
            tensors.append((1 + spec["scale"] * randn(seed, spec["shape"], "float64")).to(_dtype(case)))
        else:
            tensors.append(randn(seed, spec["shape"], case["dtype"], spec["scale"]))
    return tensors


def _dtype(case: dict):
    import torch

    return getattr(torch, case["dtype"])


def _describe(case: dict) -> str:
    names = iter(ARGUMENTS[case["op"]])
    parts = [
        f"ids {spec['shape']}" if spec["kind"] == "ids" else f"{next(names)} {spec['shape']}" for spec in case["inputs"]
    ]
    if case["op"] == "cross_entropy":
        parts = [parts[0], f"targets {case['inputs'][1]['shape']}"]
    parts += [f"eps={e:g}" for e in case["extra"]] + [f"{k}={v!r}" for k, v in case["kwargs"].items()]
    return f"{case['label']}: {case['op']}({', '.join(parts)}), {case['dtype']}"


def _run_case(ops: dict, case: dict) -> dict:
    tensors = case_tensors(case)
    floats = [t for t in tensors if t.is_floating_point()]
    make = ops["Value"]
    values = iter([make(t.clone()) for t in floats])
    args = [next(values) if t.is_floating_point() else t.clone() for t in tensors]
    values = [a for a, t in zip(args, tensors) if t.is_floating_point()]
    out = ops[case["op"]](*args, *case["extra"], **case["kwargs"])
    if not is_value(out, make):
        return {"kind": "not a Value", "type": type(out).__name__}
    parents = [next((i for i, v in enumerate(values) if p is v), -1) for p in out.parents]
    grad = randn(case["seed"] + 100, list(out.data.shape), case["dtype"])
    given = grad.clone()
    shares = out.backward_fn(grad)
    if isinstance(shares, (list, tuple)):
        shares = [None if s is None else record(s) for s in shares]
    else:
        shares = {"type": type(shares).__name__}
    return {
        "kind": "value",
        "output": record(out.data),
        "parents": parents,
        "shares": shares,
        "changed": not all(torch_equal(v.data, t) for v, t in zip(values, floats)),
        "grad_changed": not torch_equal(grad, given),
    }


def drive_ops(ops, cases: list[dict], check_id: str, task: int) -> list:
    """Each case's record (or the error it raised); torch.autograd refuses to run for a learner's ops."""
    if ops is torch_reference_for(task):
        return [outcome(_run_case, ops, case) for case in cases]
    learner_names(ops, check_id, TASK_NAMES[task])
    with NoTorchAutograd():
        return [outcome(_run_case, ops, case) for case in cases]


# --- what a wrong result matches ---------------------------------------------------------------------


def _float64_inputs(case: dict) -> list:
    return [t.double() if t.is_floating_point() else t for t in case_tensors(case)]


def _variants(case: dict, want: dict) -> dict[int, list]:
    """Per parent index: (hint, result) pairs of the classic mistakes, in float64 on the case's inputs."""
    import torch

    op, kwargs = case["op"], case["kwargs"]
    inputs = _float64_inputs(case)
    grad = randn(case["seed"] + 100, want["output"]["shape"], case["dtype"]).double()
    share = [torch.tensor(s["values"], dtype=torch.float64) if s else None for s in want["shares"]]
    if op == "exp":
        return {0: [(EXP, grad.numpy()), (EXP, (grad * inputs[0]).numpy())]}
    if op == "log":
        return {0: [(LOG, (grad * inputs[0]).numpy()), (LOG, grad.numpy())]}
    if op == "reduce_mean":
        x, dim = inputs[0], kwargs.get("dim")
        count = x.numel() if dim is None or x.dim() == 0 else x.shape[dim]
        return {0: [(MEAN, (share[0] * count).numpy())]}
    if op == "softmax":
        probs = torch.tensor(want["output"]["values"], dtype=torch.float64)
        return {0: [(ROW, (probs * grad).numpy())]}
    if op == "rms_norm":
        x, weight = inputs[0], inputs[1]
        inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + case["extra"][0])
        return {0: [(RMS, (grad * weight * inv_rms).numpy())]}
    if op == "cross_entropy":
        return {0: [(POSITIONS, (share[0] * inputs[1].numel()).numpy())]}
    return {}


def _shape_hint(case: dict, parent: int) -> str:
    op = case["op"]
    if op in ("add", "mul", "matmul"):
        return BROADCAST
    if op in ("reduce_sum", "reduce_mean"):
        return REDUCTION
    if op == "rms_norm" and parent == 1:
        return WEIGHT
    return ""


def _repeat_problem(case: dict, got: dict, want: dict, where: str) -> Mismatch | None:
    """For embedding: the rows picked once agree and a row picked several times does not."""
    import numpy as np

    ids = case_tensors(case)[0].reshape(-1).tolist()
    counts = {i: ids.count(i) for i in set(ids)}
    got_rows, want_rows = np.asarray(got["values"]), np.asarray(want["values"])
    atol, rtol = tolerance_for(want["dtype"], want["values"])
    close = np.isclose(got_rows, want_rows, atol=atol, rtol=rtol).all(axis=-1)
    once = [row for row, n in counts.items() if n == 1]
    again = [row for row, n in counts.items() if n > 1 and not close[row]]
    if again and all(close[row] for row in once):
        return Mismatch(
            "embedding's share of the table is wrong in the rows that several ids picked",
            f"on {where}: row {again[0]} was picked {counts[again[0]]} times and its share differs from "
            "torch.autograd's; the rows picked once agree",
            hint=REPEAT,
        )
    return None


def _masked_problem(case: dict, got: dict, want: dict, where: str) -> Mismatch | None:
    """For a causal softmax: exactly 0 where the reference's probability is exactly 0, in output and share."""
    import numpy as np

    zero = np.asarray(want["output"]["values"]) == 0
    for noun, values in (("probability", got["output"]["values"]), ("share", got["shares"][0]["values"])):
        values = np.asarray(values, dtype=np.float64)
        bad = zero & ~(values == 0)
        if values.shape == zero.shape and bad.any():
            index = [int(i) for i in np.argwhere(bad)[0]]
            return Mismatch(
                f"softmax gave a masked key a nonzero {noun} (or nan)",
                f"on {where}: at index {index} the {noun} must be exactly 0, got {values[tuple(index)]:.6g}",
                hint=MASKED,
            )
    return None


def _compare_case(case: dict, got, expected) -> Mismatch | None:
    import numpy as np

    (kind, value), (_, want) = unwrap(got), unwrap(expected)
    op, where = case["op"], _describe(case)
    shaped = (
        _shape_hint(case, 0) if op in ("reduce_sum", "reduce_mean") and case["kwargs"].get("dim") is not None else ""
    )
    if kind == "raised":
        return Mismatch(f"{op} raised an exception", f"on {where}: your code raised {value}", hint=shaped)
    if kind != "value" or type(value) is not dict:
        return Mismatch("the check recorded a malformed result", f"on {where}: {value!r:.80}")
    if value.get("kind") != "value":
        return Mismatch(f"{op} must return a Value(result, parents, backward_fn)", f"on {where}: got a {value['type']}")
    output = value["output"]
    if "values" in output and not np.isfinite(np.asarray(output["values"], dtype=np.float64)).all():
        if np.isfinite(np.asarray(want["output"]["values"], dtype=np.float64)).all():
            large = any(spec.get("scale", 1) >= 1e3 for spec in case["inputs"])
            return Mismatch(
                f"{op}'s output holds inf or nan",
                f"on {where}",
                hint=HUGE if large else (MASKED if op == "softmax" else ""),
            )
    if op == "softmax" and case["kwargs"].get("causal") and type(value["shares"]) is list and value["shares"]:
        problem = _masked_problem(case, value, want, where)
        if problem:
            return problem
    problem = tensor_problem(
        op, output, want["output"], where, {}, f"{op} computed the wrong output", noun="the output"
    )
    if problem:
        return problem
    if value["parents"] != want["parents"]:
        return Mismatch(
            f"the Value from {op} must have exactly its Value arguments as parents, in argument order",
            f"on {where}: parents are arguments {value['parents']} (-1: not an argument), expected {want['parents']}",
        )
    shares = value["shares"]
    if type(shares) is not list or len(shares) != len(want["shares"]):
        return Mismatch(
            f"the backward_fn of {op}'s Value must return one share per parent, in order",
            f"on {where}: expected {len(want['shares'])} shares, got {shares!r:.60}",
        )
    variants = _variants(case, want)
    for i, (share, want_share) in enumerate(zip(shares, want["shares"])):
        noun = f"the share of {ARGUMENTS[op][i]} (parent {i})"
        if share is None:
            return Mismatch(f"{op}'s backward_fn gave {noun} None", f"on {where}: torch.autograd's share is not zero")
        if share.get("shape") is not None and share["shape"] != want_share["shape"]:
            return Mismatch(
                f"{noun} from {op}'s backward_fn has the wrong shape",
                f"on {where}: expected {want_share['shape']} (the parent's shape), got {share['shape']}",
                hint=_shape_hint(case, i),
            )
        if "values" in share and not np.isfinite(np.asarray(share["values"], dtype=np.float64)).all():
            large = any(spec.get("scale", 1) >= 1e3 for spec in case["inputs"])
            return Mismatch(
                f"{noun} from {op}'s backward_fn holds inf or nan",
                f"on {where}",
                hint=HUGE if large else (MASKED if op == "softmax" else ""),
            )
        if op == "embedding" and "values" in share:
            problem = _repeat_problem(case, share, want_share, where)
            if problem:
                return problem
        problem = tensor_problem(
            f"{op}'s backward_fn",
            share,
            want_share,
            where,
            variants.get(i, []),
            f"{noun} from {op}'s backward_fn differs from torch.autograd's",
            noun=noun,
            why_as_hint=True,
        )
        if problem:
            return problem if problem.hint else Mismatch(problem.what, problem.detail, hint=shaped)
    if value["changed"] or value["grad_changed"]:
        which = "the data of an argument" if value["changed"] else "the gradient its backward_fn was given"
        return Mismatch(
            f"{op} changed {which}",
            f"on {where}: it holds other values after the call and its backward; compute into new tensors "
            "(a gradient tensor may be shared: an add hands the same one to both parents)",
        )
    return None


def compare_ops(got, expected, cases: list[dict]) -> Mismatch | None:
    return first_problem(got, expected, cases, _compare_case)


def ops_check(task: str, number: int, drive: Callable) -> dict:
    """What the checks of one ops task share: the task, torch as the reference, the driver and comparison."""
    return {
        "task": task,
        "reference": functools.partial(torch_reference_for, number),
        "drive": drive,
        "compare": compare_ops,
    }


# --- task 2: add, mul, exp, log -------------------------------------------------------------------


def _elementwise_cases(rng: random.Random) -> list[dict]:
    d, rows = rng.randint(3, 6), rng.randint(2, 5)
    return [
        _case(rng, "add", "same shapes", [_value([3, d]), _value([3, d])]),
        _case(rng, "add", "a bias over a batch", [_value([2, 3, d]), _value([d])]),
        _case(rng, "mul", "same shapes", [_value([rows, d]), _value([rows, d])], dtype="float32"),
        _case(rng, "mul", "a scale per feature", [_value([2, 3, d]), _value([d])]),
        _case(rng, "mul", "a column times a row", [_value([rows, 1]), _value([1, d])]),
        _case(rng, "exp", "a matrix", [_value([3, d])]),
        _case(rng, "log", "positive values", [_value([2, d], kind="positive")]),
    ]


def _elementwise_edges(rng: random.Random) -> list[dict]:
    return [
        _case(rng, "add", "size-1 dims stretched on both sides", [_value([3, 1]), _value([1, 4])]),
        _case(rng, "mul", "size-1 dims and a missing leading dim", [_value([2, 1, 4]), _value([3, 1])]),
        _case(rng, "add", "a 0-d operand", [_value([]), _value([2, 3])], dtype="float32"),
        _case(rng, "mul", "a 0-d operand", [_value([4, 2]), _value([])]),
        _case(rng, "mul", "a [1] operand", [_value([1]), _value([2, 5])], dtype="float32"),
        _case(rng, "exp", "large negative and positive values", [_value([4, 3], scale=20.0)]),
        _case(rng, "log", "float32 positive values", [_value([3, 2, 2], kind="positive")], dtype="float32"),
        _case(rng, "exp", "a 0-d value", [_value([])]),
    ]


def _drive_elementwise(ops, cases: list[dict]) -> list:
    return drive_ops(ops, cases, "lab05.elementwise", 2)


_ELEMENTWISE_HINT = (
    "each op returns Value(result, parents, backward_fn) with parents exactly its Value arguments, in order, and "
    "backward_fn(grad) returns one share per parent, of that parent's own shape: where torch's broadcasting "
    f"stretched a parent, its share is brought back to the parent's shape ({READING})."
)

register(
    Check(
        check_id="lab05.elementwise",
        make_inputs=_elementwise_cases,
        **ops_check(TASK_ELEMENTWISE, 2, _drive_elementwise),
        hint=_ELEMENTWISE_HINT,
    )
)
register(
    Check(
        check_id="lab05.elementwise_edges",
        make_inputs=_elementwise_edges,
        **ops_check(TASK_ELEMENTWISE, 2, _drive_elementwise),
        hint=_ELEMENTWISE_HINT + " Size-1 dims stretched on both sides, 0-d and [1] operands, float32, exp of "
        "large values.",
    )
)


# --- task 3: matmul, reduce_sum, reduce_mean ------------------------------------------------------


def _reductions_cases(rng: random.Random) -> list[dict]:
    n, k, m = rng.randint(2, 4), rng.randint(4, 6), rng.randint(2, 5)  # k != 3: reduce_sum's middle dim differs
    return [
        _case(rng, "matmul", "two matrices", [_value([n, k]), _value([k, m])]),
        _case(rng, "matmul", "attention scores per head", [_value([2, 3, n, k]), _value([2, 3, k, n])]),
        _case(rng, "reduce_sum", "every element", [_value([3, k])]),
        _case(rng, "reduce_sum", "over a middle dim", [_value([3, k, m])], dim=1),
        _case(rng, "reduce_mean", "every element", [_value([n, k])]),
        _case(rng, "reduce_mean", "over the first dim", [_value([4, 3])], dtype="float32", dim=0),
    ]


def _reductions_edges(rng: random.Random) -> list[dict]:
    d, n = rng.randint(3, 6), rng.randint(2, 5)
    return [
        _case(rng, "matmul", "a weight [d, n] against a batch [B, T, d]", [_value([2, 3, d]), _value([d, n])]),
        _case(rng, "matmul", "batch dims of size 1 stretched", [_value([1, 3, d]), _value([2, d, n])]),
        _case(rng, "matmul", "batch dims broadcast both ways", [_value([2, 1, 3, d]), _value([4, d, 2])], "float32"),
        _case(rng, "reduce_sum", "the last dim, keepdim", [_value([3, 4, 5])], dim=-1, keepdim=True),
        _case(rng, "reduce_sum", "a negative dim", [_value([4, 4, 2])], dim=-2),
        _case(rng, "reduce_sum", "a 0-d value", [_value([])]),
        _case(rng, "reduce_mean", "the last dim", [_value([2, 3, d])], dim=-1),
        _case(rng, "reduce_mean", "a middle dim, keepdim", [_value([2, 5, 3])], dtype="float32", dim=1, keepdim=True),
        _case(rng, "reduce_mean", "every element, keepdim", [_value([3, 4])], dim=None, keepdim=True),
    ]


def _drive_reductions(ops, cases: list[dict]) -> list:
    return drive_ops(ops, cases, "lab05.matmul_reductions", 3)


_REDUCTIONS_HINT = (
    "matmul's batch dims broadcast as add's do, and each share comes back to its parent's shape; a reduction "
    "gathers the elements of the reduced dims, so the gradient of each output reaches every element it "
    f"gathered, and a mean divides as its forward does ({READING})."
)

register(
    Check(
        check_id="lab05.matmul_reductions",
        make_inputs=_reductions_cases,
        **ops_check(TASK_REDUCTIONS, 3, _drive_reductions),
        hint=_REDUCTIONS_HINT,
    )
)
register(
    Check(
        check_id="lab05.matmul_reductions_edges",
        make_inputs=_reductions_edges,
        **ops_check(TASK_REDUCTIONS, 3, _drive_reductions),
        hint=_REDUCTIONS_HINT + " A weight [d, n] against [B, T, d], batch dims of size 1, keepdim, negative "
        "dims, 0-d values, float32.",
    )
)


# --- task 4: softmax, rms_norm, embedding, cross_entropy -------------------------------------------


def _model_ops_cases(rng: random.Random) -> list[dict]:
    t, vocab = rng.randint(4, 6), rng.randint(6, 9)
    return [
        _case(rng, "softmax", "rows of scores", [_value([2, 3, rng.randint(4, 7)])]),
        _case(rng, "softmax", "causal attention scores", [_value([2, 2, t, t])], causal=True),
        _case(
            rng, "softmax", "causal scores of new queries after cached keys", [_value([2, 2, t, t + 3])], causal=True
        ),
        _case(rng, "rms_norm", "activations [batch, t, d]", [_value([2, 3, 8]), _value([8], 0.5, "weight")], eps=1e-5),
        _case(rng, "embedding", "a batch of token ids", [_ids([2, vocab + 2], vocab), _value([vocab, 4])]),
        _case(rng, "cross_entropy", "next-token logits", [_value([2, t, vocab]), _ids([2, t], vocab)]),
    ]


def _model_ops_edges(rng: random.Random) -> list[dict]:
    s = rng.randint(3, 5)
    return [
        _case(rng, "softmax", "fully masked rows: more queries than keys", [_value([2, s + 2, s])], causal=True),
        _case(rng, "softmax", "fewer queries than keys", [_value([1, 2, 3, s + 3])], dtype="float32", causal=True),
        _case(rng, "softmax", "logits of the order of 1e4", [_value([4, 9], 1e4)], dtype="float32"),
        _case(rng, "softmax", "causal logits of the order of 1e4", [_value([2, 5, 5], 1e4)], causal=True),
        _case(
            rng,
            "rms_norm",
            "tiny activations: eps dominates",
            [_value([3, 10], 1e-3), _value([10], 0.5, "weight")],
            eps=1e-6,
        ),
        _case(rng, "rms_norm", "d = 1", [_value([5, 1]), _value([1], 0.5, "weight")], eps=1e-5),
        _case(
            rng,
            "rms_norm",
            "four dims, float32",
            [_value([2, 3, 2, 6]), _value([6], 0.5, "weight")],
            "float32",
            eps=1e-5,
        ),
        _case(rng, "embedding", "one id everywhere", [_ids([7], 5, same=True), _value([5, 3])]),
        _case(rng, "embedding", "ids of three dims, float32", [_ids([2, 2, 3], 4), _value([4, 2])], "float32"),
        _case(rng, "cross_entropy", "logits of the order of 1e4", [_value([3, 7], 1e4), _ids([3], 7)]),
        _case(
            rng, "cross_entropy", "float32 logits of the order of 1e4", [_value([2, 5], 1e4), _ids([2], 5)], "float32"
        ),
        _case(rng, "cross_entropy", "one position", [_value([9]), _ids([], 9)]),
        _case(rng, "cross_entropy", "three leading dims", [_value([2, 3, 2, 5]), _ids([2, 3, 2], 5)]),
    ]


def _drive_model_ops(ops, cases: list[dict]) -> list:
    return drive_ops(ops, cases, "lab05.model_ops", 4)


_MODEL_OPS_HINT = (
    "softmax and rms_norm normalise over the last dim, so every element of a row moves every output of that "
    "row; a masked key stays exactly 0, in value and share; embedding's rows gather every position that "
    f"picked them; cross_entropy is a mean over positions, finite for logits of any size ({READING})."
)

register(
    Check(
        check_id="lab05.model_ops",
        make_inputs=_model_ops_cases,
        **ops_check(TASK_MODEL_OPS, 4, _drive_model_ops),
        hint=_MODEL_OPS_HINT,
    )
)
register(
    Check(
        check_id="lab05.model_ops_edges",
        make_inputs=_model_ops_edges,
        **ops_check(TASK_MODEL_OPS, 4, _drive_model_ops),
        hint=_MODEL_OPS_HINT + " Fully masked rows (more queries than keys), fewer queries than keys, logits of "
        "the order of 1e4, eps larger than mean(x^2), d = 1, one id everywhere, a single position, float32.",
    )
)
