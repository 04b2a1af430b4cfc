"""infra_lib.training.autograd: every op's values and gradients against torch.autograd and against
central differences, the graph walk (reuse, depth, accumulation), the errors a user meets, and the
course's Llama's loss and gradients."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from infra_lib.model import Llama, LlamaConfig
from infra_lib.model.attention import causal_mask
from infra_lib.training.autograd import (
    OP_NAMES,
    Plumbing,
    Value,
    cat,
    cross_entropy,
    embedding,
    exp,
    library_ops,
    llama_loss,
    log,
    matmul,
    numeric_gradient,
    reduce_mean,
    reduce_sum,
    repeat_kv,
    rms_norm,
    silu,
    softmax,
    training_loss,
    transpose,
)

# float32: torch.testing's defaults for float32; float64: tight, only summation order differs.
TOLERANCE = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def _torch_rms_norm(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _torch_causal_softmax(x):
    t, s = x.shape[-2:]
    return torch.softmax(x.masked_fill(~causal_mask(t, s), float("-inf")), dim=-1)


def _rotate_half(x):
    """The course's RoPE rotation, written with slicing, neg and cat (works on Values and tensors)."""
    half = x.shape[-1] // 2
    if isinstance(x, Value):
        return cat([-x[..., half:], x[..., :half]], dim=-1)
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


# name -> (our op on Values, the same maths in torch, input shapes)
OP_CASES = {
    "matmul 2-D": (lambda a, b: a @ b, lambda a, b: a @ b, [(3, 4), (4, 5)]),
    "matmul function": (matmul, torch.matmul, [(3, 4), (4, 5)]),
    "matmul [B,T,d]@[d,n]": (lambda a, b: a @ b, lambda a, b: a @ b, [(2, 3, 4), (4, 5)]),
    "matmul [B,H,T,d]@[B,H,d,T]": (lambda a, b: a @ b, lambda a, b: a @ b, [(2, 3, 4, 5), (2, 3, 5, 4)]),
    "matmul broadcast batch": (lambda a, b: a @ b, lambda a, b: a @ b, [(2, 1, 3, 4), (5, 4, 2)]),
    "add same shape": (lambda a, b: a + b, lambda a, b: a + b, [(2, 3, 4), (2, 3, 4)]),
    "add broadcast [2,3,4]+[4]": (lambda a, b: a + b, lambda a, b: a + b, [(2, 3, 4), (4,)]),
    "add broadcast both [2,1,4]+[3,1]": (lambda a, b: a + b, lambda a, b: a + b, [(2, 1, 4), (3, 1)]),
    "sub broadcast [3,1]-[2,1,4]": (lambda a, b: a - b, lambda a, b: a - b, [(3, 1), (2, 1, 4)]),
    "mul broadcast [2,3,4]*[3,1]": (lambda a, b: a * b, lambda a, b: a * b, [(2, 3, 4), (3, 1)]),
    "mul by constant": (lambda x: x * 2.5, lambda x: x * 2.5, [(3, 4)]),
    "constant times": (lambda x: -1.5 * x, lambda x: -1.5 * x, [(3, 4)]),
    "divide by constant": (lambda x: x / 3, lambda x: x / 3, [(3, 4)]),
    "number minus": (lambda x: 1 - x, lambda x: 1 - x, [(3, 4)]),
    "neg": (lambda x: -x, lambda x: -x, [(3, 4)]),
    "tensor constant * Value": (
        lambda x: torch.linspace(-1, 1, 4, dtype=x.data.dtype) * x,
        lambda x: torch.linspace(-1, 1, 4, dtype=x.dtype) * x,
        [(3, 4)],
    ),
    "tensor constant @ Value": (
        lambda x: torch.eye(3, dtype=x.data.dtype).flip(0) @ x,
        lambda x: torch.eye(3, dtype=x.dtype).flip(0) @ x,
        [(2, 3, 4)],
    ),
    "reshape": (lambda x: x.reshape(6, 4), lambda x: x.reshape(6, 4), [(2, 3, 4)]),
    "transpose": (lambda x: transpose(x, 1, 3), lambda x: x.transpose(1, 3), [(2, 3, 4, 5)]),
    "slice last dim": (lambda x: x[..., 1:4], lambda x: x[..., 1:4], [(2, 3, 6)]),
    "index int, None, step": (lambda x: x[0, None, :, ::2], lambda x: x[0, None, :, ::2], [(2, 3, 6)]),
    "cat last dim": (lambda a, b: cat([a, b]), lambda a, b: torch.cat([a, b], -1), [(2, 3), (2, 5)]),
    "cat dim 0": (lambda a, b: cat([a, b], dim=0), lambda a, b: torch.cat([a, b], 0), [(2, 3), (4, 3)]),
    "rotate half": (_rotate_half, _rotate_half, [(2, 3, 4, 8)]),
    "repeat_kv": (lambda x: repeat_kv(x, 3), lambda x: x.repeat_interleave(3, dim=1), [(2, 2, 3, 4)]),
    "rms_norm": (lambda x, w: rms_norm(x, w, 1e-5), lambda x, w: _torch_rms_norm(x, w, 1e-5), [(2, 3, 8), (8,)]),
    "softmax": (softmax, lambda x: torch.softmax(x, -1), [(2, 3, 5)]),
    "softmax causal": (lambda x: softmax(x, causal=True), _torch_causal_softmax, [(2, 3, 5, 5)]),
    "softmax causal, fewer queries": (lambda x: softmax(x, causal=True), _torch_causal_softmax, [(2, 3, 5)]),
    "silu": (silu, F.silu, [(3, 7)]),
    "sum": (lambda x: x.sum(), lambda x: x.sum(), [(3, 4)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", list(OP_CASES))
def test_op_matches_torch_autograd(case, dtype):
    ours, theirs, shapes = OP_CASES[case]
    torch.manual_seed(0)
    inputs = [torch.randn(shape, dtype=dtype) for shape in shapes]
    values = [Value(x.clone()) for x in inputs]
    leaves = [x.clone().requires_grad_() for x in inputs]
    out, expected = ours(*values), theirs(*leaves)
    torch.testing.assert_close(out.data, expected.detach(), **TOLERANCE[dtype], msg=f"{case}: forward")
    upstream = torch.randn_like(expected)
    out.backward(upstream)
    expected.backward(upstream)
    for i, (value, leaf) in enumerate(zip(values, leaves)):
        assert value.grad is not None and value.grad.shape == value.shape, f"{case}: input {i}'s grad shape"
        torch.testing.assert_close(value.grad, leaf.grad, **TOLERANCE[dtype], msg=f"{case}: gradient of input {i}")


# --- the graph walk -----------------------------------------------------------------------------


def test_a_value_used_twice_gets_the_sum_of_its_gradients():
    x = Value(torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64))
    (x * x + x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.data + 1)  # d/dx (x^2 + x)


def test_a_node_reached_by_two_paths_passes_its_gradient_on_once_complete():
    # b feeds the sum directly and through b * x: b must hold both shares before it passes its gradient to x
    torch.manual_seed(0)
    data = torch.randn(4, dtype=torch.float64)
    x, leaf = Value(data.clone()), data.clone().requires_grad_()
    b = x * 2.0
    (b + b * x).sum().backward()
    b_ref = leaf * 2.0
    (b_ref + b_ref * leaf).sum().backward()
    torch.testing.assert_close(x.grad, leaf.grad, rtol=1e-12, atol=1e-12)


def test_a_graph_deeper_than_the_recursion_limit_runs_backward():
    x = Value(torch.tensor(2.0))
    y = x
    for _ in range(3 * sys.getrecursionlimit()):
        y = y * 1.0
    y.backward()
    assert float(x.grad) == 1.0


def test_gradients_accumulate_over_backward_calls():
    a, b = Value(torch.tensor([1.0, 2.0])), Value(torch.tensor([3.0, 4.0]))
    loss = (a * a + b).sum()
    loss.backward()
    loss.backward()
    torch.testing.assert_close(a.grad, 2 * 2 * a.data)  # twice d/da; the intermediates' grads are not fed back
    torch.testing.assert_close(b.grad, torch.tensor([2.0, 2.0]))


def test_each_value_owns_its_gradient_tensor():
    a, b = Value(torch.tensor([1.0, 2.0])), Value(torch.tensor([3.0, 4.0]))
    (a + b).sum().backward()  # add hands the same upstream gradient to both inputs
    b.grad.zero_()  # as a learner's optimizer step might: a's gradient must not change with it
    torch.testing.assert_close(a.grad, torch.ones(2))


# --- the ops' special cases ---------------------------------------------------------------------


def test_causal_softmax_masked_entries_are_zero_with_zero_gradient():
    torch.manual_seed(0)
    x = Value(10 * torch.randn(2, 3, 6, 6))
    probs = softmax(x, causal=True)
    future = torch.ones(6, 6, dtype=torch.bool).triu(1).expand(2, 3, 6, 6)  # key j > query i
    assert (probs.data[future] == 0).all(), "masked probabilities must be exactly 0"
    torch.testing.assert_close(probs.data.sum(-1), torch.ones(2, 3, 6))
    probs.backward(torch.randn(2, 3, 6, 6))
    assert (x.grad[future] == 0).all(), "masked scores must get exactly 0 gradient"
    assert (x.grad[~future] != 0).any()


def test_embedding_repeated_ids_accumulate_into_their_row():
    torch.manual_seed(0)
    table = Value(torch.randn(5, 3, dtype=torch.float64))
    ids = torch.tensor([[1, 3, 1], [1, 0, 3]])
    rows = embedding(ids, table)
    torch.testing.assert_close(rows.data, table.data[ids])
    upstream = torch.randn(2, 3, 3, dtype=torch.float64)
    rows.backward(upstream)
    torch.testing.assert_close(table.grad[1], upstream[0, 0] + upstream[0, 2] + upstream[1, 0])
    torch.testing.assert_close(table.grad[3], upstream[0, 1] + upstream[1, 2])
    assert (table.grad[[2, 4]] == 0).all(), "rows no id picked get no gradient"
    leaf = table.data.clone().requires_grad_()
    F.embedding(ids, leaf).backward(upstream)
    torch.testing.assert_close(table.grad, leaf.grad)


@pytest.mark.parametrize("shape", [(6, 11), (2, 3, 11)], ids=["[N,V]", "[B,T,V]"])
def test_cross_entropy_matches_torch(shape):
    torch.manual_seed(0)
    logits = torch.randn(shape, dtype=torch.float64)
    targets = torch.randint(0, shape[-1], shape[:-1])
    value, leaf = Value(logits.clone()), logits.clone().requires_grad_()
    loss, expected = cross_entropy(value, targets), F.cross_entropy(leaf.reshape(-1, shape[-1]), targets.reshape(-1))
    assert loss.shape == ()
    torch.testing.assert_close(loss.data, expected.detach(), rtol=1e-12, atol=1e-12)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(value.grad, leaf.grad, rtol=1e-12, atol=1e-12)


def test_cross_entropy_stays_finite_for_huge_logits():
    torch.manual_seed(0)
    logits = 1e4 * torch.randn(4, 10)  # exp(1e4) overflows any float: only log-sum-exp with the max survives
    targets = torch.tensor([0, 3, 9, 5])
    value, leaf = Value(logits.clone()), logits.clone().requires_grad_()
    loss, expected = cross_entropy(value, targets), F.cross_entropy(leaf, targets)
    loss.backward()
    expected.backward()
    assert torch.isfinite(loss.data) and torch.isfinite(value.grad).all()
    torch.testing.assert_close(loss.data, expected.detach())
    torch.testing.assert_close(value.grad, leaf.grad)
    torch.testing.assert_close(value.grad.sum(-1), torch.zeros(4), atol=1e-6, rtol=0)


# --- central differences --------------------------------------------------------------------------


def test_numeric_gradient_of_a_known_function():
    x, y = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([3.0, 0.25, -1.0])
    grad_x, grad_y = numeric_gradient(lambda a, b: (a * a * b).sum(), [x, y])
    assert grad_x.dtype == torch.float64
    torch.testing.assert_close(grad_x, (2 * x * y).double(), rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(grad_y, (x * x).double(), rtol=1e-7, atol=1e-7)


NUMERIC_CASES = {
    "matmul": (lambda a, b: a @ b, [(3, 4), (2, 4, 2)]),
    "rms_norm": (lambda x, w: rms_norm(x, w, 1e-5), [(2, 5), (5,)]),
    "causal softmax": (lambda x: softmax(x, causal=True), [(2, 4, 4)]),
    "silu * broadcast": (lambda x, y: silu(x) * y, [(3, 4), (4,)]),
    "rotate half": (_rotate_half, [(2, 3, 6)]),
    "repeat_kv": (lambda x: repeat_kv(x, 2), [(1, 2, 3, 2)]),
    "cross_entropy": (lambda x: cross_entropy(x, torch.tensor([[1, 0, 4], [2, 2, 3]])), [(2, 3, 5)]),
    "embedding": (lambda table: embedding(torch.tensor([2, 0, 2, 1]), table), [(3, 4)]),
}


@pytest.mark.parametrize("case", list(NUMERIC_CASES))
def test_op_gradient_matches_central_differences(case):
    op, shapes = NUMERIC_CASES[case]
    torch.manual_seed(0)
    inputs = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
    weights = torch.randn(op(*[Value(x) for x in inputs]).shape, dtype=torch.float64)

    def f(*tensors):  # a scalar that weighs every output element differently
        return (op(*[Value(t) for t in tensors]) * weights).sum()

    values = [Value(x.clone()) for x in inputs]
    (op(*values) * weights).sum().backward()
    for i, (value, numeric) in enumerate(zip(values, numeric_gradient(f, inputs))):
        torch.testing.assert_close(value.grad, numeric, rtol=1e-6, atol=1e-7, msg=f"{case}: gradient of input {i}")


# --- the course's Llama ---------------------------------------------------------------------------


def _tiny_llama(dtype=torch.float32, **changes) -> Llama:
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=48
    ).replace(**changes)
    torch.manual_seed(0)
    model = Llama(config).to(dtype)
    with torch.no_grad():  # norm weights start at 1, which would hide a missing weight in rms_norm's backward
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _batch(vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (2, 7), generator=generator), torch.randint(0, vocab, (2, 7), generator=generator)


LLAMA_VARIANTS = {
    "tied, GQA": dict(),
    "untied, biases": dict(tie_embeddings=False, attention_bias=True, output_bias=True),
    "tied, one KV head per query head": dict(n_kv_heads=4),
}


@pytest.mark.parametrize("variant", list(LLAMA_VARIANTS))
def test_llama_loss_and_every_gradient_match_the_course_model(variant):
    model = _tiny_llama(**LLAMA_VARIANTS[variant])
    tokens, targets = _batch()
    reference = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    reference.backward()
    loss, params = llama_loss(model, tokens, targets)
    loss.backward()
    error = abs(float(loss.data) - reference.item())
    assert error < 1e-5, f"{variant}: loss {float(loss.data)} vs the model's {reference.item()}"
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    assert sorted(params) == sorted(names), "one Value per parameter name"
    for name, p in model.named_parameters(remove_duplicate=False):
        scale = float(p.grad.abs().max())
        error = float((params[name].grad - p.grad).abs().max())
        assert error <= 1e-5 * scale, f"{variant}: {name}'s gradient is off by {error:.2e} (largest entry {scale:.2e})"


def test_llama_loss_gradient_matches_central_differences_in_float64():
    """A tight check of the whole graph: the directional derivative along a random direction."""
    _assert_directional_derivative(lambda model, tokens, targets: llama_loss(model, tokens, targets), seed=2)


def _assert_directional_derivative(loss_of, seed: int) -> None:
    """``loss_of(model, tokens, targets) -> (loss, params)``'s gradient, along a random direction, equals the
    central difference of its loss, on the float64 tiny Llama."""
    model = _tiny_llama(torch.float64)
    tokens, targets = _batch()
    loss, params = loss_of(model, tokens, targets)
    loss.backward()
    torch.manual_seed(seed)
    direction = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    predicted = sum(float((params[name].grad * d).sum()) for name, d in direction.items())
    eps = 1e-6

    def loss_at(step: float) -> float:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(step * direction[name])
            value = float(loss_of(model, tokens, targets)[0].data)
            for name, p in model.named_parameters():
                p.sub_(step * direction[name])
        return value

    numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
    assert abs(predicted - numeric) <= 1e-7 * max(1.0, abs(numeric)), f"{predicted} vs central difference {numeric}"


# --- errors a user meets --------------------------------------------------------------------------


def test_matmul_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\) @ \(4, 5\)"):
        Value(torch.zeros(2, 3)) @ Value(torch.zeros(4, 5))
    with pytest.raises(ValueError, match=r"batch dims.*\(2,\) and \(3,\)"):
        Value(torch.zeros(2, 3, 4)) @ Value(torch.zeros(3, 4, 5))
    with pytest.raises(ValueError, match=r"at least 2-D"):
        Value(torch.zeros(3)) @ Value(torch.zeros(3, 2))


def test_backward_on_a_non_scalar_without_a_gradient_says_what_to_pass():
    y = Value(torch.zeros(2, 3)) * 2.0
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*backward\(grad\)"):
        y.backward()
    with pytest.raises(ValueError, match=r"\(3, 2\).*\(2, 3\)"):
        y.backward(torch.ones(3, 2))


def test_other_misuse_raises_clear_errors():
    with pytest.raises(ValueError, match=r"\(2, 3\) and \(4,\) do not broadcast"):
        Value(torch.zeros(2, 3)) + Value(torch.zeros(4))
    with pytest.raises(TypeError, match="float32 or float64"):
        Value(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="float32 or float64"):
        Value([1.0, 2.0])
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        embedding(torch.tensor([0, 5]), Value(torch.zeros(5, 2)))
    with pytest.raises(TypeError, match="int64"):
        embedding(torch.tensor([0.0]), Value(torch.zeros(5, 2)))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        cross_entropy(Value(torch.zeros(2, 5)), torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="embedding"):
        Value(torch.zeros(4, 2))[torch.tensor([0, 0])]
    with pytest.raises(ValueError, match=r"rms_norm weight must be \[4\]"):
        rms_norm(Value(torch.zeros(2, 4)), Value(torch.ones(3)), 1e-5)


# --- lab 05's contract: the module ops, the plumbing on any class, llama_loss on anyone's ops -----------


REDUCTION_CASES = {
    "sum all": (lambda x: reduce_sum(x), lambda x: x.sum(), (3, 4)),
    "sum dim 1": (lambda x: reduce_sum(x, 1), lambda x: x.sum(1), (3, 4, 5)),
    "sum dim -1 keepdim": (lambda x: reduce_sum(x, -1, keepdim=True), lambda x: x.sum(-1, keepdim=True), (3, 4)),
    "sum all keepdim": (lambda x: reduce_sum(x, None, True), lambda x: torch.sum(x, dim=None, keepdim=True), (2, 3)),
    "sum of 0-d": (lambda x: reduce_sum(x), lambda x: x.sum(), ()),
    "mean all": (lambda x: reduce_mean(x), lambda x: x.mean(), (3, 4)),
    "mean dim 0": (lambda x: reduce_mean(x, 0), lambda x: x.mean(0), (4, 3)),
    "mean dim -2 keepdim": (
        lambda x: reduce_mean(x, -2, keepdim=True),
        lambda x: x.mean(-2, keepdim=True),
        (2, 5, 3),
    ),
    "Value.sum method": (lambda x: x.sum(1, keepdim=True), lambda x: x.sum(1, keepdim=True), (3, 4)),
    "Value.mean method": (lambda x: x.mean(), lambda x: x.mean(), (3, 4)),
    "exp": (exp, torch.exp, (3, 4)),
    "log": (lambda x: log(exp(x)), lambda x: torch.log(torch.exp(x)), (3, 4)),
}


@pytest.mark.parametrize("case", list(REDUCTION_CASES))
def test_module_reductions_exp_and_log_match_torch_autograd(case):
    ours, theirs, shape = REDUCTION_CASES[case]
    torch.manual_seed(0)
    data = torch.randn(shape, dtype=torch.float64)
    value, leaf = Value(data.clone()), data.clone().requires_grad_()
    out, expected = ours(value), theirs(leaf)
    assert out.shape == expected.shape, case
    torch.testing.assert_close(out.data, expected.detach(), **TOLERANCE[torch.float64])
    upstream = torch.randn_like(expected)
    out.backward(upstream)
    expected.backward(upstream)
    torch.testing.assert_close(value.grad, leaf.grad, **TOLERANCE[torch.float64], msg=case)


def test_reductions_name_a_bad_dim():
    with pytest.raises(ValueError, match=r"reduce_sum: dim 2 is out of range for shape \(3, 4\)"):
        reduce_sum(Value(torch.zeros(3, 4)), 2)
    with pytest.raises(TypeError, match="reduce_mean: dim must be an int or None"):
        reduce_mean(Value(torch.zeros(3, 4)), (0, 1))


def test_the_module_leaves_the_builtin_sum_and_no_mean_in_its_namespace():
    """Lab 05's names are reduce_sum and reduce_mean: a global ``sum`` would hide Python's built-in for whoever
    star-imports the module, or for every later cell of a notebook that defines it."""
    from infra_lib.training import autograd

    assert "sum" not in vars(autograd) and "mean" not in vars(autograd)
    assert {"reduce_sum", "reduce_mean"} <= set(OP_NAMES) and not {"sum", "mean"} & set(OP_NAMES)
    namespace: dict = {}
    exec("from infra_lib.training.autograd import *", namespace)  # noqa: S102 (a fixed import line)
    assert "sum" not in namespace and sum([1, 2]) == 3


def test_causal_softmax_with_more_queries_than_keys_gives_rows_of_zeros():
    """Query i sits at position s - t + i: with t > s the first t - s queries see no key at all."""
    torch.manual_seed(0)
    x = Value(torch.randn(2, 6, 4, dtype=torch.float64))
    probs = softmax(x, causal=True)
    assert (probs.data[:, :2] == 0).all() and torch.isfinite(probs.data).all()
    torch.testing.assert_close(probs.data[:, 2:].sum(-1), torch.ones(2, 4, dtype=torch.float64))
    probs.backward(torch.randn(2, 6, 4, dtype=torch.float64))
    assert (x.grad[:, :2] == 0).all() and torch.isfinite(x.grad).all()


class _Node:
    """A class with nothing but the contract's constructor and attributes: what a learner's Value has."""

    def __init__(self, data, parents=(), backward_fn=None):
        self.data, self.parents, self.backward_fn, self.grad = data, parents, backward_fn, None


def test_plumbing_builds_nodes_of_any_class_with_the_contract_constructor():
    plumbing = Plumbing(_Node)
    x = _Node(torch.arange(24.0).reshape(2, 3, 4))
    for node in (
        plumbing.reshape(x, 6, 4),
        plumbing.transpose(x, 0, 2),
        plumbing.index(x, (..., slice(1, 3))),
        plumbing.cat([x, x], dim=1),
        plumbing.neg(x),
        plumbing.silu(x),
    ):
        assert type(node) is _Node and node.parents[0] is x
        shares = node.backward_fn(torch.ones_like(node.data))
        assert all(share.shape == x.data.shape for share in shares)
    with pytest.raises(TypeError, match="embedding"):
        plumbing.index(x, torch.tensor([0]))


def test_llama_loss_takes_anyones_ops_and_every_graded_op_but_exp_log_and_the_reductions_is_used():
    from learner_style.autograd import namespace

    from grading.checks.lab05.autograd_cases import torch_reference

    model = _tiny_llama(torch.float64)
    tokens, targets = _batch()
    reference = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    reference.backward()
    used = []

    def counting(ops):
        return {name: (fn if name == "Value" else _counted(name, fn, used)) for name, fn in ops.items()}

    for ops in (namespace(), torch_reference(), library_ops()):
        used.clear()
        loss, params = llama_loss(model, tokens, targets, counting(ops))
        loss.backward()
        assert abs(float(loss.data) - reference.item()) < 1e-5  # the course model's norms and softmax run in fp32
        for name, p in model.named_parameters(remove_duplicate=False):
            assert float((params[name].grad - p.grad).abs().max()) <= 1e-5 * float(p.grad.abs().max()), name
        assert set(used) == set(OP_NAMES) - {"Value", "exp", "log", "reduce_sum", "reduce_mean"}


def _counted(name, fn, used):
    def call(*args, **kwargs):
        used.append(name)
        return fn(*args, **kwargs)

    return call


def test_llama_loss_names_the_ops_it_lacks():
    model = _tiny_llama()
    tokens, targets = _batch()
    ops = {name: fn for name, fn in library_ops().items() if name != "softmax"}
    with pytest.raises(TypeError, match="ops lacks softmax"):
        llama_loss(model, tokens, targets, ops)
    assert list(library_ops()) == list(OP_NAMES)


# --- training_loss: the cross-entropy plus PaLM's z-loss, on anyone's ops ----------------------------------


def test_training_loss_adds_palms_z_loss_and_its_gradient_on_every_ops_mapping():
    from learner_style.autograd import namespace

    from grading.checks.lab05.autograd_cases import torch_reference
    from infra_lib.training.scratch_train import torch_llama_logits, torch_training_loss

    model = _tiny_llama(torch.float64).requires_grad_(True)
    tokens, targets = _batch()
    reference = torch_training_loss(model, tokens, targets, 1e-2)  # a coefficient large enough to see in the loss
    reference.backward()
    plain = float(llama_loss(model, tokens, targets)[0].data)
    with torch.no_grad():
        z = torch_llama_logits(model, tokens).exp().sum(-1).log()  # log Z of each position, [2, 7]
    assert z.shape == targets.shape
    assert abs(reference.item() - plain - 1e-2 * float((z * z).mean())) <= 1e-12 * reference.item()
    used = []
    for ops in (namespace(), torch_reference(), library_ops()):
        used.clear()
        counted = {name: (fn if name == "Value" else _counted(name, fn, used)) for name, fn in ops.items()}
        loss, params = training_loss(model, tokens, targets, counted, z_loss=1e-2)
        loss.backward()
        assert loss.data.shape == () and abs(float(loss.data) - reference.item()) <= 1e-12 * reference.item()
        for name, p in model.named_parameters(remove_duplicate=False):
            error = float((params[name].grad - p.grad).abs().max())
            assert error <= 1e-10 * float(p.grad.abs().max()), name
        assert set(used) == set(OP_NAMES) - {"Value"}  # the z-loss brings exp, log and the reductions in
        assert used[-8:] == ["cross_entropy", "exp", "reduce_sum", "log", "mul", "reduce_mean", "mul", "add"]


def test_training_loss_gradient_matches_central_differences_and_zero_gives_llama_loss():
    _assert_directional_derivative(lambda model, tokens, targets: training_loss(model, tokens, targets, z_loss=0.5), 3)
    model = _tiny_llama(torch.float64)
    tokens, targets = _batch()
    plain, _ = llama_loss(model, tokens, targets)
    assert float(training_loss(model, tokens, targets, z_loss=0)[0].data) == float(plain.data)
    assert float(training_loss(model, tokens, targets, z_loss=0.5)[0].data) > float(plain.data)


@pytest.mark.parametrize("bad", [-1e-4, float("nan"), float("inf"), "1e-4", True])
def test_training_loss_refuses_a_bad_coefficient(bad):
    model = _tiny_llama()
    with pytest.raises(ValueError, match="z_loss must be a finite number >= 0"):
        training_loss(model, *_batch(), z_loss=bad)
