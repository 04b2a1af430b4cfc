"""Lab 05 tasks 1 to 5 answered from the lab's text alone, the way a learner writes them: not the course's code.

The engine counts each node's children and runs a node once all of them have handed over their share (Kahn's
algorithm, no depth-first search); the ops undo broadcasting with ``sum_to_size`` and write each backward out
in its own way. ``namespace()`` gives every name the lab's checks take.
"""

from __future__ import annotations

import math

import torch


class Value:
    """A node: a tensor, the nodes it came from, and how its gradient splits among them."""

    def __init__(self, data, parents=(), backward_fn=None):
        self.data = data
        self.parents = tuple(parents)
        self.backward_fn = backward_fn
        self.grad = None

    def backward(self, grad=None):
        if grad is None:
            if self.data.numel() != 1:
                raise ValueError(f"backward() needs a gradient for an output of shape {tuple(self.data.shape)}")
            grad = torch.ones_like(self.data)
        # every node reachable from self, and how many of its children are in that graph
        children = {id(self): 0}
        nodes = {id(self): self}
        todo = [self]
        while todo:
            node = todo.pop()
            for parent in node.parents:
                if id(parent) not in nodes:
                    nodes[id(parent)] = parent
                    children[id(parent)] = 0
                    todo.append(parent)
                children[id(parent)] += 1
        incoming = {id(self): grad.clone()}
        ready = [self]
        while ready:
            node = ready.pop()
            mine = incoming.pop(id(node), None)
            if mine is not None:
                node.grad = mine if node.grad is None else node.grad + mine
            shares = node.backward_fn(mine) if mine is not None and node.backward_fn is not None else None
            for i, parent in enumerate(node.parents):
                share = None if shares is None else shares[i]
                if share is not None:
                    key = id(parent)
                    incoming[key] = share.clone() if key not in incoming else incoming[key] + share
                children[id(parent)] -= 1
                if children[id(parent)] == 0:
                    ready.append(parent)


def _unbroadcast(grad, shape):
    return grad.sum_to_size(shape) if grad.shape != shape else grad


def add(a, b):
    return Value(a.data + b.data, (a, b), lambda g: (_unbroadcast(g, a.data.shape), _unbroadcast(g, b.data.shape)))


def mul(a, b):
    def backward(g):
        return _unbroadcast(g * b.data, a.data.shape), _unbroadcast(g * a.data, b.data.shape)

    return Value(a.data * b.data, (a, b), backward)


def exp(x):
    y = torch.exp(x.data)
    return Value(y, (x,), lambda g: (y * g,))


def log(x):
    return Value(torch.log(x.data), (x,), lambda g: (g * x.data.reciprocal(),))


def matmul(a, b):
    def backward(g):
        grad_a = g @ b.data.mT
        grad_b = a.data.mT @ g
        return _unbroadcast(grad_a, a.data.shape), _unbroadcast(grad_b, b.data.shape)

    return Value(a.data @ b.data, (a, b), backward)


def _back_to(g, x, dim, keepdim):
    if x.data.dim() == 0:
        return g.reshape(())
    if dim is None:
        return torch.ones_like(x.data) * g
    if not keepdim:
        g = g.unsqueeze(dim)
    return g.expand_as(x.data).clone()


def reduce_sum(x, dim=None, keepdim=False):
    out = x.data.sum() if dim is None and not keepdim else torch.sum(x.data, dim=dim, keepdim=keepdim)
    return Value(out, (x,), lambda g: (_back_to(g, x, dim, keepdim),))


def reduce_mean(x, dim=None, keepdim=False):
    count = x.data.numel() if dim is None or x.data.dim() == 0 else x.data.shape[dim]
    out = torch.mean(x.data, dim=dim, keepdim=keepdim) if dim is not None or keepdim else x.data.mean()
    return Value(out, (x,), lambda g: (_back_to(g, x, dim, keepdim) / count,))


def softmax(x, causal=False):
    scores = x.data
    if causal:
        t, s = scores.shape[-2], scores.shape[-1]
        query_pos = torch.arange(t).unsqueeze(-1) + (s - t)
        allowed = torch.arange(s).unsqueeze(0) <= query_pos
        scores = torch.where(allowed, scores, torch.full_like(scores, -math.inf))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # a row with no key: nothing to shift
    e = torch.exp(scores - top)
    total = e.sum(dim=-1, keepdim=True)
    p = torch.where(total > 0, e / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(e))

    def backward(g):
        dot = (p * g).sum(dim=-1, keepdim=True)
        return ((g - dot) * p,)

    return Value(p, (x,), backward)


def rms_norm(x, weight, eps):
    d = x.data.shape[-1]
    rms = torch.sqrt((x.data**2).mean(dim=-1, keepdim=True) + eps)
    xhat = x.data / rms

    def backward(g):
        gw = g * weight.data
        grad_x = (gw - xhat * (gw * xhat).sum(dim=-1, keepdim=True) / d) / rms
        grad_weight = (g * xhat).reshape(-1, d).sum(dim=0)
        return grad_x, grad_weight

    return Value(xhat * weight.data, (x, weight), backward)


def embedding(ids, table):
    def backward(g):
        grad = torch.zeros_like(table.data)
        grad.index_put_((ids.reshape(-1),), g.reshape(-1, table.data.shape[1]), accumulate=True)
        return (grad,)

    return Value(table.data[ids], (table,), backward)


def cross_entropy(logits, targets):
    vocab = logits.data.shape[-1]
    flat = logits.data.reshape(-1, vocab)
    picked = targets.reshape(-1)
    n = picked.numel()
    log_probs = flat - torch.logsumexp(flat, dim=-1, keepdim=True)
    loss = -log_probs[torch.arange(n), picked].sum() / n

    def backward(g):
        grad = torch.exp(log_probs)
        grad[torch.arange(n), picked] -= 1.0
        return ((grad * g / n).reshape(logits.data.shape),)

    return Value(loss, (logits,), backward)


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.mul_(beta1).add_((1.0 - beta1) * grad)
    exp_avg_sq.mul_(beta2).add_((1.0 - beta2) * grad * grad)
    m_hat = exp_avg / (1.0 - beta1**step)
    v_hat = exp_avg_sq / (1.0 - beta2**step)
    param.sub_(lr * m_hat / (torch.sqrt(v_hat) + eps))


NAMES = tuple(
    "Value add mul exp log matmul reduce_sum reduce_mean softmax rms_norm embedding cross_entropy adamw_update".split()
)


def namespace() -> dict:
    """Every name the lab's tasks 1 to 5 define, as a learner's notebook holds them."""
    return {name: globals()[name] for name in NAMES}
