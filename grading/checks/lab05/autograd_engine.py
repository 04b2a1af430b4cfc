"""Lab 05 task 1: the engine, ``Value(data, parents, backward_fn)`` and ``Value.backward``.

The check builds small graphs on the learner's ``Value`` with ops of its own (scale by a number, add,
multiply, sum every element, multiply by a constant that gets no share), each node named and its
``backward_fn`` counting its calls, runs ``backward`` and records every named node's ``.grad`` and how
often each ``backward_fn`` ran. The reference side runs the same graphs on the course's engine.
"""

from __future__ import annotations

import functools
import random

from grading.checks.common import outcome, unwrap
from grading.checks.lab05.autograd_cases import READING, TASK_ENGINE, TASK_NAMES, first_problem, learner_names
from grading.checks.lab05.pieces import NoTorchAutograd, randn, record, tensor_problem, torch_equal
from grading.registry import Check, Mismatch, register

CHAIN_LENGTH = 10_000

SUM_OF_SHARES = "a value used twice receives the sum of both shares"
ONCE = (
    "a node passes its gradient on once, after every share has arrived: visit the nodes in reverse "
    "topological order, each node's backward_fn called exactly once"
)
EVERY_NODE = "every node the walk reaches keeps its .grad: the root and the interior nodes too, not only the inputs"
ACCUMULATE = "a second backward adds to the .grad already there, on every node it reaches, as torch does for leaves"
RECURSION = (
    "a chain of 10,000 nodes is deeper than Python's recursion limit: walk the graph with a loop and a list "
    "of your own, not by recursion"
)
UNTOUCHED = "backward reaches only the nodes the root was computed from; any other node keeps its .grad as it was"
NO_SHARE = "a share of None means no contribution: that parent's .grad stays as it was (None for a fresh input)"
DEFAULT = "backward() starts from ones of the root's own shape when the root holds one element"
NOT_A_LOSS = "backward() without a gradient is only defined for a root of one element: raise ValueError otherwise"
OWN_GRAD = (
    "a node must own its .grad: a share may be handed to several parents (an add passes the same tensor to "
    "both), so storing it without a copy and then adding in place changes another node's gradient too"
)
UNCHANGED = "backward changes only .grad: never a node's data, nor the gradient it was given"


class _Graph:
    """The check's own ops on a ``Value`` class: each node has a label, and its backward_fn counts its calls."""

    def __init__(self, make):
        self.make = make
        self.nodes: dict[str, object] = {}
        self.calls: dict[str, int] = {}
        self.kept: list[tuple[object, object]] = []  # (tensor as handed over, a copy): nothing may change them

    def _keep(self, tensor):
        self.kept.append((tensor, tensor.clone()))
        return tensor

    def leaf(self, label: str, shape: list[int], seed: int):
        node = self.make(self._keep(randn(seed, shape, "float64")))
        self.nodes[label] = node
        return node

    def _op(self, label: str, data, parents: tuple, backward):
        self.calls.setdefault(label, 0)

        def backward_fn(grad):
            self.calls[label] += 1
            return backward(grad)

        node = self.make(self._keep(data), parents, backward_fn)
        self.nodes.setdefault(label, node)  # a chain's links share one label: the first is kept
        return node

    def scale(self, label: str, x, factor: float):
        return self._op(label, x.data * factor, (x,), lambda grad: (grad * factor,))

    def add(self, label: str, a, b):
        return self._op(label, a.data + b.data, (a, b), lambda grad: (grad, grad))  # one tensor, both parents

    def mul(self, label: str, a, b):
        return self._op(label, a.data * b.data, (a, b), lambda grad: (grad * b.data, grad * a.data))

    def total(self, label: str, x):
        return self._op(label, x.data.sum(), (x,), lambda grad: (grad * x.data.new_ones(x.data.shape),))

    def times_constant(self, label: str, x, constant):
        """``x * constant``, where the constant gets no share (None)."""
        return self._op(label, x.data * constant.data, (x, constant), lambda grad: (grad * constant.data, None))

    def result(self, labels=None) -> dict:
        labels = list(self.nodes) if labels is None else labels
        grads = {label: getattr(self.nodes[label], "grad", None) for label in labels}
        tensors = [(label, g) for label, g in grads.items() if g is not None and hasattr(g, "untyped_storage")]
        aliased = [
            [a, b]
            for i, (a, ga) in enumerate(tensors)
            for b, gb in tensors[i + 1 :]
            if ga.numel() and ga.untyped_storage().data_ptr() == gb.untyped_storage().data_ptr()
        ]
        return {
            "grads": {label: None if g is None else record(g) for label, g in grads.items()},
            "calls": dict(self.calls),
            "aliased": aliased,
            "changed": not all(torch_equal(tensor, copy) for tensor, copy in self.kept),
        }


# --- the graphs ---------------------------------------------------------------------------------------


def _scale(graph: _Graph, seed: int) -> dict:
    x = graph.leaf("x (input)", [3], seed)
    y = graph.scale("y = 3x", x, 3.0)
    graph.total("root = sum(y)", y).backward()
    return graph.result()


def _add_two(graph: _Graph, seed: int) -> dict:
    a, b = graph.leaf("a (input)", [2, 3], seed), graph.leaf("b (input)", [2, 3], seed + 1)
    c = graph.add("c = a + b", a, b)
    graph.total("root = sum(c * b)", graph.mul("c * b", c, b)).backward()
    return graph.result()


def _diamond(graph: _Graph, seed: int) -> dict:
    x = graph.leaf("x (input)", [4], seed)
    u, v = graph.scale("u = 2x", x, 2.0), graph.scale("v = -3x", x, -3.0)
    graph.total("root = sum(u * v)", graph.mul("u * v", u, v)).backward()
    return graph.result()


def _reused_interior(graph: _Graph, seed: int) -> dict:
    x = graph.leaf("x (input)", [3], seed)
    h = graph.scale("h = 1.5x (used twice)", x, 1.5)
    far = graph.scale("b = 0.5a", graph.scale("a = 2h", h, 2.0), 0.5)
    c = graph.add("c = b + h", far, h)
    graph.total("root = sum(c * c)", graph.mul("c * c", c, c)).backward()
    return graph.result()


def _listed_twice(graph: _Graph, seed: int) -> dict:
    x = graph.leaf("x (input)", [2, 2], seed)
    y = graph.mul("y = x * x", x, x)
    graph.total("root = sum(z)", graph.add("z = y + y", y, y)).backward()
    return graph.result()


def _given_gradient(graph: _Graph, seed: int) -> dict:
    x = graph.leaf("x (input)", [2, 3], seed)
    root = graph.mul("root = 2x * x", graph.scale("y = 2x", x, 2.0), x)
    root.backward(graph._keep(randn(seed + 7, [2, 3], "float64")))
    return graph.result()


def _twice(graph: _Graph, seed: int) -> dict:
    a, b = graph.leaf("a (input)", [2], seed), graph.leaf("b (input)", [2], seed + 1)
    s = graph.add("s = a * a + b", graph.mul("a * a", a, a), b)
    root = graph.total("root = sum(s)", s)
    root.backward()
    root.backward()
    return graph.result()


def _chain(graph: _Graph, seed: int) -> dict:
    x = graph.leaf("x (input)", [2], seed)
    y = x
    for i in range(CHAIN_LENGTH):
        y = graph.scale("a link of the chain", y, 2.0 if i % 2 else 0.5)
    graph.total("root = sum(last link)", y).backward()
    return graph.result(["x (input)"])


def _unrelated(graph: _Graph, seed: int) -> dict:
    x = graph.leaf("x (input)", [3], seed)
    y = graph.scale("y = 2x", x, 2.0)
    graph.scale("z = 5x (not used by the root)", x, 5.0)
    graph.total("root = sum(y)", y).backward()
    return graph.result()


def _one_element(graph: _Graph, seed: int) -> dict:
    x = graph.leaf("x (input)", [1, 1], seed)
    graph.scale("root = 3x, shape [1, 1]", x, 3.0).backward()
    return graph.result()


def _no_default(graph: _Graph, seed: int) -> dict:
    x = graph.leaf("x (input)", [2, 3], seed)
    y = graph.scale("root = 2x, shape [2, 3]", x, 2.0)
    try:
        y.backward()
    except Exception as exc:  # the learner's code may raise anything
        return {"raised": type(exc).__name__, "value_error": isinstance(exc, ValueError)}
    return {"raised": None, "value_error": False}


def _no_share(graph: _Graph, seed: int) -> dict:
    x, w = graph.leaf("x (input)", [3], seed), graph.leaf("w (a constant)", [3], seed + 1)
    graph.total("root = sum(y)", graph.times_constant("y = x * w, no share for w", x, w)).backward()
    return graph.result()


def _fan_in(graph: _Graph, seed: int) -> dict:
    x = graph.leaf("x (input)", [2], seed)
    total = graph.scale("x * 1", x, 1.0)
    for k in range(2, 51):
        total = graph.add("a running sum", total, graph.scale("x * k", x, float(k)))
    graph.total("root = sum(x + 2x + ... + 50x)", total).backward()
    return graph.result(["x (input)"])


SCENARIOS = {
    "scale": (_scale, "one input scaled, then summed into a one-element root", DEFAULT),
    "add": (_add_two, "two inputs added, the sum times one of them", SUM_OF_SHARES),
    "diamond": (_diamond, "a diamond: x reaches the root through two nodes", SUM_OF_SHARES),
    "reused": (_reused_interior, "an interior node used by two nodes, along paths of different lengths", ONCE),
    "twice": (_listed_twice, "a parent listed twice (x * x, then y + y)", SUM_OF_SHARES),
    "given": (_given_gradient, "backward(grad) on a root of shape [2, 3]", UNCHANGED),
    "again": (_twice, "backward called twice on the same root", ACCUMULATE),
    "chain": (_chain, f"a chain of {CHAIN_LENGTH:,} nodes", RECURSION),
    "unrelated": (_unrelated, "a node the root does not depend on", UNTOUCHED),
    "one": (_one_element, "backward() on a root of shape [1, 1]", DEFAULT),
    "no_default": (_no_default, "backward() on a root of shape [2, 3], without a gradient", NOT_A_LOSS),
    "no_share": (_no_share, "a parent whose share is None", NO_SHARE),
    "fan_in": (_fan_in, "one input used by 50 nodes", SUM_OF_SHARES),
}


def _engine_cases(rng: random.Random) -> list[dict]:
    return [
        {"scenario": name, "seed": rng.randrange(10**6)}
        for name in ("scale", "add", "diamond", "twice", "reused", "given", "again")
    ]


def _engine_edges(rng: random.Random) -> list[dict]:
    return [
        {"scenario": name, "seed": rng.randrange(10**6)}
        for name in ("chain", "unrelated", "one", "no_default", "no_share", "fan_in")
    ]


@functools.cache
def _course_engine() -> dict:
    from infra_lib.training.autograd import Value

    return {"Value": Value}


_course_engine.target = "infra_lib.training.autograd:Value"  # what a sandboxed kernel sees as a stub


def _drive_engine(namespace, cases: list[dict]) -> list:
    def run(case):
        build = SCENARIOS[case["scenario"]][0]
        return build(_Graph(namespace["Value"]), case["seed"])

    if namespace is _course_engine():
        return [outcome(run, case) for case in cases]
    learner_names(namespace, "lab05.autograd_engine", TASK_NAMES[1])
    with NoTorchAutograd():
        return [outcome(run, case) for case in cases]


def _compare_case(case: dict, got, expected) -> Mismatch | None:
    _, label, hint = SCENARIOS[case["scenario"]]
    (kind, value), (_, want) = unwrap(got), unwrap(expected)
    where = f"{label} (the check's own ops on your Value)"
    if kind == "raised":
        return Mismatch(
            "your Value raised an exception",
            f"on {where}: your code raised {value}",
            hint=RECURSION if "RecursionError" in str(value) or "recursion" in str(value) else hint,
        )
    if kind != "value" or type(value) is not dict:
        return Mismatch("the check recorded a malformed result", f"on {where}: {value!r:.80}")
    if "value_error" in want:
        if not value.get("value_error"):
            raised = f"it raised {value.get('raised')}" if value.get("raised") else "it raised nothing"
            return Mismatch(
                "backward() without a gradient on a root of several elements must raise ValueError",
                f"on {where}: {raised}",
                hint=hint,
            )
        return None
    for node, count in want["calls"].items():
        ran = value["calls"].get(node, 0)
        if ran != count:
            return Mismatch(
                f"a node's backward_fn ran {'more' if ran > count else 'fewer'} times than once per backward",
                f"on {where}: the backward_fn of node '{node}' ran {ran} times instead of {count} (the check "
                "counts its calls)",
                hint=UNTOUCHED if count == 0 else ONCE,
            )
    for node, want_grad in want["grads"].items():
        grad = value["grads"].get(node)
        if (grad is None) != (want_grad is None):
            missing = grad is None
            return Mismatch(
                f"a node's .grad is {'None' if missing else 'set'} after backward",
                f"on {where}: node '{node}' should hold "
                + (f"a gradient of shape {want_grad['shape']}" if missing else "no gradient (None)"),
                hint=EVERY_NODE if missing and "input" not in node else hint,
            )
        if grad is None:
            continue
        problem = tensor_problem(
            "backward", grad, want_grad, f"{where}, node '{node}'", {}, "a node's .grad is wrong", noun="a node's .grad"
        )
        if problem:
            return Mismatch(problem.what, problem.detail, hint=_grad_hint(case, value, grad, want_grad, hint))
    if value["changed"]:
        return Mismatch(
            "backward changed a node's data or the gradient passed to it",
            f"on {where}: a tensor handed to your Value holds other values after backward",
            hint=UNCHANGED,
        )
    return None


def _grad_hint(case: dict, value: dict, grad: dict, want_grad: dict, hint: str) -> str:
    """The idea a wrong .grad points at: after two backward calls, a .grad that holds one call's gradient was
    overwritten (however the engine stores its shares); otherwise gradients stored as shared tensors, where
    they are, before the scenario's own idea."""
    import numpy as np

    if case["scenario"] == "again" and "values" in grad and "values" in want_grad:
        got, want = np.asarray(grad["values"], dtype=float), np.asarray(want_grad["values"], dtype=float)
        if got.shape == want.shape and np.allclose(got, want / 2, rtol=1e-9, atol=1e-12):
            return ACCUMULATE
    return OWN_GRAD if value["aliased"] else hint


def _compare_engine(got, expected, cases: list[dict]) -> Mismatch | None:
    return first_problem(got, expected, cases, _compare_case)


_ENGINE_HINT = (
    "backward(grad) visits every node the root was computed from once, in reverse topological order, calling "
    "each backward_fn once all the shares of its gradient have arrived; every node reached keeps the sum of "
    f"its shares in .grad, and a second backward adds to it ({READING})."
)

register(
    Check(
        check_id="lab05.autograd_engine",
        task=TASK_ENGINE,
        reference=_course_engine,
        make_inputs=_engine_cases,
        drive=_drive_engine,
        compare=_compare_engine,
        hint=_ENGINE_HINT,
    )
)
register(
    Check(
        check_id="lab05.autograd_engine_edges",
        task=TASK_ENGINE,
        reference=_course_engine,
        make_inputs=_engine_edges,
        drive=_drive_engine,
        compare=_compare_engine,
        hint=_ENGINE_HINT + f" A chain of {CHAIN_LENGTH:,} nodes, a node the root does not depend on, a root of "
        "shape [1, 1], a root of several elements without a gradient (ValueError), a share of None, one input "
        "used by 50 nodes.",
    )
)
