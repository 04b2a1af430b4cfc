"""Reverse-mode automatic differentiation over torch tensors: the chain rule as a graph.

Every op makes one ``Value`` node that remembers its parents and a ``backward_fn``: given the
gradient of the final output with respect to the node, it returns each parent's share. ``backward``
visits the nodes from the output back to the inputs (reverse topological order), so a node has
received every share before it passes its own gradient on; a Value used twice gets the sum.

    x, w = Value(torch.randn(3, 4)), Value(torch.randn(4, 2))
    loss = silu(x @ w).sum()
    loss.backward()  # x.grad [3, 4], w.grad [4, 2]

The ops cover a Llama block and its loss; ``llama_loss`` runs the course's ``Llama`` with them, so its
gradients can be checked against ``torch.autograd`` (and ``numeric_gradient`` checks each op).

Two ops take their backward formula from a replaceable place, so that someone else's formula can
run inside the whole model: ``softmax_backward`` and ``rms_norm_backward`` below are the defaults,
and ``using_backward(softmax=..., rms_norm=...)`` swaps either for the length of a ``with`` block
(an op made inside the block keeps the formula it was made with).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Callable, Sequence

import torch

from infra_lib.model import Llama, LlamaConfig
from infra_lib.model.attention import causal_mask

BackwardFn = Callable[[torch.Tensor], Sequence["torch.Tensor | None"]]


class Value:
    """A tensor in the graph, with its gradient and the recipe that passes the gradient on.

    Attributes:
        data: the tensor, float32 or float64, any shape (detached: torch's autograd plays no part).
        grad: d(output)/d(data), same shape as ``data``; None until ``backward`` reaches this node.
            It accumulates over several ``backward`` calls, like torch's ``.grad``.
        parents: the Values this one was computed from; empty for an input.
        backward_fn: the gradient w.r.t. ``data`` -> one contribution per parent (None: no input's).
        op: the op's name, for reading the graph.
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
        self.parents = parents
        self.backward_fn = backward_fn
        self.op = op

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def __repr__(self) -> str:
        return f"Value(shape={tuple(self.shape)}, dtype={self.data.dtype}, op={self.op!r})"

    def backward(self, grad: torch.Tensor | None = None) -> None:
        """Add d(self)/d(node) to ``.grad`` of every node that ``self`` was computed from.

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
        elif grad.shape != self.shape:
            raise ValueError(f"backward(grad): grad has shape {tuple(grad.shape)}, the output {tuple(self.shape)}")
        pending = {id(self): grad}  # node -> the sum of the contributions it has received so far
        for node in reversed(topological_order(self)):
            node_grad = pending.pop(id(node))
            node.grad = node_grad.clone() if node.grad is None else node.grad + node_grad
            if node.backward_fn is None:
                continue
            for parent, share in zip(node.parents, node.backward_fn(node_grad)):
                if share is not None:
                    pending[id(parent)] = pending[id(parent)] + share if id(parent) in pending else share

    def sum(self) -> Value:
        """The sum of all elements, a 0-d Value."""
        return Value(self.data.sum(), (self,), lambda grad: (grad.expand(self.shape).clone(),), "sum")

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
        """Basic indexing (ints, slices, ``...``, None), e.g. ``x[..., :half]``; the gradient lands
        in the selected positions, zeros elsewhere."""
        parts = index if isinstance(index, tuple) else (index,)
        if not all(p is Ellipsis or p is None or isinstance(p, (int, slice)) for p in parts):
            raise TypeError(
                f"index a Value with ints, slices, ... and None, got {index!r}; "
                "gather rows by id with embedding(ids, table)"
            )

        def backward(grad):
            full = torch.zeros_like(self.data)
            full[index] = grad
            return (full,)

        return Value(self.data[index], (self,), backward, "slice")


def topological_order(root: Value) -> list[Value]:
    """Every node ``root`` depends on, each after all of its parents (iterative depth-first search,
    so a graph deeper than Python's recursion limit is fine)."""
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
    """``a - b`` with torch broadcasting."""
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


def neg(x) -> Value:
    """``-x``."""
    x = _as_value(x)
    return Value(-x.data, (x,), lambda grad: (-grad,), "neg")


def silu(x) -> Value:
    """x * sigmoid(x); its derivative is s * (1 + x * (1 - s)) with s = sigmoid(x)."""
    x = _as_value(x)
    s = torch.sigmoid(x.data)
    return Value(x.data * s, (x,), lambda grad: (grad * s * (1 + x.data * (1 - s)),), "silu")


# --- matmul and moving elements around ------------------------------------------------------------


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


def reshape(x, *shape: int) -> Value:
    """``x`` with the same elements in ``shape``; the gradient is reshaped back."""
    x = _as_value(x)
    return Value(x.data.reshape(*shape), (x,), lambda grad: (grad.reshape(x.shape),), "reshape")


def transpose(x, dim0: int, dim1: int) -> Value:
    """``x`` with dims ``dim0`` and ``dim1`` swapped; the gradient is swapped back."""
    x = _as_value(x)
    return Value(x.data.transpose(dim0, dim1), (x,), lambda grad: (grad.transpose(dim0, dim1),), "transpose")


def cat(values: Sequence, dim: int = -1) -> Value:
    """Concatenate along ``dim``; the gradient is cut back into the pieces."""
    values = tuple(_as_value(v) for v in values)
    sizes = [v.shape[dim] for v in values]
    return Value(torch.cat([v.data for v in values], dim), values, lambda grad: grad.split(sizes, dim), "cat")


def repeat_kv(x, group: int) -> Value:
    """``[batch, n_kv_heads, t, head_dim] -> [batch, n_kv_heads * group, t, head_dim]``: query head ``h``
    reads key/value head ``h // group``; the backward sums the ``group`` copies' gradients."""
    x = _as_value(x)
    if x.data.dim() != 4:
        raise ValueError(f"repeat_kv needs [batch, n_kv_heads, t, head_dim], got shape {tuple(x.shape)}")
    batch, n_kv_heads, t, head_dim = x.shape
    return Value(
        x.data.repeat_interleave(group, dim=1),
        (x,),
        lambda grad: (grad.reshape(batch, n_kv_heads, group, t, head_dim).sum(2),),
        "repeat_kv",
    )


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


# --- the Llama-specific ops -------------------------------------------------------------------------


def softmax_backward(probs: torch.Tensor, grad_probs: torch.Tensor) -> torch.Tensor:
    """The gradient of a softmax's input scores, from its output ``probs`` and the gradient of ``probs``.

    d p_i / d x_j = p_i (delta_ij - p_j), so the gradient is p * (g - sum_j g_j p_j), over the last dim.
    A masked entry (p exactly 0) gets exactly 0.

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


# op -> its backward formula; the defaults are the two functions above.
BACKWARD: dict[str, Callable] = {"softmax": softmax_backward, "rms_norm": rms_norm_backward}


@contextlib.contextmanager
def using_backward(softmax: Callable | None = None, rms_norm: Callable | None = None) -> Iterator[None]:
    """Inside the block, ops made by ``softmax`` and ``rms_norm`` use these backward formulas (None:
    keep the current one); the previous formulas come back when the block ends, also on an error.

    Args:
        softmax: ``(probs, grad_probs) -> grad_scores``, as ``softmax_backward``.
        rms_norm: ``(x, weight, grad_out, eps) -> (grad_x, grad_weight)``, as ``rms_norm_backward``.
    """
    saved = dict(BACKWARD)
    try:
        if softmax is not None:
            BACKWARD["softmax"] = softmax
        if rms_norm is not None:
            BACKWARD["rms_norm"] = rms_norm
        yield
    finally:
        BACKWARD.clear()
        BACKWARD.update(saved)


def rms_norm(x, weight, eps: float) -> Value:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; ``weight`` is ``[x.shape[-1]]``."""
    x, weight = _pair(x, weight)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight must be [{x.shape[-1]}] for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    normed = x.data * torch.rsqrt(x.data.pow(2).mean(-1, keepdim=True) + eps)
    formula = BACKWARD["rms_norm"]

    def backward(grad):
        grad_x, grad_weight = formula(x.data, weight.data, grad, eps)
        return grad_x, grad_weight

    return Value(weight.data * normed, (x, weight), backward, "rms_norm")


def softmax(x, causal: bool = False) -> Value:
    """Softmax over the last dim. ``causal`` masks the last two dims ``[t, s]`` as the course's
    ``causal_mask`` does (query ``i`` sits at position ``s - t + i``; square: keys ``j > i``): masked
    probabilities are exactly 0 and their gradient is exactly 0."""
    x = _as_value(x)
    scores = x.data
    if causal:
        t, s = scores.shape[-2:]
        if t > s:
            raise ValueError(f"causal softmax needs at least as many keys as queries, got scores {tuple(x.shape)}")
        scores = scores.masked_fill(~causal_mask(t, s, scores.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    formula = BACKWARD["softmax"]
    return Value(probs, (x,), lambda grad: (formula(probs, grad),), "softmax")


def cross_entropy(logits, targets: torch.Tensor) -> Value:
    """Mean over positions of ``-log softmax(logits)[target]``, a 0-d Value.

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


def llama_loss(model: Llama, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[Value, dict[str, Value]]:
    """The forward of ``model`` (no cache) and its next-token cross-entropy, built from Values.

    The loss equals ``F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())``.

    Args:
        model: an ``infra_lib.model.Llama``; read, never changed.
        tokens: ``[batch, t]`` int64 ids.
        targets: ``[batch, t]`` int64 ids of the next tokens.

    Returns:
        (loss, params): the 0-d loss, and a Value per name of ``model.named_parameters(remove_duplicate=False)``
        whose ``.grad`` ``loss.backward()`` fills. A tied table is one Value under both names.
    """
    config = model.config
    if tokens.dim() != 2 or targets.shape != tokens.shape:
        raise ValueError(
            f"tokens and targets must both be [batch, t], got {tuple(tokens.shape)} and {tuple(targets.shape)}"
        )
    if tokens.shape[1] > config.max_position:
        raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds the model's context of {config.max_position}")
    params, by_tensor = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params[name] = by_tensor.setdefault(id(p), Value(p.detach()))
    t = tokens.shape[1]
    cos, sin = model.rope_cos[:t], model.rope_sin[:t]  # [t, head_dim], constants
    x = embedding(tokens, params["embed_tokens.weight"])  # [batch, t, d]
    for i in range(config.n_layers):
        layer = f"layers.{i}."
        h = rms_norm(x, params[layer + "input_layernorm.weight"], config.rms_norm_eps)
        x = x + _attention(h, params, layer + "self_attn.", config, cos, sin)
        h = rms_norm(x, params[layer + "post_attention_layernorm.weight"], config.rms_norm_eps)
        x = x + _mlp(h, params, layer + "mlp.")
    x = rms_norm(x, params["norm.weight"], config.rms_norm_eps)
    logits = _linear(x, params, "lm_head")  # [batch, t, vocab]
    return cross_entropy(logits, targets), params


def _linear(x: Value, params: dict[str, Value], name: str) -> Value:
    """``x @ W^T (+ b)``, as ``nn.Linear`` stores ``W``: ``[out, in]``."""
    y = x @ params[name + ".weight"].transpose(0, 1)
    bias = params.get(name + ".bias")
    return y if bias is None else y + bias


def _rope(x: Value, cos: torch.Tensor, sin: torch.Tensor) -> Value:
    """The course's rotate-half RoPE: dims ``i`` and ``i + head_dim/2`` turn together."""
    half = x.shape[-1] // 2
    rotated = cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _attention(
    h: Value, params: dict[str, Value], prefix: str, config: LlamaConfig, cos: torch.Tensor, sin: torch.Tensor
) -> Value:
    """Causal grouped-query attention of ``h`` ``[batch, t, d]``, as ``infra_lib.model.attention.attention``."""
    batch, t, _ = h.shape
    head_dim = config.head_dim

    def heads(name: str, n: int) -> Value:  # [batch, t, n * head_dim] -> [batch, n, t, head_dim]
        return _linear(h, params, prefix + name).reshape(batch, t, n, head_dim).transpose(1, 2)

    q, k, v = heads("q_proj", config.n_heads), heads("k_proj", config.n_kv_heads), heads("v_proj", config.n_kv_heads)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    k, v = repeat_kv(k, config.group_size), repeat_kv(v, config.group_size)  # [batch, n_heads, t, head_dim]
    weights = softmax(q @ k.transpose(-1, -2) / math.sqrt(head_dim), causal=True)  # [batch, n_heads, t, t]
    out = (weights @ v).transpose(1, 2).reshape(batch, t, config.n_heads * head_dim)
    return _linear(out, params, prefix + "o_proj")


def _mlp(h: Value, params: dict[str, Value], prefix: str) -> Value:
    """SwiGLU: ``down(silu(gate(h)) * up(h))``."""
    gate, up = _linear(h, params, prefix + "gate_proj"), _linear(h, params, prefix + "up_proj")
    return _linear(silu(gate) * up, params, prefix + "down_proj")
