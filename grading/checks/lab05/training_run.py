"""The last check of task 5: the learner's engine, ops and AdamW (tasks 1 to 5) train the course's tiny Llama
through ``training_loss`` (the next-token cross-entropy plus PaLM's z-loss, so that every graded op is in the
graph), next to the same model trained by torch.autograd and ``torch.optim.AdamW``.

The losses must agree at every step and the first step's gradients tensor by tensor. Every call of a graded op
is watched during the first step (its output, the gradient that reached it, the shares it returned, how often
its backward_fn ran), and the reference runs the same graph with torch's ops; each must agree too, since a
wrong share of the small z-loss term can move the parameters' gradients by less than the tolerance. Where
anything differs, the first step says which task to look at: the first op whose output differs, or the last
one whose shares differ for the same incoming gradient, is the one to fix, and a gradient that differs where
every op agreed is the engine's.
"""

from __future__ import annotations

import functools
import math
import random

from grading.checks.common import is_number
from grading.checks.lab05.adamw_update import TASK
from grading.checks.lab05.autograd_cases import TASK_NAMES, TASK_OF, is_value, learner_names, torch_reference
from grading.checks.lab05.pieces import NoTorchAdam, NoTorchAutograd
from grading.registry import Check, Mismatch, register

TRAIN_STEPS = 20
OPS = tuple(name for task in (2, 3, 4) for name in TASK_NAMES[task] if name != "Value")  # the graded ops
NAMES = ("Value", *OPS, "adamw_update")
# what each op's Value arguments are called, in order (the parents of its Value)
PARENTS = {
    "add": ("a", "b"),
    "mul": ("a", "b"),
    "matmul": ("a", "b"),
    "softmax": ("x",),
    "rms_norm": ("x", "weight"),
    "embedding": ("table",),
    "cross_entropy": ("logits",),
}


def _fingerprint(tensor) -> list[float]:
    """[sum, norm, a fixed random projection, numel] of a tensor, in float64: equal tensors give equal prints."""
    import torch

    flat = tensor.detach().reshape(-1).double()
    direction = torch.rand(flat.numel(), generator=torch.Generator().manual_seed(flat.numel()), dtype=torch.float64)
    return [float(flat.sum()), float(flat.norm()), float(flat @ (2 * direction - 1)), flat.numel()]


def _same(got, want, rel: float = 1e-6) -> bool:
    """Two fingerprints agree to ``rel`` of the largest a sum or projection of that tensor can be."""
    if not (type(got) is list and len(got) == 4 and all(is_number(v) for v in got)):
        return False
    bound = want[1] * math.sqrt(max(want[3], 1))
    return got[3] == want[3] and all(abs(g - w) <= rel * bound + 1e-300 for g, w in zip(got[:3], want[:3]))


def _named_call(what: str, task: int, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, MemoryError, RecursionError):
        raise
    except Exception as exc:  # the learner's code may raise anything
        raise RuntimeError(f"your {what} raised {type(exc).__name__}: {exc} (task {task})") from None


class _Watch:
    """The graded ops of a namespace, wrapped for ``training_loss``: an error names its op and task, every share
    must have its parent's shape, and during the first step each call is recorded as fingerprints."""

    def __init__(self, namespace: dict):
        self.namespace = namespace
        self.recording = True
        self.calls: list[dict] = []

    def mapping(self) -> dict:
        return {"Value": self.namespace["Value"], **{name: self._wrap(name) for name in OPS}}

    def stop(self) -> None:
        self.recording = False

    def _wrap(self, name: str):
        fn, make = self.namespace[name], self.namespace["Value"]

        def op(*args, **kwargs):
            out = _named_call(name, TASK_OF[name], fn, *args, **kwargs)
            if not is_value(out, make):
                raise TypeError(
                    f"your {name} returned a {type(out).__qualname__}, which is not the Value class of the dict "
                    f"(task {TASK_OF[name]})"
                )
            self._watch_backward(name, out)
            return out

        return op

    def _watch_backward(self, name: str, out) -> None:
        task, parents, original = TASK_OF[name], tuple(out.parents), out.backward_fn
        entry = {"op": name, "out": _fingerprint(out.data), "calls": 0, "grad_in": None, "shares": None}
        if self.recording:
            self.calls.append(entry)

        def backward_fn(grad):
            shares = _named_call(f"{name}'s backward_fn", task, original, grad)
            shares = list(shares) if isinstance(shares, (list, tuple)) else shares
            if type(shares) is not list or len(shares) != len(parents):
                raise ValueError(
                    f"your {name}'s backward_fn returned {shares!r:.60} for {len(parents)} parents: it returns one "
                    f"share per parent (task {task})"
                )
            for i, (parent, share) in enumerate(zip(parents, shares)):
                if share is not None and getattr(share, "shape", None) != parent.data.shape:
                    raise ValueError(
                        f"your {name}'s backward_fn gave parent {i} (shape {list(parent.data.shape)}) a share of "
                        f"shape {list(getattr(share, 'shape', []))} (task {task}): a share has its parent's shape; "
                        "where broadcasting stretched a parent, its share is brought back to that shape"
                    )
            entry["calls"] += 1
            if self.recording:
                entry["grad_in"] = grad.clone() if entry["grad_in"] is None else entry["grad_in"] + grad
                entry["shares"] = [
                    s if s is None or entry["shares"] is None or entry["shares"][i] is None else entry["shares"][i] + s
                    for i, s in enumerate(shares)
                ]
            return shares

        out.backward_fn = backward_fn

    def finish(self) -> list[dict]:
        """The first step's calls as plain data (fingerprints), in forward order."""
        seen: dict[str, int] = {}
        rows = []
        for entry in self.calls:
            seen[entry["op"]] = seen.get(entry["op"], 0) + 1
            rows.append(
                {
                    "op": entry["op"],
                    "nth": seen[entry["op"]],
                    "out": entry["out"],
                    "calls": entry["calls"],
                    "grad_in": None if entry["grad_in"] is None else _fingerprint(entry["grad_in"]),
                    "shares": [None if s is None else _fingerprint(s) for s in entry["shares"] or []],
                }
            )
        for row in rows:
            row["of"] = seen[row["op"]]
        return rows


@functools.cache
def torch_training() -> dict:
    """The reference: under the check's names, torch's ops and the course's update; the driver knows this
    dict, and trains the same model with torch.autograd and torch.optim.AdamW(foreach=False) instead."""
    from infra_lib.training.scratch_train import adamw_update

    return {**torch_reference(), "adamw_update": adamw_update}


def _training_inputs(rng: random.Random) -> dict:
    return {"steps": TRAIN_STEPS, "seed": rng.randrange(10**6)}


def _drive_training(namespace, case: dict) -> dict:
    from infra_lib.training.scratch_train import train_tiny, train_tiny_torch

    first: dict = {}
    if namespace is torch_training():
        from infra_lib.training.autograd import training_loss
        from infra_lib.training.scratch_train import tiny_setup

        model, batches, run = tiny_setup(case["seed"])
        watch = _Watch(torch_reference())
        loss, _ = training_loss(model, *next(batches), watch.mapping(), run.z_loss)
        loss.backward()
        losses = train_tiny_torch(case["steps"], seed=case["seed"], first_grads=first)
    else:
        learner_names(namespace, "lab05.train_tiny", NAMES)
        watch = _Watch(namespace)
        update = namespace["adamw_update"]

        def adamw(*args):
            watch.stop()  # the first step's backward is over
            result = _named_call("adamw_update", 5, update, *args)
            if result is not None:
                raise TypeError(f"your adamw_update returned a {type(result).__name__}: it works in place (task 5)")

        with NoTorchAutograd(), NoTorchAdam():
            losses = train_tiny(case["steps"], ops=watch.mapping(), adamw=adamw, seed=case["seed"], first_grads=first)
    return {
        "losses": losses,
        "first_grads": {name: grad.double().tolist() for name, grad in first.items()},
        "calls": watch.finish(),
    }


def _differing_gradients(got: dict, want: dict) -> list[str]:
    """The parameters whose first-step gradient differs from torch's by more than 1e-6 of its largest entry."""
    import numpy as np

    differ = []
    for name, expected in want.items():
        expected = np.asarray(expected, dtype=np.float64)
        try:
            mine = np.asarray(got.get(name), dtype=np.float64)
        except (TypeError, ValueError):
            differ.append(name)
            continue
        scale = float(np.abs(expected).max()) if expected.size else 0.0
        if mine.shape != expected.shape or not (np.abs(mine - expected) <= 1e-6 * scale + 1e-300).all():
            differ.append(name)
    return differ


def _which_call(row: dict) -> str:
    return f"your {row['op']} (call {row['nth']} of {row['of']} in the model's forward)"


def _agree(got, want) -> bool:
    """Two recorded fingerprints agree, or neither was recorded (a backward_fn that never ran on either side)."""
    return (got is None and want is None) or _same(got, want)


def _op_blame(got: dict, want: dict) -> str | None:
    """Which op or task the first step's watched calls point at (the weights are torch's there); None when every
    call agrees with torch's."""
    rows, expected = got.get("calls") or [], want["calls"]
    if len(rows) != len(expected) or not all(r["op"] == e["op"] for r, e in zip(rows, expected)):
        return None
    for row, want_row in zip(rows, expected):
        if not _same(row["out"], want_row["out"]):
            return (
                f"on the first step the output of {_which_call(row)} already differs from torch's, all the ops "
                f"before it agreeing: {row['op']} is task {TASK_OF[row['op']]}, whose checks say which case"
            )
    for row, want_row in zip(reversed(rows), reversed(expected)):
        if row["calls"] != want_row["calls"]:
            return (
                f"on the first step your engine called the backward_fn of {_which_call(row)} {row['calls']} "
                f"times: task 1, a node passes its gradient on once, after every share has arrived"
            )
        if not _agree(row["grad_in"], want_row["grad_in"]):
            return (
                f"on the first step the gradient that reached {_which_call(row)} differs from torch's, though "
                "every op after it returned torch's shares: task 1, the engine's sums"
            )
        for i, (share, want_share) in enumerate(zip(row["shares"], want_row["shares"])):
            if want_share is not None and (share is None or not _same(share, want_share)):
                name = PARENTS.get(row["op"], ("x",))[i]
                return (
                    f"on the first step {_which_call(row)} returned another share for {name} than torch's "
                    f"from the same incoming gradient: {row['op']} is task {TASK_OF[row['op']]}, whose "
                    "checks say which case"
                )
    return None


def _blame(got: dict, want: dict, grads_differ: bool) -> str:
    """Which task the first step points at: an op's call, else the engine's sums, else the update."""
    said = _op_blame(got, want)
    if said:
        return said
    if grads_differ:
        return (
            "on the first step every op returned torch's shares, yet the parameters' .grad differ: task 1, "
            "the engine's sums into .grad"
        )
    return "the first step's gradients agree with torch.autograd's, so the update differs: your adamw_update (task 5)"


def _compare_training(got, expected, case: dict) -> Mismatch | None:
    if type(got) is not dict or type(got.get("losses")) is not list or type(got.get("first_grads")) is not dict:
        return Mismatch("the check recorded a malformed result", f"got {got!r:.80}")
    losses, want = got["losses"], expected["losses"]
    where = f"{case['steps']} steps of the tiny Llama, seed={case['seed']}"
    differ = _differing_gradients(got["first_grads"], expected["first_grads"])
    step = next(
        (
            i
            for i, (g, e) in enumerate(zip(losses, want), start=1)
            if not (is_number(g) and math.isclose(g, e, rel_tol=1e-6))
        ),
        None,
    )
    if step is None and not differ and len(losses) == len(want):
        rows = got.get("calls") or []
        again = next((row for row in rows if type(row) is dict and row.get("calls", 1) > 1), None)
        if again is not None:
            return Mismatch(
                "your engine called a backward_fn more than once in one backward",
                f"on {where}: the losses and gradients agree, but on the first step the backward_fn of "
                f"{_which_call(again)} ran {again['calls']} times",
                hint="task 1: a node passes its gradient on once, after every share has arrived (a graph of many "
                "paths takes exponential time otherwise)",
            )
        said = _op_blame(got, expected)
        if said is None:
            return None
        return Mismatch(
            "on the first step one of your ops differs from torch's, though the losses and gradients agree",
            f"on {where}: the losses agree to a relative 1e-6 and the first step's gradients to 1e-6 of their "
            "largest entry, but not every op's output or shares on the first step (a wrong share of a small term, "
            "such as the z-loss, can move the parameters' gradients by less than that)",
            hint=said,
        )
    hint = _blame(got, expected, bool(differ))
    shown = ", ".join(f"{x:.6f}" if is_number(x) else repr(x) for x in losses[: (step or 1)])
    gradients = (
        f"; the first step's gradients of {len(differ)} of {len(expected['first_grads'])} parameters differ from "
        f"torch.autograd's by more than 1e-6 of their largest entry (e.g. {differ[0]})"
        if differ
        else "; the first step's gradients agree with torch.autograd's"
    )
    if step is None:
        return Mismatch(
            "training with your pieces gave other first-step gradients than torch.autograd",
            f"on {where}: the losses agree{gradients}",
            hint=hint,
        )
    return Mismatch(
        f"training with your pieces left torch's loss curve at step {step}",
        f"on {where}: the first {step - 1} losses agree, then step {step}'s loss is {losses[step - 1]!r:.12} instead "
        f"of {want[step - 1]:.10g} (relative tolerance 1e-6); your losses so far: [{shown}]{gradients}",
        hint=hint,
    )


register(
    Check(
        check_id="lab05.train_tiny",
        task=TASK,
        reference=torch_training,
        make_inputs=_training_inputs,
        drive=_drive_training,
        compare=_compare_training,
        hint=(
            "every step of the tiny Llama's training runs your Value's backward, your ops in every layer and in "
            "the loss (the course's training_loss: the cross-entropy plus PaLM's z-loss, whose log Z uses your "
            "exp, reduce_sum, log and reduce_mean) and your adamw_update on each parameter (step counted from 1); "
            "its losses must follow torch.autograd and torch.optim.AdamW at every step. A task whose own checks "
            "fail shows here first: fix that task (chapter 05, sections “1 · The chain rule as a graph” and "
            "“2 · One training step, measured: memory, mixed precision, checkpointing”)."
        ),
    )
)
