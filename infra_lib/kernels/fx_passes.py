"""Hand-written ``torch.fx`` passes: find a pattern of nodes, replace it with one node.

A graph pass is what a compiler does between capturing a program and generating code.
These two fuse a pair of elementwise operations into one call, so the intermediate
tensor between them is never written to memory and read back:

- ``fuse_silu``: ``x * sigmoid(x)`` becomes ``F.silu(x)``;
- ``fuse_add_relu``: ``relu(a + b)`` becomes ``add_relu(a, b)`` (from ``fused_ops``).

Each pass works on the graph of a ``torch.fx.GraphModule`` (from ``torch.fx.symbolic_trace``),
changes it in place, and returns the same module with its Python code regenerated.
The functions here are the reference for lab 04.
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
import torch.fx
import torch.nn.functional as F

from infra_lib.kernels.fused_ops import add_relu

__all__ = ["count_nodes", "fuse_add_relu", "fuse_silu", "node_name", "op_histogram"]

# The spellings symbolic_trace records for each operation: call_function targets, and the
# method name of the call_method form (x.mul(y), x.sigmoid(), ...).
_MUL = ({operator.mul, torch.mul}, "mul")
_ADD = ({operator.add, torch.add}, "add")
_SIGMOID = ({torch.sigmoid}, "sigmoid")  # F.sigmoid(x) is recorded as x.sigmoid()
_RELU = ({torch.relu, F.relu}, "relu")


def node_name(node: torch.fx.Node) -> str:
    """A short name for what a node does: the function or method name for calls
    ("mul" for ``x * y``, ``torch.mul`` and ``x.mul(y)`` alike; "silu", "add_relu"),
    the submodule's class for ``call_module`` ("Linear"), else the node's op
    ("placeholder", "get_attr", "output")."""
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_module":
        return type(node.graph.owning_module.get_submodule(node.target)).__name__
    return node.op


def op_histogram(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How many nodes of each kind the graph holds, keyed by ``node_name``.

    Example: the graph of ``lambda x: x * torch.sigmoid(x)`` gives
    ``{"placeholder": 1, "sigmoid": 1, "mul": 1, "output": 1}``.
    """
    return dict(Counter(node_name(node) for node in gm.graph.nodes))


def count_nodes(gm: torch.fx.GraphModule, name: str) -> int:
    """How many nodes of the graph ``node_name`` calls ``name`` (0 when none)."""
    return op_histogram(gm).get(name, 0)


def _is_call(node: object, spelling: tuple[set, str]) -> bool:
    functions, method = spelling
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_function":
        return node.target in functions
    return node.op == "call_method" and node.target == method


def _finish(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Drop the nodes a rewrite left without users, check the graph, regenerate the code."""
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def _silu_input(mul: torch.fx.Node) -> torch.fx.Node | None:
    """The ``x`` of ``mul = x * sigmoid(x)`` (either order), or None when ``mul`` is not that."""
    if not _is_call(mul, _MUL) or len(mul.args) != 2 or mul.kwargs:
        return None
    for gate, x in (mul.args, mul.args[::-1]):
        if (
            _is_call(gate, _SIGMOID)
            and len(gate.args) == 1
            and not gate.kwargs
            and gate.args[0] is x
            and len(gate.users) == 1
        ):
            return x
    return None


def fuse_silu(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite every ``x * sigmoid(x)`` into one ``torch.nn.functional.silu(x)`` node.

    Matches ``*``, ``torch.mul`` and ``.mul`` with ``torch.sigmoid`` or ``.sigmoid()``, the
    sigmoid on either side. It leaves alone ``x * sigmoid(y)`` (two different operands) and
    a sigmoid whose result is also used elsewhere: that sigmoid must be computed anyway,
    so replacing only the multiply would compute the sigmoid twice and save nothing.

    Args:
        gm: a GraphModule, changed in place.

    Returns:
        ``gm``, with dead nodes removed, the graph linted and its code regenerated.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        x = _silu_input(node)
        if x is None:
            continue
        with graph.inserting_before(node):
            silu = graph.call_function(F.silu, (x,))
        node.replace_all_uses_with(silu)  # the mul and its sigmoid are now dead
    return _finish(gm)


def _relu_input(node: torch.fx.Node) -> object | None:
    """The argument of a ReLU node (``torch.relu``, ``F.relu`` with any ``inplace``, ``.relu()``)."""
    if not _is_call(node, _RELU) or len(node.args) != 1 or set(node.kwargs) - {"inplace"}:
        return None
    return node.args[0]


def fuse_add_relu(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite every ``relu(a + b)`` into one ``add_relu(a, b)`` node.

    Matches ``+``, ``torch.add`` and ``.add`` (``a`` or ``b`` may be a number) under
    ``torch.relu``, ``F.relu`` or ``.relu()``. It leaves alone an add with keyword arguments
    (``torch.add(a, b, alpha=2)`` is ``a + 2 * b``), and an add whose sum is also used
    elsewhere (the sum must then be kept, so nothing is saved).

    Args:
        gm: a GraphModule, changed in place.

    Returns:
        ``gm``, with dead nodes removed, the graph linted and its code regenerated.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        add = _relu_input(node)
        if not _is_call(add, _ADD) or len(add.args) != 2 or add.kwargs or len(add.users) != 1:
            continue
        with graph.inserting_before(node):
            fused = graph.call_function(add_relu, tuple(add.args))
        node.replace_all_uses_with(fused)
    return _finish(gm)
