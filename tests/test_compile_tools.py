"""Chapter 04's library: the FX fusion passes (lab 04's reference) and the torch.compile helpers.

Inductor compiles take seconds on a CPU, so only two tests run it (one shared fixture and the
speed comparison); the others use Dynamo alone or no compiler at all.
"""

from __future__ import annotations

import copy
import math
import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from conftest import check_fails

from grading import check
from infra_lib.kernels import fused_ops
from infra_lib.kernels.compile_tools import (
    CompileCount,
    GeneratedCode,
    GraphBreaks,
    Speedup,
    aten_ops,
    compare_speed,
    count_compiles,
    generated_code,
    graph_breaks,
)
from infra_lib.kernels.fused_ops import add_relu
from infra_lib.kernels.fx_passes import count_nodes, fuse_add_relu, fuse_silu, node_name, op_histogram

# Inductor imports torch.utils.mkldnn, which uses torch.jit.script_method and warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _inputs(seed: int = 0, shape=(3, 5)):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator), torch.randn(*shape, generator=generator)


def _rewrite(graph_pass, fn):
    """Trace ``fn``, run the pass, and check the outputs agree; return (module, histogram before)."""
    gm = torch.fx.symbolic_trace(fn)
    before = op_histogram(gm)
    x, y = _inputs()
    expected = fn(x, y)
    returned = graph_pass(gm)
    assert returned is gm, "a pass rewrites the module it is given and returns it"
    torch.testing.assert_close(gm(x, y), expected, atol=1e-6, rtol=1e-6)
    assert gm.code == gm.graph.python_code(root_module="self").src, "the code must be regenerated"
    return gm, before


# --- op_histogram -------------------------------------------------------------------------------


class _WithModules(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(5, 5)
        self.scale = torch.nn.Parameter(torch.ones(5))

    def forward(self, x, y):
        return torch.relu(self.lin(x) * self.scale + y.sigmoid())


def test_op_histogram_names_every_kind_of_node():
    gm = torch.fx.symbolic_trace(_WithModules())
    assert op_histogram(gm) == {
        "placeholder": 2,
        "Linear": 1,
        "get_attr": 1,
        "mul": 1,
        "sigmoid": 1,
        "add": 1,
        "relu": 1,
        "output": 1,
    }
    assert count_nodes(gm, "Linear") == 1 and count_nodes(gm, "silu") == 0
    assert [node_name(n) for n in gm.graph.nodes][:3] == ["placeholder", "placeholder", "Linear"]


def test_op_histogram_merges_the_spellings_of_one_operation():
    gm = torch.fx.symbolic_trace(lambda x: x * torch.mul(x, x).mul(2) * torch.sigmoid(x) + x.sigmoid())
    assert op_histogram(gm) == {"placeholder": 1, "mul": 4, "sigmoid": 2, "add": 1, "output": 1}


# --- fuse_silu ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, y: x * torch.sigmoid(x) + y,
        lambda x, y: torch.sigmoid(x) * x + y,
        lambda x, y: x * x.sigmoid() + y,
        lambda x, y: F.sigmoid(x) * x + y,  # recorded as x.sigmoid()
        lambda x, y: torch.mul(x, torch.sigmoid(x)) + y,
        lambda x, y: torch.mul(x.sigmoid(), x) + y,
        lambda x, y: x.mul(x.sigmoid()) + y,
    ],
    ids=["mul", "swapped", "method_sigmoid", "functional_sigmoid", "torch_mul", "torch_mul_swapped", "method_mul"],
)
def test_fuse_silu_rewrites_every_spelling(fn):
    gm, before = _rewrite(fuse_silu, fn)
    assert before["sigmoid"] == 1 and before["mul"] == 1
    assert op_histogram(gm) == {"placeholder": 2, "silu": 1, "add": 1, "output": 1}


def test_fuse_silu_rewrites_several_patterns_and_keeps_the_rest():
    def swiglu(x, y):
        gate = x + 1.0
        return (gate * torch.sigmoid(gate)) * (y * y.sigmoid())

    gm, _ = _rewrite(fuse_silu, swiglu)
    assert op_histogram(gm) == {"placeholder": 2, "add": 1, "silu": 2, "mul": 1, "output": 1}
    assert "torch.nn.functional.silu" in gm.code


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, y: x * torch.sigmoid(y),
        lambda x, y: y * torch.sigmoid(x),
        lambda x, y: x + torch.sigmoid(x),
        lambda x, y: torch.sigmoid(x) * torch.sigmoid(x),
        lambda x, y: x * torch.tanh(x),
        lambda x, y: x * torch.sigmoid(x * 1.0),
        lambda x, y: x * torch.sigmoid(input=x),  # the sigmoid's argument recorded as a keyword: lab 04 leaves it
    ],
    ids=["other_operand", "other_operand_swapped", "add", "two_sigmoids", "tanh", "other_node", "keyword_sigmoid"],
)
def test_fuse_silu_leaves_look_alikes_unchanged(fn):
    gm = torch.fx.symbolic_trace(fn)
    code = gm.code
    gm, before = _rewrite(fuse_silu, fn)
    assert op_histogram(gm) == before
    assert gm.code == code


def test_fuse_silu_keeps_a_sigmoid_with_other_users_and_its_mul():
    def reused(x, y):
        gate = torch.sigmoid(x)
        return x * gate + gate

    gm, before = _rewrite(fuse_silu, reused)
    assert op_histogram(gm) == before == {"placeholder": 2, "sigmoid": 1, "mul": 1, "add": 1, "output": 1}


# --- fuse_add_relu ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, y: torch.relu(x + y) * 2,
        lambda x, y: F.relu(x + y) * 2,
        lambda x, y: (x + y).relu() * 2,
        lambda x, y: torch.relu(torch.add(x, y)) * 2,
        lambda x, y: F.relu(x.add(y)) * 2,
        lambda x, y: torch.relu(x + 0.5) * y,
        lambda x, y: torch.relu(0.5 + x) * y,
        lambda x, y: F.relu(x + y, inplace=True) * 2,  # relu's own keyword: still relu(a + b)
    ],
    ids=[
        "torch_relu",
        "functional_relu",
        "method_relu",
        "torch_add",
        "method_add",
        "number",
        "number_first",
        "inplace_relu",
    ],
)
def test_fuse_add_relu_rewrites_every_spelling(fn):
    gm, _ = _rewrite(fuse_add_relu, fn)
    assert op_histogram(gm) == {"placeholder": 2, "add_relu": 1, "mul": 1, "output": 1}
    fused = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is add_relu)
    assert len(fused.args) == 2 and not fused.kwargs


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, y: torch.relu(torch.add(x, y, alpha=2)),
        lambda x, y: x.add(y, alpha=0.5).relu(),
        lambda x, y: torch.relu(x - y),
        lambda x, y: torch.relu(x * y),
        lambda x, y: torch.sigmoid(x + y),
        lambda x, y: torch.relu(x) + y,
        lambda x, y: torch.relu(input=x + y),  # the relu's argument recorded as a keyword: lab 04 leaves it
    ],
    ids=["alpha", "method_alpha", "sub", "mul", "sigmoid", "add_after_relu", "keyword_relu"],
)
def test_fuse_add_relu_leaves_look_alikes_unchanged(fn):
    gm, before = _rewrite(fuse_add_relu, fn)
    assert op_histogram(gm) == before
    assert count_nodes(gm, "add_relu") == 0


def test_fuse_add_relu_keeps_a_sum_with_other_users():
    def reused(x, y):
        total = x + y
        return torch.relu(total) * total.sum() + F.relu(x + y)

    gm, before = _rewrite(fuse_add_relu, reused)
    assert (before["relu"], before["add"]) == (2, 3)
    # `total` feeds a relu and a sum: kept with its relu; the other sum is fused; the last add stays.
    assert op_histogram(gm) == {"placeholder": 2, "add": 2, "relu": 1, "sum": 1, "add_relu": 1, "mul": 1, "output": 1}


def test_passes_compose_on_a_feed_forward_block():
    class FeedForward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = (torch.nn.Linear(5, 8), torch.nn.Linear(5, 8), torch.nn.Linear(8, 5))

        def forward(self, x, residual):
            gate = self.gate(x)
            return torch.relu(self.down(gate * torch.sigmoid(gate) * self.up(x)) + residual)

    torch.manual_seed(0)
    block = FeedForward().eval()
    gm, _ = _rewrite(lambda g: fuse_add_relu(fuse_silu(g)), block)
    assert op_histogram(gm) == {"placeholder": 2, "Linear": 3, "silu": 1, "mul": 1, "add_relu": 1, "output": 1}
    gm.graph.lint()


def test_add_relu_is_relu_of_the_sum_and_stays_one_node_when_traced():
    x, y = _inputs(1)
    torch.testing.assert_close(add_relu(x, y), torch.relu(x + y))
    torch.testing.assert_close(add_relu(x, 2.0), torch.relu(x + 2.0))
    # torch.fx.wrap patches the name in fused_ops itself, so calls through the module stay leaves.
    gm = torch.fx.symbolic_trace(lambda a, b: fused_ops.add_relu(a, b) * 2)
    assert op_histogram(gm) == {"placeholder": 2, "add_relu": 1, "mul": 1, "output": 1}


# --- compile helpers ---------------------------------------------------------------------------


class _NormLinearGelu(torch.nn.Module):
    """RMSNorm, a linear layer and GELU: several elementwise ops around one matmul."""

    def __init__(self, width: int = 32, hidden: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.lin = torch.nn.Linear(width, hidden)

    def forward(self, x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return F.gelu(self.lin(normed))


@pytest.fixture(scope="module")
def compiled_block():
    torch.manual_seed(0)
    block, x = _NormLinearGelu().eval(), torch.randn(8, 32)
    return block, x, generated_code(block, x)


def test_aten_ops_lists_what_eager_mode_runs():
    block, x = _NormLinearGelu().eval(), torch.randn(8, 32)
    ops = aten_ops(block, x)
    assert ops == [
        "aten.pow.Tensor_Scalar",
        "aten.mean.dim",
        "aten.add.Tensor",
        "aten.rsqrt.default",
        "aten.mul.Tensor",
        "aten.mul.Tensor",
        "aten.addmm.default",
        "aten.gelu.default",
    ]
    with_views = aten_ops(block, x, include_views=True)
    assert len(with_views) > len(ops) and set(ops) < set(with_views)  # the weight's transpose


def test_inductor_fuses_the_elementwise_ops_into_fewer_kernels(compiled_block):
    block, x, generated = compiled_block
    assert isinstance(generated, GeneratedCode)
    assert generated.kernels, "Inductor should generate at least one kernel"
    prefix = "cpp_fused_" if x.device.type == "cpu" else "triton_"
    assert all(name.startswith(prefix) for name in generated.kernels), generated.kernels
    assert generated.library_calls == ["extern_kernels.addmm"]  # the matmul goes to a library
    assert generated.launches == len(generated.kernels) + 1 < len(aten_ops(block, x))
    assert any("rsqrt" in name for name in generated.kernels)  # the whole norm is one kernel


def test_generated_code_excerpt_shows_the_launch_sequence(compiled_block):
    _, _, generated = compiled_block
    call = generated.call_function()
    assert call.startswith("def call(")
    assert all(f"{name}(" in call for name in generated.kernels) and "extern_kernels.addmm(" in call
    assert "assert_size_stride" not in call
    kernel = generated.kernel_source(generated.kernels[0], max_lines=5)
    assert kernel.startswith(generated.kernels[0]) and "more lines" in kernel
    excerpt = generated.excerpt(kernel_lines=5)
    assert excerpt.startswith(f"# {len(generated.kernels)} generated kernel(s)") and call in excerpt
    with pytest.raises(KeyError, match="no kernel named"):
        generated.kernel_source("missing")


def test_graph_breaks_reports_print_and_data_dependent_control_flow():
    def clean(x):
        return torch.sin(x) * 2

    def printing(x):
        y = torch.sin(x)
        print("between the two halves")
        return y * 2

    def data_dependent(x):
        if x.sum().item() > 0:
            return x * 2
        return x - 1

    assert graph_breaks(clean, torch.randn(4)) == GraphBreaks(graph_count=1, break_count=0, reasons=[])
    report = graph_breaks(printing, torch.randn(4))
    assert (report.graph_count, report.break_count) == (2, 1)
    assert "print" in report.reasons[0]
    report = graph_breaks(data_dependent, torch.randn(4))
    assert report.break_count == 1 and "item()" in report.reasons[0]


@pytest.mark.parametrize(
    "dynamic, per_call, symbolic",
    [
        (False, [1, 1, 1, 1, 0], [False, False, False, False]),  # static: a new graph per new shape
        (None, [1, 1, 0, 0, 0], [False, True]),  # automatic dynamic: the second shape makes dim 0 symbolic
        (True, [1, 0, 0, 0, 0], [True]),
    ],
)
def test_count_compiles_sees_recompilation(dynamic, per_call, symbolic):
    shapes = [(4, 3), (8, 3), (16, 3), (32, 3), (8, 3)]
    count = count_compiles(lambda x: F.silu(x) * 2, shapes, dynamic=dynamic)
    assert count == CompileCount(sum(per_call), per_call, symbolic)


def test_count_compiles_with_mark_dynamic_compiles_once():
    count = count_compiles(lambda x: x.softmax(-1), [(2, 4), (2, 8), (2, 16)], mark_dynamic=[1])
    assert (count.compiles, count.dynamic) == (1, [True])


def test_compare_speed_times_both_sides():
    speed = compare_speed(lambda x: torch.relu(x * 2 + 1), torch.randn(64), warmup=1, iters=3, backend="eager")
    assert isinstance(speed, Speedup)
    assert speed.eager_s > 0 and speed.compiled_s > 0 and speed.compile_s > 0
    assert speed.speedup == pytest.approx(speed.eager_s / speed.compiled_s)
    slower = Speedup(eager_s=1.0, compiled_s=2.0, compile_s=5.0)
    assert slower.speedup == 0.5 and math.isinf(slower.break_even_calls)
    assert Speedup(eager_s=3.0, compiled_s=1.0, compile_s=10.0).break_even_calls == pytest.approx(5.0)


def test_operator_spellings_are_the_ones_tracing_records():
    """The passes match on what symbolic_trace records; pin it so a torch upgrade that changes it shows here."""
    gm = torch.fx.symbolic_trace(lambda x: F.relu(x * torch.sigmoid(x) + x))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.sigmoid, operator.mul, operator.add, F.relu]


# --- lab 04's checks hold the keyword rules its text states ----------------------------------------


def _is_call(node, functions, method):
    if not isinstance(node, torch.fx.Node):
        return False
    return (
        node.target in functions if node.op == "call_function" else (node.op == "call_method" and node.target == method)
    )


def _silu_pass(*, keyword_sigmoid: bool):
    """fuse_silu, except that with ``keyword_sigmoid`` it also reads torch.sigmoid(input=x)."""

    def fuse(gm):
        for node in list(gm.graph.nodes):
            if not _is_call(node, (operator.mul, torch.mul), "mul") or len(node.args) != 2 or node.kwargs:
                continue
            for gate, x in (node.args, node.args[::-1]):
                if not _is_call(gate, (torch.sigmoid,), "sigmoid") or len(gate.users) != 1:
                    continue
                inputs = list(gate.args) + (list(gate.kwargs.values()) if keyword_sigmoid else [])
                if len(inputs) == 1 and inputs[0] is x:
                    with gm.graph.inserting_before(node):
                        silu = gm.graph.call_function(F.silu, (x,))
                    node.replace_all_uses_with(silu)
                    break
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm

    return fuse


def _add_relu_pass(*, relu_keywords_allowed: set):
    """fuse_add_relu, accepting a relu only when its keywords (and their values) are in the allowed set."""

    def fuse(gm):
        for node in list(gm.graph.nodes):
            if (
                not _is_call(node, (torch.relu, F.relu), "relu")
                or len(node.args) != 1
                or not set(node.kwargs.items()) <= relu_keywords_allowed
            ):
                continue
            add = node.args[0]
            if (
                not _is_call(add, (operator.add, torch.add), "add")
                or len(add.args) != 2
                or add.kwargs
                or len(add.users) != 1
            ):
                continue
            with gm.graph.inserting_before(node):
                fused = gm.graph.call_function(add_relu, tuple(add.args))
            node.replace_all_uses_with(fused)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return gm

    return fuse


def test_lab04_a_sigmoid_called_with_a_keyword_must_not_be_fused():
    check("lab04.fuse_silu_lookalikes", _silu_pass(keyword_sigmoid=False))
    text = check_fails("lab04.fuse_silu_lookalikes", _silu_pass(keyword_sigmoid=True))
    assert "replaced nodes it must leave alone" in text and "torch.sigmoid(input=x)" in text


def test_lab04_an_inplace_relu_is_fused_and_a_keyword_input_is_not():
    check(
        "lab04.fuse_add_relu_spellings", _add_relu_pass(relu_keywords_allowed={("inplace", False), ("inplace", True)})
    )
    text = check_fails("lab04.fuse_add_relu_spellings", _add_relu_pass(relu_keywords_allowed={("inplace", False)}))
    assert "left a relu(a + b) unfused" in text and "inplace=True" in text


def test_lab04_the_fused_call_takes_the_adds_operands_in_their_order():
    def swapped(gm):
        fuse_add_relu(gm)
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is add_relu:
                node.args = node.args[::-1]
        gm.recompile()
        return gm

    text = check_fails("lab04.fuse_add_relu_spellings", swapped)  # relu(0.5 + x) and relu(y + x) among them
    assert "takes other arguments than the pattern's" in text and "in the order the add had them" in text


def test_lab04_a_pass_must_rewrite_the_module_it_was_given():
    def copied(gm):
        return fuse_silu(torch.fx.GraphModule(gm, copy.deepcopy(gm.graph)))

    text = check_fails("lab04.fuse_silu", copied)
    assert "in place, and return that same module" in text and "it returned another GraphModule" in text


def test_lab04_a_mul_with_a_keyword_operand_must_not_be_fused():
    def keyword_mul_too(gm):
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is torch.mul and "other" in node.kwargs:
                node.args, node.kwargs = (*node.args, node.kwargs["other"]), {}
        return fuse_silu(gm)

    text = check_fails("lab04.fuse_silu_lookalikes", keyword_mul_too)
    assert "replaced nodes it must leave alone" in text and "other=torch.sigmoid(x)" in text
