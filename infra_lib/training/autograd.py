"""Reverse-mode automatic differentiation over torch tensors: the chain rule as a graph.

Every op makes one ``Value`` node that remembers its parents and a ``backward_fn``: given the
gradient of the final output with respect to the node, it returns each parent's share. ``backward``
visits the nodes from the output back to the inputs (reverse topological order), so a node has
received every share before it passes its own gradient on; a Value used twice gets the sum.

    x, w = Value(torch.randn(3, 4)), Value(torch.randn(4, 2))
    loss = reduce_sum(silu(matmul(x, w)))
    loss.backward()  # x.grad [3, 4], w.grad [4, 2]

This module is lab 05's contract, written out: ``Value(data, parents, backward_fn)`` and its
``backward``, the graded ops (``add``, ``mul``, ``exp``, ``log``, ``matmul``, ``reduce_sum``, ``reduce_mean``,
``softmax``, ``rms_norm``, ``embedding``, ``cross_entropy``; ``OP_NAMES``), and the course-given
``Plumbing`` (reshape, transpose, slicing, cat, neg, silu, repeat_kv), which uses nothing but the
contract's constructor and so builds graphs of any class that has it. ``llama_loss`` runs the course's
``Llama`` on a mapping of those names: the library's own, or anyone's, so that a whole model's
gradients can be compared with ``torch.autograd``'s (``numeric_gradient`` checks any op on its own);
``training_loss`` adds PaLM's z-loss to it, the objective lab 05's training minimises.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Callable, Sequence

import torch

from infra_lib.model import Llama, LlamaConfig
from infra_lib.model.attention import causal_mask

BackwardFn = Callable[[torch.Tensor], Sequence["torch.Tensor | None"]]

# The names of lab 05's contract, as llama_loss takes them: the Value class and the graded ops.
OP_NAMES = (
    "Value",
    "add",
    "mul",
    "exp",
    "log",
    "matmul",
    "reduce_sum",
    "reduce_mean",
    "softmax",
    "rms_norm",
    "embedding",
    "cross_entropy",
)


class Value:
    """A tensor in the graph, with its gradient and the recipe that passes the gradient on.

    Attributes:
        data: the tensor, float32 or float64, any shape (detached: torch's autograd plays no part).
        grad: d(root)/d(data), same shape as ``data``; None until ``backward`` reaches this node.
            It accumulates over several ``backward`` calls, like torch's ``.grad``.
        parents: the Values this one was computed from; empty for an input.
        backward_fn: the gradient w.r.t. ``data`` -> one share per parent, in order (None: no share);
            None for an input.
        op: the op's name, for reading the graph (not part of the contract).
    """

    def __init__(
        self,
        data: torch.Tensor,
        parents: tuple[Value, ...] = (),
        backward_fn: BackwardFn | None = None,
        op: str = "input",
    ):
        if not isinstance(data, torch.Tensor) or not data.is_floating_point():
            kind = f"a {data.dtype} tensor" if isinstance(data, torch.Tensor) else type(data).__name__
            raise TypeError(
                f"Value wraps a float32 or float64 torch tensor, got {kind} "
                "(token ids go to embedding(ids, table) as a plain LongTensor)"
            )
        self.data = data.detach()
        self.grad: torch.Tensor | None = None
        self.parents = tuple(parents)
        self.backward_fn = backward_fn
        self.op = op

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def __repr__(self) -> str:
        return f"Value(shape={tuple(self.shape)}, dtype={self.data.dtype}, op={self.op!r})"

    def backward(self, grad: torch.Tensor | None = None) -> None:
        """Add d(self)/d(node) to ``.grad`` of every node that ``self`` was computed from, itself included.

        Each node's ``backward_fn`` runs once, after every share of its gradient has arrived; a node
        that receives no share (every child returned None for it) is left as it was. Nothing the
        walk touches is modified but ``.grad``: not ``data``, not ``grad``.

        Args:
            grad: the upstream gradient, ``self.shape``; may be left out when ``self`` holds one
                element (a loss), where it is 1.
        """
        if grad is None:
            if self.data.numel() != 1:
                raise ValueError(
                    f"backward() without a gradient needs a one-element output (a loss); this one has "
                    f"shape {tuple(self.shape)}: pass backward(grad) with a tensor of that shape"
                )
            grad = torch.ones_like(self.data)
        elif not isinstance(grad, torch.Tensor) or grad.shape != self.shape:
            got = f"shape {tuple(grad.shape)}" if isinstance(grad, torch.Tensor) else f"a {type(grad).__name__}"
            raise ValueError(f"backward(grad): grad has {got}, the output {tuple(self.shape)}")
        pending = {id(self): grad}  # node -> the sum of the shares it has received so far
        for node in reversed(topological_order(self)):
            node_grad = pending.pop(id(node), None)
            if node_grad is None:  # only None shares reached it
                continue
            node.grad = node_grad.clone() if node.grad is None else node.grad + node_grad
            if node.backward_fn is None:
                continue
            shares = tuple(node.backward_fn(node_grad))
            if len(shares) != len(node.parents):
                raise ValueError(
                    f"the backward_fn of {node!r} returned {len(shares)} shares for its {len(node.parents)} parents"
                )
            for i, (parent, share) in enumerate(zip(node.parents, shares)):
                if share is None:
                    continue
                if share.shape != parent.shape:
                    raise ValueError(
                        f"the backward_fn of {node!r} gave parent {i} a share of shape {tuple(share.shape)}; "
                        f"the parent is {tuple(parent.shape)}"
                    )
                pending[id(parent)] = pending[id(parent)] + share if id(parent) in pending else share

    def sum(self, dim: int | None = None, keepdim: bool = False) -> Value:
        return reduce_sum(self, dim, keepdim)

    def mean(self, dim: int | None = None, keepdim: bool = False) -> Value:
        return reduce_mean(self, dim, keepdim)

    def exp(self) -> Value:
        return exp(self)

    def log(self) -> Value:
        return log(self)

    def reshape(self, *shape: int) -> Value:
        return reshape(self, *shape)

    def transpose(self, dim0: int, dim1: int) -> Value:
        return transpose(self, dim0, dim1)

    def __add__(self, other) -> Value:
        return add(self, other)

    def __sub__(self, other) -> Value:
        return sub(self, other)

    def __rsub__(self, other) -> Value:
        return sub(other, self)

    def __mul__(self, other) -> Value:
        return mul(self, other)

    def __neg__(self) -> Value:
        return neg(self)

    def __matmul__(self, other) -> Value:
        return matmul(self, other)

    def __rmatmul__(self, other) -> Value:
        return matmul(other, self)

    __radd__, __rmul__ = __add__, __mul__  # a + b == b + a, with the same gradients

    def __truediv__(self, number: float) -> Value:
        if not isinstance(number, (int, float)):
            raise TypeError(f"a Value divides by a number only, got {type(number).__name__}")
        return mul(self, 1.0 / number)

    def __getitem__(self, index) -> Value:
        """Basic indexing (ints, slices, ``...``, None), e.g. ``x[..., :half]``."""
        return index_value(self, index)


def topological_order(root) -> list:
    """Every node ``root`` depends on, each after all of its parents (iterative depth-first search,
    so a graph deeper than Python's recursion limit is fine). Works on any class with ``parents``."""
    order, visited = [], set()
    stack = [(root, False)]
    while stack:
        node, parents_done = stack.pop()
        if parents_done:
            order.append(node)
        elif id(node) not in visited:
            visited.add(id(node))
            stack.append((node, True))  # comes back off the stack after all of its parents
            stack.extend((parent, False) for parent in node.parents if id(parent) not in visited)
    return order


def _as_value(x, like: Value | None = None) -> Value:
    """A Value as is; a tensor or a number as a constant input (a number takes ``like``'s dtype)."""
    if isinstance(x, Value):
        return x
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return Value(torch.tensor(float(x), dtype=like.data.dtype if like is not None else torch.float32))
    if isinstance(x, torch.Tensor):
        return Value(x)
    raise TypeError(f"expected a Value, a tensor or a number, got {type(x).__name__}")


def _pair(a, b) -> tuple[Value, Value]:
    return _as_value(a, b if isinstance(b, Value) else None), _as_value(b, a if isinstance(a, Value) else None)


def _broadcast_shape(a: torch.Size, b: torch.Size, what: str) -> torch.Size:
    try:
        return torch.broadcast_shapes(a, b)
    except RuntimeError:
        raise ValueError(
            f"{what}: shapes {tuple(a)} and {tuple(b)} do not broadcast (sizes must match or be 1, "
            "aligned from the last dim)"
        ) from None


def _sum_to_shape(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Undo broadcasting: sum ``grad`` over the dims that broadcasting added or stretched from 1."""
    while grad.dim() > len(shape):
        grad = grad.sum(0)
    for dim, size in enumerate(shape):
        if size == 1 and grad.shape[dim] != 1:
            grad = grad.sum(dim, keepdim=True)
    return grad


# --- elementwise, with torch broadcasting -------------------------------------------------------


def add(a, b) -> Value:
    """``a + b`` with torch broadcasting; each input's gradient is summed back to its own shape."""
    a, b = _pair(a, b)
    _broadcast_shape(a.shape, b.shape, "add")
    return Value(
        a.data + b.data, (a, b), lambda grad: (_sum_to_shape(grad, a.shape), _sum_to_shape(grad, b.shape)), "add"
    )


def sub(a, b) -> Value:
    """``a - b`` with torch broadcasting (not one of the graded ops: ``add`` of a ``neg``)."""
    a, b = _pair(a, b)
    _broadcast_shape(a.shape, b.shape, "sub")
    return Value(
        a.data - b.data, (a, b), lambda grad: (_sum_to_shape(grad, a.shape), _sum_to_shape(-grad, b.shape)), "sub"
    )


def mul(a, b) -> Value:
    """``a * b`` with torch broadcasting; a number or a plain tensor is a constant (``x * 0.5``)."""
    a, b = _pair(a, b)
    _broadcast_shape(a.shape, b.shape, "mul")
    return Value(
        a.data * b.data,
        (a, b),
        lambda grad: (_sum_to_shape(grad * b.data, a.shape), _sum_to_shape(grad * a.data, b.shape)),
        "mul",
    )


def exp(x) -> Value:
    """``e`` to the power of each element."""
    x = _as_value(x)
    out = x.data.exp()
    return Value(out, (x,), lambda grad: (grad * out,), "exp")


def log(x) -> Value:
    """The natural log of each element (of positive values)."""
    x = _as_value(x)
    return Value(x.data.log(), (x,), lambda grad: (grad / x.data,), "log")


# --- matmul and reductions ------------------------------------------------------------------------


def matmul(a, b) -> Value:
    """``a @ b``: ``[..., n, k] @ [..., k, m] -> [..., n, m]``, batch dims broadcast (e.g.
    ``[B, T, d] @ [d, n]``)."""
    a, b = _pair(a, b)
    if a.data.dim() < 2 or b.data.dim() < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"matmul needs [..., n, k] @ [..., k, m] (at least 2-D, inner sizes equal), "
            f"got {tuple(a.shape)} @ {tuple(b.shape)}"
        )
    _broadcast_shape(a.shape[:-2], b.shape[:-2], f"matmul {tuple(a.shape)} @ {tuple(b.shape)}, batch dims")

    def backward(grad):  # grad [..., n, m]
        return (
            _sum_to_shape(grad @ b.data.transpose(-1, -2), a.shape),
            _sum_to_shape(a.data.transpose(-1, -2) @ grad, b.shape),
        )

    return Value(a.data @ b.data, (a, b), backward, "matmul")


def _reduced_dim(x: Value, dim: int | None, what: str) -> int | None:
    """``dim`` as a non-negative index of ``x`` (None stays None); a 0-d tensor takes 0 and -1, as torch."""
    if dim is None:
        return None
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{what}: dim must be an int or None, got {dim!r}")
    size = max(x.data.dim(), 1)
    if not -size <= dim < size:
        raise ValueError(f"{what}: dim {dim} is out of range for shape {tuple(x.shape)}")
    return dim % size


def _spread(grad: torch.Tensor, x: Value, dim: int | None, keepdim: bool) -> torch.Tensor:
    """The gradient of a reduction's output, put back along the reduced dims: ``x``'s shape."""
    if x.data.dim() == 0:
        return grad.reshape(())
    if dim is None:
        grad = grad.reshape([1] * x.data.dim())
    elif not keepdim:
        grad = grad.unsqueeze(dim)
    return grad.expand(x.shape)


def reduce_sum(x, dim: int | None = None, keepdim: bool = False) -> Value:
    """The sum over ``dim`` (None: every element, a 0-d Value), ``keepdim`` as torch's (``Value.sum``).

    Not named ``sum``: a module-level ``sum`` would hide Python's built-in wherever it is imported with ``*``
    or defined in a notebook."""
    x = _as_value(x)
    dim = _reduced_dim(x, dim, "reduce_sum")
    return Value(
        torch.sum(x.data, dim=dim, keepdim=keepdim), (x,), lambda grad: (_spread(grad, x, dim, keepdim),), "sum"
    )


def reduce_mean(x, dim: int | None = None, keepdim: bool = False) -> Value:
    """The mean over ``dim`` (None: every element, a 0-d Value), ``keepdim`` as torch's (``Value.mean``)."""
    x = _as_value(x)
    dim = _reduced_dim(x, dim, "reduce_mean")
    count = x.data.numel() if dim is None or x.data.dim() == 0 else x.shape[dim]
    return Value(
        torch.mean(x.data, dim=dim, keepdim=keepdim),
        (x,),
        lambda grad: (_spread(grad, x, dim, keepdim) / count,),
        "mean",
    )


# --- the course-given plumbing, on any Value class --------------------------------------------------


class Plumbing:
    """The ops a model needs that only move elements around, and silu, built with nothing but the
    contract's constructor ``value_cls(data, parents, backward_fn)`` and the ``.data`` of its Values:
    they make graphs of the library's ``Value`` or of any class with that constructor.

    Args:
        value_cls: the class whose nodes these ops make.
    """

    def __init__(self, value_cls: type):
        self.value_cls = value_cls

    def _node(self, data: torch.Tensor, parents: tuple, backward_fn: BackwardFn, op: str):
        node = self.value_cls(data, parents, backward_fn)
        if isinstance(node, Value):
            node.op = op  # the library's own nodes carry their op's name, for reading a graph
        return node

    def reshape(self, x, *shape: int):
        """``x`` with the same elements in ``shape``; the gradient is reshaped back."""
        return self._node(x.data.reshape(*shape), (x,), lambda grad: (grad.reshape(x.data.shape),), "reshape")

    def transpose(self, x, dim0: int, dim1: int):
        """``x`` with dims ``dim0`` and ``dim1`` swapped; the gradient is swapped back."""
        return self._node(x.data.transpose(dim0, dim1), (x,), lambda grad: (grad.transpose(dim0, dim1),), "transpose")

    def index(self, x, index):
        """Basic indexing (ints, slices, ``...``, None), e.g. ``x[..., :half]``; the gradient lands in
        the selected positions, zeros elsewhere."""
        parts = index if isinstance(index, tuple) else (index,)
        if not all(p is Ellipsis or p is None or isinstance(p, (int, slice)) for p in parts):
            raise TypeError(
                f"index a Value with ints, slices, ... and None, got {index!r}; "
                "gather rows by id with embedding(ids, table)"
            )

        def backward(grad):
            full = torch.zeros_like(x.data)
            full[index] = grad
            return (full,)

        return self._node(x.data[index], (x,), backward, "slice")

    def cat(self, values: Sequence, dim: int = -1):
        """Concatenate along ``dim``; the gradient is cut back into the pieces."""
        values = tuple(values)
        sizes = [v.data.shape[dim] for v in values]
        return self._node(
            torch.cat([v.data for v in values], dim), values, lambda grad: tuple(grad.split(sizes, dim)), "cat"
        )

    def neg(self, x):
        """``-x``."""
        return self._node(-x.data, (x,), lambda grad: (-grad,), "neg")

    def silu(self, x):
        """``x * sigmoid(x)``, elementwise (the gate of a SwiGLU MLP)."""
        s = torch.sigmoid(x.data)
        return self._node(x.data * s, (x,), lambda grad: (grad * s * (1 + x.data * (1 - s)),), "silu")

    def repeat_kv(self, x, group: int):
        """``[batch, n_kv_heads, t, head_dim] -> [batch, n_kv_heads * group, t, head_dim]``: query head ``h``
        reads key/value head ``h // group``; the backward sums the ``group`` copies' gradients."""
        if x.data.dim() != 4:
            raise ValueError(f"repeat_kv needs [batch, n_kv_heads, t, head_dim], got shape {tuple(x.data.shape)}")
        batch, n_kv_heads, t, head_dim = x.data.shape
        return self._node(
            x.data.repeat_interleave(group, dim=1),
            (x,),
            lambda grad: (grad.reshape(batch, n_kv_heads, group, t, head_dim).sum(2),),
            "repeat_kv",
        )


_OWN = Plumbing(Value)


def reshape(x, *shape: int) -> Value:
    """``x`` with the same elements in ``shape`` (a tensor is taken as a constant)."""
    return _OWN.reshape(_as_value(x), *shape)


def transpose(x, dim0: int, dim1: int) -> Value:
    """``x`` with dims ``dim0`` and ``dim1`` swapped."""
    return _OWN.transpose(_as_value(x), dim0, dim1)


def index_value(x, index) -> Value:
    """``x[index]`` with basic indexing (what ``Value.__getitem__`` does)."""
    return _OWN.index(_as_value(x), index)


def cat(values: Sequence, dim: int = -1) -> Value:
    """Concatenate Values (or constant tensors) along ``dim``."""
    return _OWN.cat([_as_value(v) for v in values], dim)


def neg(x) -> Value:
    """``-x``."""
    return _OWN.neg(_as_value(x))


def silu(x) -> Value:
    """``x * sigmoid(x)``."""
    return _OWN.silu(_as_value(x))


def repeat_kv(x, group: int) -> Value:
    """Each key/value head repeated for the ``group`` query heads that read it."""
    return _OWN.repeat_kv(_as_value(x), group)


# --- the Llama-specific ops -------------------------------------------------------------------------


def softmax_backward(probs: torch.Tensor, grad_probs: torch.Tensor) -> torch.Tensor:
    """The gradient of a softmax's input scores, from its output ``probs`` and the gradient of ``probs``.

    d p_i / d x_j = p_i (delta_ij - p_j), so the gradient is p * (g - sum_j g_j p_j), over the last dim.
    A masked entry (p exactly 0) gets exactly 0, and so does every entry of a row of zeros.

    Args:
        probs: ``[..., n]``, softmax over the last dim.
        grad_probs: ``[..., n]``, d(output)/d(probs).

    Returns:
        ``[..., n]``: d(output)/d(scores).
    """
    return probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))


def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``y = x / sqrt(mean(x^2) + eps) * weight`` (over the last dim).

    Args:
        x: ``[..., d]``, the op's input.
        weight: ``[d]``.
        grad_out: ``[..., d]``, d(output)/d(y).
        eps: inside the square root.

    Returns:
        (grad_x ``[..., d]``, grad_weight ``[d]``, summed over every leading dim).
    """
    inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
    normed = x * inv_rms
    grad_normed = grad_out * weight
    # d normed_i / d x_j = inv_rms * (delta_ij - normed_i * normed_j / d)
    grad_x = inv_rms * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
    return grad_x, (grad_out * normed).reshape(-1, x.shape[-1]).sum(0)


def rms_norm(x, weight, eps: float) -> Value:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; ``weight`` is ``[x.shape[-1]]``."""
    x, weight = _pair(x, weight)
    if x.data.dim() < 1:
        raise ValueError("rms_norm needs x of shape [..., d], got a 0-d tensor")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight must be [{x.shape[-1]}] for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    normed = x.data * torch.rsqrt(x.data.pow(2).mean(-1, keepdim=True) + eps)
    return Value(
        weight.data * normed, (x, weight), lambda grad: rms_norm_backward(x.data, weight.data, grad, eps), "rms_norm"
    )


def softmax(x, causal: bool = False) -> Value:
    """Softmax over the last dim.

    ``causal``: ``x`` is ``[..., t, s]`` and query ``i`` sits at position ``s - t + i`` (the last query
    at the last key, as the course's ``causal_mask``): keys past its position are masked, their
    probability exactly 0 with exactly 0 gradient. A query before every key (``t > s``) sees no key at
    all: its whole row is 0.
    """
    x = _as_value(x)
    scores = x.data
    if not causal:
        probs = torch.softmax(scores, dim=-1)
    else:
        if scores.dim() < 2:
            raise ValueError(f"causal softmax needs scores [..., t, s], got shape {tuple(x.shape)}")
        keep = causal_mask(*scores.shape[-2:], scores.device)  # [t, s]
        blind = ~keep.any(-1, keepdim=True)  # [t, 1]: rows with no key to see
        scores = scores.masked_fill(~keep, float("-inf")).masked_fill(blind, 0.0)
        probs = torch.softmax(scores, dim=-1).masked_fill(blind, 0.0)
    return Value(probs, (x,), lambda grad: (softmax_backward(probs, grad),), "softmax")


def embedding(ids: torch.Tensor, table) -> Value:
    """Rows of ``table`` ``[vocab, dim]`` picked by ``ids`` (int64, any shape) -> ``[*ids.shape, dim]``.
    Each row's gradient is the sum over every position that picked it."""
    table = _as_value(table)
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.long:
        raise TypeError(f"embedding ids must be an int64 tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if table.data.dim() != 2:
        raise ValueError(f"embedding table must be [vocab, dim], got shape {tuple(table.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]):
        raise ValueError(f"embedding ids must lie in [0, {table.shape[0]}), got {int(ids.min())}..{int(ids.max())}")

    def backward(grad):  # [*ids.shape, dim]
        rows = torch.zeros_like(table.data)
        return (rows.index_add_(0, ids.reshape(-1), grad.reshape(-1, table.shape[1])),)

    return Value(table.data[ids], (table,), backward, "embedding")


def cross_entropy(logits, targets: torch.Tensor) -> Value:
    """Mean over positions of ``-log softmax(logits)[target]``, a 0-d Value; finite for any finite logits.

    Args:
        logits: ``[..., vocab]``.
        targets: int64 class ids, ``logits.shape[:-1]``.
    """
    logits = _as_value(logits)
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.long or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"cross_entropy targets must be int64 of shape {tuple(logits.shape[:-1])} for logits "
            f"{tuple(logits.shape)}, got {getattr(targets, 'dtype', type(targets).__name__)} "
            f"{tuple(getattr(targets, 'shape', ()))}"
        )
    vocab = logits.shape[-1]
    flat, ids = logits.data.reshape(-1, vocab), targets.reshape(-1)  # [n, vocab], [n]
    if ids.numel() == 0:
        raise ValueError("cross_entropy needs at least one position, got none")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"cross_entropy targets must lie in [0, {vocab}), got {int(ids.min())}..{int(ids.max())}")
    n = ids.numel()
    peak = flat.max(-1, keepdim=True).values  # subtracting the max keeps exp() finite for any logits
    log_sum_exp = peak + (flat - peak).exp().sum(-1, keepdim=True).log()  # [n, 1]
    loss = (log_sum_exp.squeeze(-1) - flat[torch.arange(n), ids]).mean()

    def backward(grad):  # d loss / d logits = (softmax - one_hot(target)) / n
        probs = (flat - log_sum_exp).exp()
        probs[torch.arange(n), ids] -= 1
        return ((probs * (grad / n)).reshape(logits.shape),)

    return Value(loss, (logits,), backward, "cross_entropy")


def library_ops() -> dict:
    """This module's own ``Value`` and graded ops, by the names of ``OP_NAMES``."""
    return {name: globals()[name] for name in OP_NAMES}


# --- checking gradients -------------------------------------------------------------------------


def numeric_gradient(
    f: Callable[..., Value | torch.Tensor], inputs: Sequence[torch.Tensor], eps: float = 1e-6
) -> list[torch.Tensor]:
    """Central differences ``(f(x + eps) - f(x - eps)) / (2 eps)``, one element at a time, in float64.

    Args:
        f: takes the inputs (float64 tensors) and returns a one-element Value or tensor.
        inputs: keep them small: ``f`` runs twice per element.
        eps: the step.

    Returns:
        d f / d input for each input, float64, the input's shape.
    """
    points = [x.detach().to(torch.float64).clone(memory_format=torch.contiguous_format) for x in inputs]

    def evaluate() -> float:
        out = f(*points)
        out = out.data if isinstance(out, Value) else out
        if out.numel() != 1:
            raise ValueError(f"numeric_gradient needs f to return one element, got shape {tuple(out.shape)}")
        return float(out)

    grads = []
    for x in points:
        flat, grad = x.view(-1), torch.zeros(x.numel(), dtype=torch.float64)
        for j in range(flat.numel()):
            saved = float(flat[j])
            flat[j] = saved + eps
            up = evaluate()
            flat[j] = saved - eps
            down = evaluate()
            flat[j] = saved
            grad[j] = (up - down) / (2 * eps)
        grads.append(grad.view(x.shape))
    return grads


# --- the course's Llama, written with these ops ---------------------------------------------------


def _contract_ops(ops: Mapping) -> Mapping:
    """``ops`` when it maps every name of ``OP_NAMES``; else a TypeError naming what is missing."""
    if not isinstance(ops, Mapping):
        raise TypeError(f"ops must map the names {', '.join(OP_NAMES)} to objects, got a {type(ops).__name__}")
    missing = [name for name in OP_NAMES if name not in ops]
    if missing:
        raise TypeError(f"ops lacks {', '.join(missing)}; it must map every one of {', '.join(OP_NAMES)}")
    return ops


def llama_loss(
    model: Llama, tokens: torch.Tensor, targets: torch.Tensor, ops: Mapping | None = None
) -> tuple[Value, dict[str, Value]]:
    """The forward of ``model`` (no cache) and its next-token cross-entropy, built from Values.

    The loss equals ``F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())``. The graph uses
    only ``ops`` (every graded op but exp, log, reduce_sum and reduce_mean) and ``Plumbing(ops["Value"])``;
    constants (RoPE's cos and sin, the attention scale) enter as ``ops["Value"](tensor)``. ``training_loss``
    adds the z-loss that training minimises.

    Args:
        model: an ``infra_lib.model.Llama``; read, never changed.
        tokens: ``[batch, t]`` int64 ids.
        targets: ``[batch, t]`` int64 ids of the next tokens.
        ops: the names of ``OP_NAMES`` -> the class and functions to build the graph with (extra names are
            ignored); None: this module's own.

    Returns:
        (loss, params): the 0-d loss, and a Value per name of ``model.named_parameters(remove_duplicate=False)``
        whose ``.grad`` ``loss.backward()`` fills. A tied table is one Value under both names.
    """
    ops, logits, params = _llama_logits(model, tokens, targets, ops)
    return ops["cross_entropy"](logits, targets), params


def training_loss(
    model: Llama, tokens: torch.Tensor, targets: torch.Tensor, ops: Mapping | None = None, z_loss: float = 1e-4
) -> tuple[Value, dict[str, Value]]:
    """``llama_loss``'s cross-entropy plus PaLM's auxiliary z-loss, built from Values: what ``train_tiny`` minimises.

    ``z = log(reduce_sum(exp(logits), dim=-1))`` is the log of each position's softmax normaliser Z, and the
    loss is ``cross_entropy + z_loss * reduce_mean(z * z)`` (Chowdhery et al., *PaLM*, 2022, section 5:
    ``1e-4 * log^2 Z``). The term pulls log Z towards 0, the normaliser towards 1, so that the logits cannot
    drift upwards together; PaLM added it because it made training more stable. It makes the graph use exp, log,
    reduce_sum and reduce_mean (and mul of a node with itself), which the plain cross-entropy does not. The
    coefficient enters as ``ops["Value"](tensor)``, a constant.

    ``exp`` of the raw logits is fine for the course's small models, whose logits are small; a model with
    large logits would subtract each row's maximum first (log Z = max + log sum exp(logits - max)), as
    ``cross_entropy`` does.

    Args:
        model, tokens, targets, ops: as ``llama_loss``'s.
        z_loss: the coefficient, a finite number >= 0; 0 gives ``llama_loss``'s loss and graph.

    Returns:
        (loss, params), as ``llama_loss``'s.
    """
    if isinstance(z_loss, bool) or not isinstance(z_loss, (int, float)) or not 0 <= z_loss < math.inf:
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    ops, logits, params = _llama_logits(model, tokens, targets, ops)
    loss = ops["cross_entropy"](logits, targets)
    if z_loss == 0:
        return loss, params
    z = ops["log"](ops["reduce_sum"](ops["exp"](logits), dim=-1))  # [batch, t]: log Z of each position
    coefficient = ops["Value"](torch.tensor(float(z_loss), dtype=logits.data.dtype))
    return ops["add"](loss, ops["mul"](coefficient, ops["reduce_mean"](ops["mul"](z, z)))), params


def _llama_logits(model: Llama, tokens: torch.Tensor, targets: torch.Tensor, ops: Mapping | None):
    """(ops, logits ``[batch, t, vocab]``, params) of ``model`` on ``tokens``, for ``llama_loss``."""
    ops = library_ops() if ops is None else _contract_ops(ops)
    config = model.config
    if tokens.dim() != 2 or targets.shape != tokens.shape:
        raise ValueError(
            f"tokens and targets must both be [batch, t], got {tuple(tokens.shape)} and {tuple(targets.shape)}"
        )
    if tokens.shape[1] > config.max_position:
        raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds the model's context of {config.max_position}")
    make = ops["Value"]
    params, by_tensor = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params[name] = by_tensor.setdefault(id(p), make(p.detach()))
    graph = _LlamaGraph(ops, params, config, model.rope_cos[: tokens.shape[1]], model.rope_sin[: tokens.shape[1]])
    x = ops["embedding"](tokens, params["embed_tokens.weight"])  # [batch, t, d]
    for i in range(config.n_layers):
        layer = f"layers.{i}."
        h = ops["rms_norm"](x, params[layer + "input_layernorm.weight"], config.rms_norm_eps)
        x = ops["add"](x, graph.attention(h, layer + "self_attn."))
        h = ops["rms_norm"](x, params[layer + "post_attention_layernorm.weight"], config.rms_norm_eps)
        x = ops["add"](x, graph.mlp(h, layer + "mlp."))
    x = ops["rms_norm"](x, params["norm.weight"], config.rms_norm_eps)
    return ops, graph.linear(x, "lm_head"), params


class _LlamaGraph:
    """The blocks of ``llama_loss``, each made of ``ops`` and the plumbing of ``ops["Value"]``."""

    def __init__(self, ops: Mapping, params: dict, config: LlamaConfig, cos: torch.Tensor, sin: torch.Tensor):
        self.ops, self.params, self.config = ops, params, config
        self.plumbing = Plumbing(ops["Value"])
        make = ops["Value"]
        self.cos, self.sin = make(cos), make(sin)  # [t, head_dim], constants
        self.scale = make(torch.tensor(1 / math.sqrt(config.head_dim), dtype=cos.dtype))

    def linear(self, x, name: str):
        """``x @ W^T (+ b)``, as ``nn.Linear`` stores ``W``: ``[out, in]``."""
        y = self.ops["matmul"](x, self.plumbing.transpose(self.params[name + ".weight"], 0, 1))
        bias = self.params.get(name + ".bias")
        return y if bias is None else self.ops["add"](y, bias)

    def rope(self, x):
        """The course's rotate-half RoPE: dims ``i`` and ``i + head_dim/2`` turn together."""
        half, plumbing, ops = x.data.shape[-1] // 2, self.plumbing, self.ops
        rotated = plumbing.cat(
            [plumbing.neg(plumbing.index(x, (..., slice(half, None)))), plumbing.index(x, (..., slice(None, half)))]
        )
        return ops["add"](ops["mul"](x, self.cos), ops["mul"](rotated, self.sin))

    def attention(self, h, prefix: str):
        """Causal grouped-query attention of ``h`` ``[batch, t, d]``, as ``infra_lib.model.attention.attention``."""
        batch, t, _ = h.data.shape
        config, plumbing, ops = self.config, self.plumbing, self.ops
        head_dim = config.head_dim

        def heads(name: str, n: int):  # [batch, t, n * head_dim] -> [batch, n, t, head_dim]
            return plumbing.transpose(plumbing.reshape(self.linear(h, prefix + name), batch, t, n, head_dim), 1, 2)

        q, k, v = (
            heads("q_proj", config.n_heads),
            heads("k_proj", config.n_kv_heads),
            heads("v_proj", config.n_kv_heads),
        )
        q, k = self.rope(q), self.rope(k)
        k, v = plumbing.repeat_kv(k, config.group_size), plumbing.repeat_kv(v, config.group_size)
        scores = ops["mul"](ops["matmul"](q, plumbing.transpose(k, -1, -2)), self.scale)  # [batch, n_heads, t, t]
        weights = ops["softmax"](scores, causal=True)
        out = plumbing.reshape(plumbing.transpose(ops["matmul"](weights, v), 1, 2), batch, t, config.n_heads * head_dim)
        return self.linear(out, prefix + "o_proj")

    def mlp(self, h, prefix: str):
        """SwiGLU: ``down(silu(gate(h)) * up(h))``."""
        gate, up = self.linear(h, prefix + "gate_proj"), self.linear(h, prefix + "up_proj")
        return self.linear(self.ops["mul"](self.plumbing.silu(gate), up), prefix + "down_proj")
