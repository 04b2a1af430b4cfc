"""Checks for lab 04 (compilation): a node histogram of an FX graph, and two fusion passes.

Each check builds small ``torch.fx`` graphs from seeded choices of code blocks (the pattern
in its several spellings, look-alikes that must not match, and neutral filler), hands a
freshly traced GraphModule to the learner's function, and returns plain data: the kinds of
node the graph holds after the pass (named as torch.fx names their targets, not by task 1's
rule, which the checks never re-implement), whether the graph lints, whether its code was
regenerated, and the module's output on seeded inputs.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from grading.checks.common import array_mismatch, reference
from grading.registry import Check, Mismatch, register, register_shortcuts

register_shortcuts(
    "lab04",
    [
        "infra_lib.kernels.fx_passes:op_histogram",
        "infra_lib.kernels.fx_passes:node_name",
        "infra_lib.kernels.fx_passes:count_nodes",
        "infra_lib.kernels.fx_passes:fuse_silu",
        "infra_lib.kernels.fx_passes:fuse_add_relu",
    ],
)

_PASSES = "infra_lib.kernels.fx_passes"

# Code blocks: each line updates x from x, y, self.lin (nn.Linear(width, width)) and
# self.scale (a [width] parameter). A graph is a chain of blocks, traced with symbolic_trace.
_FILLER = {
    "add": "x = x + y",
    "affine": "x = x * 0.5 - y",
    "tanh": "x = torch.tanh(x) * y",
    "cos": "x = x.cos() + y",
    "gelu": "x = F.gelu(x)",
}
_MODULES = {
    "linear": "x = self.lin(x)",
    "scale": "x = x * self.scale",
    "linear_add": "x = self.lin(x) + self.scale",
}
_SILU = {
    "mul_sigmoid": "x = x * torch.sigmoid(x)",
    "sigmoid_mul": "x = torch.sigmoid(x) * x",
    "mul_method": "x = x * x.sigmoid()",
    "method_mul": "x = x.sigmoid() * x",
    "torch_mul": "x = torch.mul(x, torch.sigmoid(x))",
    "torch_mul_swapped": "x = torch.mul(torch.sigmoid(x), x)",
    "mul_of_method": "x = x.mul(x.sigmoid())",
    "swiglu": "x = (y * torch.sigmoid(y)) * x",
    "silu_then_mul": "x = x * torch.sigmoid(x) * y",
    "linear_silu": "h = self.lin(x); x = h * torch.sigmoid(h)",
}
_SILU_LOOKALIKES = {
    "other_operand": "x = x * torch.sigmoid(y)",
    "other_operand_swapped": "x = y * torch.sigmoid(x)",
    "sigmoid_reused": "g = torch.sigmoid(x); x = x * g + g",
    "sigmoid_reused_later": "g = x.sigmoid(); x = x * g - g.mean()",
    "add_not_mul": "x = x + torch.sigmoid(x)",
    "two_sigmoids": "x = torch.sigmoid(x) * torch.sigmoid(x)",
    "tanh_not_sigmoid": "x = x * torch.tanh(x)",
    "keyword_sigmoid": "x = x * torch.sigmoid(input=x)",  # the sigmoid's argument is a keyword: no match
    "keyword_mul": "x = torch.mul(x, other=torch.sigmoid(x))",  # the mul's operand is a keyword: no match
}
_ADD_RELU = {
    "torch_relu": "x = torch.relu(x + y)",
    "functional_relu": "x = F.relu(x + y)",
    "method_relu": "x = (x + y).relu()",
    "torch_add": "x = torch.relu(torch.add(x, y))",
    "method_add": "x = F.relu(x.add(y))",
    "swapped": "x = torch.relu(y + x)",
    "number": "x = F.relu(x + 1.0)",
    "number_first": "x = torch.relu(0.5 + x)",
    "linear_residual": "x = torch.relu(self.lin(x) + y)",
    "inplace_relu": "x = F.relu(x + y, inplace=True)",  # relu's own keyword: still a match
}
_ADD_RELU_LOOKALIKES = {
    "alpha": "x = torch.relu(torch.add(x, y, alpha=2))",
    "method_alpha": "x = x.add(y, alpha=0.5).relu()",
    "sum_reused": "s = x + y; x = torch.relu(s) * s",
    "sum_reused_later": "s = x + y; x = F.relu(s) - s.mean()",
    "sub_not_add": "x = torch.relu(x - y)",
    "mul_not_add": "x = torch.relu(x * y)",
    "sigmoid_not_relu": "x = torch.sigmoid(x + y)",
    "relu_then_add": "x = torch.relu(x) + y",
    "keyword_relu": "x = torch.relu(input=x + y)",  # the relu's argument is a keyword: no match
}
_BLOCKS = {**_FILLER, **_MODULES, **_SILU, **_SILU_LOOKALIKES, **_ADD_RELU, **_ADD_RELU_LOOKALIKES}


def _source(graph: dict) -> str:
    lines = ["def forward(self, x, y):"] + [f"    {_BLOCKS[name]}" for name in graph["blocks"]] + ["    return x"]
    return "\n".join(lines)


def _describe(graph: dict) -> str:
    source, width = _source(graph), graph["width"]
    shapes = f"x, y: [{graph['rows']}, {width}]"
    if "self.lin" in source:
        shapes += f"; self.lin = nn.Linear({width}, {width})"
    if "self.scale" in source:
        shapes += f"; self.scale: [{width}]"
    return f"the graph traced from\n{source}\n({shapes})"


def _module(graph: dict):
    """A fresh nn.Module whose forward is the graph's code, with seeded weights."""
    import torch
    import torch.nn.functional as F

    namespace = {"torch": torch, "F": F}
    exec(_source(graph), namespace)  # noqa: S102 (the checks' own code: the blocks above)

    class Net(torch.nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.lin = torch.nn.Linear(width, width)
            self.scale = torch.nn.Parameter(torch.randn(width))

        forward = namespace["forward"]

    with torch.random.fork_rng():
        torch.manual_seed(graph["seed"])
        return Net(graph["width"]).eval()


def _trace(graph: dict):
    import torch.fx

    return torch.fx.symbolic_trace(_module(graph))


def _inputs(graph: dict):
    import torch

    generator = torch.Generator().manual_seed(graph["seed"] + 1)
    return [torch.randn(graph["rows"], graph["width"], generator=generator) for _ in range(2)]


def _node_kinds(gm) -> dict[str, int]:
    """How many nodes of each kind the graph holds, as torch.fx names what a node calls (its qualified
    target: "_operator.mul", "torch.sigmoid", "Tensor.sigmoid" for a method, the module's class path for a
    submodule call) or, for any other node, its op. The checks compare these between the learner's pass
    and the reference's; the lab's own short names (task 1) are the learner's to write."""
    from torch.fx.passes.tools_common import CALLABLE_NODE_OPS, get_node_target

    submodules = dict(gm.named_modules())
    kinds: dict[str, int] = {}
    for node in gm.graph.nodes:
        kind = node.op if node.op not in CALLABLE_NODE_OPS else get_node_target(submodules, node)
        kind = f"Tensor.{kind}" if node.op == "call_method" else kind
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _graph(rng: random.Random, blocks: list[str], fillers: int) -> dict:
    pool = list(_FILLER) + list(_MODULES)
    chain = blocks + [rng.choice(pool) for _ in range(fillers)]
    rng.shuffle(chain)
    return {"blocks": chain, "seed": rng.randrange(10**6), "rows": rng.randint(2, 3), "width": rng.choice([4, 5, 6])}


def _spread(rng: random.Random, names: list[str], graphs: int) -> list[list[str]]:
    """Deal ``names`` (shuffled) over ``graphs`` lists, so that every name is used once."""
    names = list(names)
    rng.shuffle(names)
    return [names[i::graphs] for i in range(graphs)]


# --- task 1: op_histogram --------------------------------------------------------------------


def _histogram_functions(rng: random.Random) -> list[dict]:
    plain = [name for name in _BLOCKS if "self." not in _BLOCKS[name]]
    return [_graph(rng, rng.sample(plain, 3), 0) for _ in range(3)]


def _histogram_modules(rng: random.Random) -> list[dict]:
    return [
        _graph(rng, [module, rng.choice(list(_SILU)), rng.choice(list(_ADD_RELU_LOOKALIKES))], 1) for module in _MODULES
    ]


def _drive_histogram(op_histogram, graphs: list[dict]) -> list:
    out = []
    for graph in graphs:
        counts = op_histogram(_trace(graph))
        out.append(dict(counts) if isinstance(counts, Mapping) else counts)
    return out


def _compare_histogram(got, expected, graphs) -> Mismatch | None:
    for graph, g, e in zip(graphs, got, expected):
        if type(g) is not dict:
            return Mismatch(
                "op_histogram must return a dict mapping names to counts", f"on {_describe(graph)}: got {g!r:.120}"
            )
        if g != e:
            wrong = sorted(k for k in set(g) | set(e) if g.get(k) != e.get(k))
            return Mismatch(
                "op_histogram counted the wrong nodes",
                f"on {_describe(graph)}:\nexpected {e},\ngot      {g}\n(keys that differ: {wrong})",
            )
    return None


_HISTOGRAM_HINT = (
    "every node of the graph counts once, under the name of what it does: a function call under the "
    "function's own name (x * y and torch.mul(x, y) are both 'mul'), a method call under the method's "
    "name, a submodule call under its class name, any other node under its op ('placeholder', "
    "'get_attr', 'output'). Keys are plain strings, not functions or their printed form (chapter 04, "
    "section “7 · Writing a graph pass with torch.fx”)."
)

register(
    Check(
        check_id="lab04.op_histogram",
        task="lab04 task 1: op_histogram",
        reference=reference(_PASSES, "op_histogram"),
        make_inputs=_histogram_functions,
        drive=_drive_histogram,
        compare=_compare_histogram,
        hint=_HISTOGRAM_HINT,
    )
)

register(
    Check(
        check_id="lab04.op_histogram_modules",
        task="lab04 task 1: op_histogram",
        reference=reference(_PASSES, "op_histogram"),
        make_inputs=_histogram_modules,
        drive=_drive_histogram,
        compare=_compare_histogram,
        hint=_HISTOGRAM_HINT + " A submodule call (self.lin(x)) is one call_module node, named by the submodule's "
        "class, not by the attribute that holds it; a parameter read (self.scale) is one get_attr node.",
    )
)


# --- tasks 2 and 3: the passes ----------------------------------------------------------------


def _drive_pass(graph_pass, graphs: list[dict]) -> list[dict]:
    """For each graph: what the pass returned, the histogram, lint, code freshness, output."""
    import torch
    import torch.fx

    results = []
    for graph in graphs:
        given = _trace(graph)
        returned = graph_pass(given)
        if not isinstance(returned, torch.fx.GraphModule):
            results.append({"returned": type(returned).__name__})
            continue
        entry = {
            "returned": "GraphModule",
            "same_module": returned is given,
            "histogram": _node_kinds(returned),
            "fused_calls": _fused_calls(returned),
            "lint": "",
            "stale": False,
            "error": "",
            "output": [],
        }
        try:
            returned.graph.lint()
        except Exception as exc:  # noqa: BLE001 (a malformed graph: the learner's to fix)
            entry["lint"] = f"{type(exc).__name__}: {exc}"[:300]
            results.append(entry)
            continue
        entry["stale"] = returned.code != returned.graph.python_code(root_module="self").src
        try:
            with torch.no_grad():
                entry["output"] = returned(*_inputs(graph)).double().tolist()
        except Exception as exc:  # noqa: BLE001 (the learner's module may raise anything)
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        results.append(entry)
    return results


def _fused_calls(gm) -> list[list]:
    """Each silu or add_relu call in graph order, with its positional arguments: the name of a node of
    the traced graph (names the pass does not change) or the printed form of a number."""
    import torch.fx

    calls = []
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name in ("silu", "add_relu"):
            calls.append([name, [a.name if isinstance(a, torch.fx.Node) else repr(a) for a in node.args]])
    return calls


# Hints for a pass whose matching may be right but whose rewrite is not finished.
_RETURN_HINT = (
    "a pass changes the graph of the module it is given, in place, and hands that same module back; "
    "the check runs what the pass returns."
)
_LINT_HINT = (
    "every node must come after the nodes it uses and before the nodes that use it, and no node may still "
    "use one that was erased: the lint message names the node in question (chapter 04, section “7 · "
    "Writing a graph pass with torch.fx”)."
)
_STALE_HINT = (
    "a GraphModule runs the Python code generated from its graph, and that code is generated again only "
    "when asked: after the graph changes, the module must regenerate it."
)
_ARGUMENTS_HINT = {
    "silu": "the fused node takes one positional argument, the x that the sigmoid and the mul share.",
    "add_relu": (
        "the fused node takes the add's two operands, positionally and in the order the add had them "
        "(relu(0.5 + x) becomes add_relu(0.5, x)), nothing else."
    ),
}
_LEFTOVER_HINT = (
    "the fused nodes are there, but other nodes differ: a node left without users still sits in the "
    "graph, and still runs, until dead-code elimination removes it; any other difference is a node that "
    "should have been left alone."
)


def _pass_compare(name: str, fused: str, pattern: str):
    def compare(got, expected, graphs) -> Mismatch | None:
        for graph, g, e in zip(graphs, got, expected):
            where = _describe(graph)
            if g["returned"] != "GraphModule":
                return Mismatch(
                    f"{name} must return the GraphModule it rewrote",
                    f"on {where}: it returned a {g['returned']}; end with `return gm`",
                    hint=_RETURN_HINT,
                )
            if not g["same_module"]:
                return Mismatch(
                    f"{name} must rewrite the GraphModule it is given, in place, and return that same module",
                    f"on {where}: it returned another GraphModule",
                    hint=_RETURN_HINT,
                )
            if g["lint"]:
                return Mismatch(
                    f"the graph after {name} is malformed (gm.graph.lint() fails)",
                    f"on {where}: {g['lint']}",
                    hint=_LINT_HINT,
                )
            if g["stale"]:
                return Mismatch(
                    f"after {name} the module still runs its old code: call gm.recompile() after changing gm.graph",
                    f"on {where}",
                    hint=_STALE_HINT,
                )
            if g["error"]:
                return Mismatch(f"the module returned by {name} raises when called", f"on {where}: {g['error']}")
            if g["histogram"] != e["histogram"]:
                got_fused, want_fused = (sum(call[0] == fused for call in x["fused_calls"]) for x in (g, e))
                other = [kind for kind in g["histogram"] if kind.endswith(f".{fused}") and kind not in e["histogram"]]
                hint = ""
                if got_fused < want_fused:
                    what = f"{name} left {pattern} unfused"
                elif got_fused > want_fused:
                    what = f"{name} replaced nodes it must leave alone"
                elif other:
                    wanted = [kind for kind in e["histogram"] if kind.endswith(f".{fused}")]
                    what = (
                        f"the {fused} nodes {name} inserted call {other[0]}, not the pattern's "
                        f"{wanted[0] if wanted else fused}"
                    )
                else:
                    what = (
                        f"the graph after {name} holds the wrong nodes (left-over dead nodes? "
                        "call gm.graph.eliminate_dead_code())"
                    )
                    hint = _LEFTOVER_HINT
                return Mismatch(
                    what, f"on {where}:\nexpected nodes {e['histogram']},\ngot            {g['histogram']}", hint=hint
                )
            if g["fused_calls"] != e["fused_calls"]:
                got_call, want_call = next((a, b) for a, b in zip(g["fused_calls"], e["fused_calls"]) if a != b)
                return Mismatch(
                    f"a {got_call[0]} node {name} inserted takes other arguments than the pattern's",
                    f"on {where}: expected {want_call[0]}({', '.join(want_call[1])}), got "
                    f"{got_call[0]}({', '.join(got_call[1])})",
                    hint=_ARGUMENTS_HINT[got_call[0]],
                )
            problem = array_mismatch(
                g["output"],
                e["output"],
                f"the module after {name} computes different values",
                where,
                atol=1e-5,
                rtol=1e-5,
            )
            if problem:
                return problem
        return None

    return compare


# fuse_silu

# Each pass: its task number, the fused op's name, the pattern it replaces in words.
_FUSIONS = {"fuse_silu": (2, "silu", "an x * sigmoid(x)"), "fuse_add_relu": (3, "add_relu", "a relu(a + b)")}


def pass_check(name: str) -> dict:
    """The fields every check of the pass ``name`` shares: the task, the reference pass, the driver and the
    comparison."""
    task, fused, pattern = _FUSIONS[name]
    return {
        "task": f"lab04 task {task}: {name}",
        "reference": reference(_PASSES, name),
        "drive": _drive_pass,
        "compare": _pass_compare(name, fused, pattern),
    }


def _silu_visible(rng: random.Random) -> list[dict]:
    return [_graph(rng, [name], 2) for name in ("mul_sigmoid", "sigmoid_mul", rng.choice(["mul_method", "swiglu"]))]


def _silu_spellings(rng: random.Random) -> list[dict]:
    return [_graph(rng, names, 1) for names in _spread(rng, list(_SILU), 3)]


def _silu_lookalikes(rng: random.Random) -> list[dict]:
    names = list(_SILU_LOOKALIKES)
    rng.shuffle(names)
    return [
        _graph(rng, [names[0]], 1),
        _graph(rng, [names[1], "sigmoid_reused"], 1),
        _graph(rng, names[2:] + [rng.choice(list(_SILU))], 0),
    ]


def _silu_lookalikes_visible(rng: random.Random) -> list[dict]:
    return [_graph(rng, ["other_operand"], 1), _graph(rng, ["sigmoid_reused", rng.choice(list(_SILU)[:4])], 1)]


_SILU_HINT = (
    "a match is a mul whose two positional operands are a sigmoid and that sigmoid's own positional input, "
    "the very same node (an identity test, not equal names or values), with the sigmoid on either side and "
    "the mul its only user; a mul and a sigmoid count whether called as a function or as a method (chapter "
    "04, section “7 · Writing a graph pass with torch.fx”)."
)

register(Check(check_id="lab04.fuse_silu", make_inputs=_silu_visible, hint=_SILU_HINT, **pass_check("fuse_silu")))

register(
    Check(
        check_id="lab04.fuse_silu_spellings",
        make_inputs=_silu_spellings,
        hint=_SILU_HINT
        + (
            " Every spelling counts: x * torch.sigmoid(x), torch.sigmoid(x) * x, x * x.sigmoid(), "
            "torch.mul(...), x.mul(x.sigmoid()); one graph may hold several patterns, some inside a longer "
            "product or on a Linear's output."
        ),
        **pass_check("fuse_silu"),
    )
)

register(
    Check(
        check_id="lab04.fuse_silu_no_match",
        make_inputs=_silu_lookalikes_visible,
        hint=_SILU_HINT
        + " x * sigmoid(y) is not SiLU; a sigmoid with another user must stay, and then its mul stays too.",
        **pass_check("fuse_silu"),
    )
)

register(
    Check(
        check_id="lab04.fuse_silu_lookalikes",
        make_inputs=_silu_lookalikes,
        hint=_SILU_HINT
        + (
            " Look-alikes must stay as they are: x + sigmoid(x), sigmoid(x) * sigmoid(x), x * tanh(x), "
            "x * sigmoid(y), a sigmoid used twice, and a sigmoid or mul whose operand is given as a keyword "
            "(torch.sigmoid(input=x), torch.mul(x, other=...)), which does not match."
        ),
        **pass_check("fuse_silu"),
    )
)


# fuse_add_relu


def _add_relu_visible(rng: random.Random) -> list[dict]:
    return [
        _graph(rng, [name], 2) for name in ("torch_relu", "functional_relu", rng.choice(["method_relu", "swapped"]))
    ]


def _add_relu_spellings(rng: random.Random) -> list[dict]:
    return [_graph(rng, names, 1) for names in _spread(rng, list(_ADD_RELU), 3)]


def _add_relu_lookalikes_visible(rng: random.Random) -> list[dict]:
    return [_graph(rng, ["alpha"], 1), _graph(rng, ["sum_reused", rng.choice(list(_ADD_RELU)[:3])], 1)]


def _add_relu_lookalikes(rng: random.Random) -> list[dict]:
    names = list(_ADD_RELU_LOOKALIKES)
    rng.shuffle(names)
    return [
        _graph(rng, names[:3], 1),
        _graph(rng, names[3:6], 0),
        _graph(rng, names[6:] + [rng.choice(list(_ADD_RELU))], 1),
    ]


_ADD_RELU_HINT = (
    "a match is a relu whose input is an add of exactly two operands with no keyword arguments, whose "
    "sum the relu alone uses; a relu and an add count whether called as a function or as a method. "
    "The no-keyword rule is the add's: F.relu records a keyword of its own (inplace, False or True) and "
    "still matches, while a relu whose input is itself passed as a keyword does not. The fused call "
    "takes the add's two operands in their order (chapter 04, section “7 · Writing "
    "a graph pass with torch.fx”)."
)

register(
    Check(
        check_id="lab04.fuse_add_relu",
        make_inputs=_add_relu_visible,
        hint=_ADD_RELU_HINT,
        **pass_check("fuse_add_relu"),
    )
)

register(
    Check(
        check_id="lab04.fuse_add_relu_spellings",
        make_inputs=_add_relu_spellings,
        hint=_ADD_RELU_HINT
        + (
            " Every spelling counts: a + b, torch.add(a, b), a.add(b) under torch.relu, F.relu "
            "(inplace=True too) or .relu(); a or b may be a number or a Linear's output."
        ),
        **pass_check("fuse_add_relu"),
    )
)

register(
    Check(
        check_id="lab04.fuse_add_relu_no_match",
        make_inputs=_add_relu_lookalikes_visible,
        hint=_ADD_RELU_HINT
        + (
            " torch.add(a, b, alpha=2) is a + 2 * b, not a plain sum: an add with keyword arguments "
            "stays as it is, and so does a sum with another user, which must be computed anyway."
        ),
        **pass_check("fuse_add_relu"),
    )
)

register(
    Check(
        check_id="lab04.fuse_add_relu_lookalikes",
        make_inputs=_add_relu_lookalikes,
        hint=_ADD_RELU_HINT
        + (
            " Look-alikes must stay as they are: relu(a - b), relu(a * b), sigmoid(a + b), relu(a) + b, "
            "an add with alpha, a sum used twice, a relu whose argument is given as a keyword "
            "(torch.relu(input=a + b))."
        ),
        **pass_check("fuse_add_relu"),
    )
)
