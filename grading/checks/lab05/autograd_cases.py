"""What the checks of lab 05's autograd tasks (1 to 4) and the training check share: the task each name
belongs to, the learner's dict of names checked for its keys, and the reference the ops are compared with,
``torch_reference()``: the contract's ops computed by torch, every share by ``torch.autograd.grad``.

A check of tasks 1 to 4 takes a dict of the learner's names for its task (``{"Value": Value, "add": add,
...}``); ``Value`` is in every one, since every op makes Values. The reference side of tasks 2 to 4 is
torch itself, so a learner's op is compared with ``torch.autograd`` on the same inputs, and task 1's is
the course's engine (``infra_lib.training.autograd.Value``) driven by the check's own small ops.
"""

from __future__ import annotations

import functools
from typing import Callable

from grading.registry import Mismatch

TASK_ENGINE = "lab05 task 1: Value"
TASK_ELEMENTWISE = "lab05 task 2: add, mul, exp, log"
TASK_REDUCTIONS = "lab05 task 3: matmul, reduce_sum, reduce_mean"
TASK_MODEL_OPS = "lab05 task 4: softmax, rms_norm, embedding, cross_entropy"

# the names each task's check takes, in the order the text lists them
TASK_NAMES = {
    1: ("Value",),
    2: ("Value", "add", "mul", "exp", "log"),
    3: ("Value", "matmul", "reduce_sum", "reduce_mean"),
    4: ("Value", "softmax", "rms_norm", "embedding", "cross_entropy"),
}
# which task writes each name (adamw_update: task 5)
TASK_OF = {name: task for task, names in TASK_NAMES.items() for name in names if name != "Value" or task == 1}
TASK_OF["adamw_update"] = 5

READING = "chapter 05, section “1 · The chain rule as a graph”"


def learner_names(ops, check_id: str, names: tuple[str, ...]) -> dict:
    """``ops`` when it is a dict of exactly ``names``, each callable; else a TypeError that lists them."""
    expected = ", ".join(f'"{name}": {name}' for name in names)
    usage = f"check({check_id!r}, {{{expected}}})"
    if type(ops) is not dict:
        raise TypeError(f"{usage}: the check takes a dict of your names, got a {type(ops).__name__}")
    missing, extra = [n for n in names if n not in ops], [repr(n) for n in ops if n not in names]
    if missing or extra:
        parts = ([f"lacks {', '.join(missing)}"] if missing else []) + ([f"has {', '.join(extra)}"] if extra else [])
        raise TypeError(f"{usage}: the dict {' and '.join(parts)}; it takes exactly {', '.join(names)}")
    for name in names:
        if not callable(ops[name]):
            raise TypeError(f"{usage}: {name} must be your class or function, got a {type(ops[name]).__name__}")
    return ops


def is_value(obj, value_cls) -> bool:
    """``obj`` is a node of ``value_cls`` with the contract's attributes."""
    return isinstance(obj, value_cls) and all(hasattr(obj, a) for a in ("data", "parents", "backward_fn"))


@functools.cache
def torch_reference() -> dict:
    """The contract's ``Value`` (the course's) and ops, each computed by torch: the forward with torch's
    functions, each parent's share with ``torch.autograd.grad`` of that forward. A fully masked row of a
    causal softmax (a query before every key) is a row of zeros, with a zero gradient."""
    import torch
    import torch.nn.functional as F

    from infra_lib.model.attention import causal_mask
    from infra_lib.training.autograd import Value

    def softmax(x, causal=False):
        if not causal:
            return torch.softmax(x, dim=-1)
        keep = causal_mask(*x.shape[-2:])
        blind = ~keep.any(-1, keepdim=True)
        scores = x.masked_fill(~keep, float("-inf")).masked_fill(blind, 0.0)
        return torch.softmax(scores, dim=-1).masked_fill(blind, 0.0)

    def rms_norm(x, weight, eps):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def cross_entropy(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def op(forward, positions: tuple[int, ...]):
        """The op whose Value arguments sit at ``positions`` of its arguments."""

        def apply(*args, **kwargs):
            values = tuple(args[i] for i in positions)

            def run(tensors):
                call = list(args)
                for i, tensor in zip(positions, tensors):
                    call[i] = tensor
                return forward(*call, **kwargs)

            def backward_fn(grad):
                leaves = [v.data.detach().clone().requires_grad_(True) for v in values]
                with torch.enable_grad():
                    shares = torch.autograd.grad(run(leaves), leaves, grad, allow_unused=True)
                return [torch.zeros_like(leaf) if s is None else s for leaf, s in zip(leaves, shares)]

            return Value(run([v.data for v in values]).detach(), values, backward_fn)

        return apply

    return {
        "Value": Value,
        "add": op(torch.add, (0, 1)),
        "mul": op(torch.mul, (0, 1)),
        "exp": op(torch.exp, (0,)),
        "log": op(torch.log, (0,)),
        "matmul": op(torch.matmul, (0, 1)),
        "reduce_sum": op(lambda x, dim=None, keepdim=False: torch.sum(x, dim=dim, keepdim=keepdim), (0,)),
        "reduce_mean": op(lambda x, dim=None, keepdim=False: torch.mean(x, dim=dim, keepdim=keepdim), (0,)),
        "softmax": op(softmax, (0,)),
        "rms_norm": op(rms_norm, (0, 1)),
        "embedding": op(F.embedding, (1,)),
        "cross_entropy": op(cross_entropy, (0,)),
    }


def first_problem(got, expected, cases: list[dict], compare_case: Callable) -> Mismatch | None:
    """The first case whose recorded outcome ``compare_case(case, got, expected)`` finds wrong."""
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        problem = compare_case(case, g, e)
        if problem:
            return problem
    return None


@functools.cache
def torch_reference_for(task: int) -> dict:
    """``torch_reference()``'s names that task ``task``'s checks take (the reference of those checks)."""
    every = torch_reference()
    return {name: every[name] for name in TASK_NAMES[task]}
