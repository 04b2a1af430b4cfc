"""Training from scratch: the AdamW update written out, and a tiny Llama trained with the course's
own autograd (``infra_lib.training.autograd``) and that update, no ``torch.autograd`` or
``torch.optim`` anywhere.

``train_tiny`` takes the optimizer as an argument and the ops' backward formulas from
``autograd.using_backward``, so any of the three pieces can be swapped for another's and the loss
curves compared step by step.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from infra_lib.training.autograd import llama_loss
from infra_lib.training.train_step import text_batches, text_tokens, tiny_config, tiny_model


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step on one tensor, in place, as ``torch.optim.AdamW`` (``foreach=False``) takes it.

    Decoupled weight decay shrinks the weight itself (it never enters the moments); the moments are
    exponential averages of the gradient and its square, bias-corrected by 1 - beta^step because
    they start at zero.

    Args:
        param, exp_avg, exp_avg_sq: same shape and dtype; updated in place.
        grad: the gradient, ``param``'s shape; read only.
        step: 1 on the first update (the step being taken now).
        lr, beta1, beta2, eps, weight_decay: as ``torch.optim.AdamW``.
    """
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


Update = Callable[..., None]


def train_tiny(
    steps: int,
    *,
    adamw: Update = adamw_update,
    seed: int = 0,
    vocab_size: int = 256,
    hidden_size: int = 32,
    n_layers: int = 2,
    batch: int = 4,
    seq_len: int = 32,
    lr: float = 3e-3,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    dtype: torch.dtype = torch.float64,
    grad_norms: list | None = None,
) -> list[float]:
    """Train a tiny byte-level Llama for ``steps`` steps with ``llama_loss`` and ``adamw``; the losses.

    Each step: the loss of a batch of windows of the course's sample text, ``backward`` through the
    course's autograd (whose softmax and RMSNorm formulas ``autograd.using_backward`` chooses), then
    ``adamw(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay)`` on every
    parameter, step counted from 1. The same seed gives the same model, batches and losses.

    Args:
        steps: how many updates; the loss before each is returned.
        adamw: the update, with ``adamw_update``'s signature.
        seed: the model's initialisation and the batches.
        dtype: float64 by default, so that two correct sets of pieces agree to rounding.
        grad_norms: if given, each step appends ``{parameter name: norm of its gradient}`` to it (a check
            tells which piece a run went wrong in from the first step's).

    Returns:
        ``steps`` losses, plain floats.
    """
    head_dim = 16
    config = tiny_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        n_layers=n_layers,
        n_heads=hidden_size // head_dim,
        n_kv_heads=max(1, hidden_size // head_dim // 2),
        head_dim=head_dim,
        intermediate_size=3 * hidden_size,
        max_position=seq_len,
    )
    model = tiny_model(config, seed=seed).to(dtype).requires_grad_(False)
    named = dict(model.named_parameters())  # a tied table once
    state = {name: (torch.zeros_like(p), torch.zeros_like(p)) for name, p in named.items()}
    batches = text_batches(text_tokens(), batch, seq_len, seed=seed)
    losses = []
    for step in range(1, steps + 1):
        tokens, targets = next(batches)
        loss, values = llama_loss(model, tokens, targets)
        loss.backward()
        losses.append(float(loss.data))
        if grad_norms is not None:
            grad_norms.append({name: float(values[name].grad.norm()) for name in named})
        for name, param in named.items():
            exp_avg, exp_avg_sq = state[name]
            adamw(param.data, values[name].grad, exp_avg, exp_avg_sq, step, lr, betas[0], betas[1], eps, weight_decay)
    return losses
