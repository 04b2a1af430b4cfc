"""Training from scratch: the AdamW update written out, and a tiny Llama trained with a contract autograd
(``infra_lib.training.autograd``'s own, or anyone's with the same names) and that update, next to the same
model trained by ``torch.autograd`` and ``torch.optim.AdamW``.

``train_tiny`` takes the ops (``llama_loss``'s mapping) and the optimizer as arguments, so any piece can
be swapped for another's; ``train_tiny_torch`` is the same run through torch's own machinery (same
model, same batches), so the two loss curves can be compared step by step. Both minimise the next-token
cross-entropy plus PaLM's z-loss (``training_loss``), so that every graded op of the contract is in the graph.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from infra_lib.model import Llama
from infra_lib.model.attention import causal_mask, repeat_kv
from infra_lib.model.model import apply_rope
from infra_lib.training.autograd import training_loss
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


@dataclass(frozen=True)
class TinySettings:
    """The tiny run: a byte-level Llama (vocabulary 256, width 32, two layers, heads of 16), its batches,
    the z-loss coefficient of its objective and AdamW's hyper-parameters. float64 by default, so that two
    correct implementations agree to rounding."""

    vocab_size: int = 256
    hidden_size: int = 32
    n_layers: int = 2
    batch: int = 4
    seq_len: int = 32
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    z_loss: float = 1e-4
    dtype: torch.dtype = torch.float64


def tiny_setup(seed: int = 0, **settings) -> tuple[Llama, Iterator[tuple[torch.Tensor, torch.Tensor]], TinySettings]:
    """The tiny run's model (``settings.dtype``, no ``requires_grad``), its endless batches of windows of
    the course's sample text, and the settings; the same seed gives the same model and batches.

    Args:
        seed: the model's initialisation and the batches.
        settings: fields of ``TinySettings`` to change.
    """
    run = TinySettings(**settings)
    head_dim = 16
    config = tiny_config(
        vocab_size=run.vocab_size,
        hidden_size=run.hidden_size,
        n_layers=run.n_layers,
        n_heads=run.hidden_size // head_dim,
        n_kv_heads=max(1, run.hidden_size // head_dim // 2),
        head_dim=head_dim,
        intermediate_size=3 * run.hidden_size,
        max_position=run.seq_len,
    )
    model = tiny_model(config, seed=seed).to(run.dtype).requires_grad_(False)
    return model, text_batches(text_tokens(), run.batch, run.seq_len, seed=seed), run


def train_tiny(
    steps: int,
    *,
    ops: Mapping | None = None,
    adamw: Update = adamw_update,
    seed: int = 0,
    grad_norms: list | None = None,
    first_grads: dict | None = None,
    **settings,
) -> list[float]:
    """Train the tiny Llama for ``steps`` steps with ``training_loss(..., ops)`` and ``adamw``; the losses.

    Each step: the loss of a batch (the cross-entropy plus ``settings.z_loss`` times the mean of log^2 Z,
    PaLM's z-loss), ``backward()`` on it, then ``adamw(param, grad, exp_avg, exp_avg_sq,
    step, lr, beta1, beta2, eps, weight_decay)`` on every parameter (a tied table once), step counted from 1.
    No ``torch.autograd`` and no ``torch.optim``: the ops' own backward makes every gradient.

    Args:
        steps: how many updates; the loss before each is returned.
        ops: ``llama_loss``'s mapping of the contract's names (None: the library's own ops).
        adamw: the update, with ``adamw_update``'s signature.
        seed: the model's initialisation and the batches.
        grad_norms: if given, each step appends ``{parameter name: norm of its gradient}`` to it.
        first_grads: if given, filled with ``{parameter name: the first step's gradient}`` (copies).
        settings: fields of ``TinySettings`` to change.

    Returns:
        ``steps`` losses, plain floats.
    """
    model, batches, run = tiny_setup(seed, **settings)
    named = dict(model.named_parameters())  # a tied table once
    state = {name: (torch.zeros_like(p), torch.zeros_like(p)) for name, p in named.items()}
    losses = []
    for step in range(1, steps + 1):
        tokens, targets = next(batches)
        loss, values = training_loss(model, tokens, targets, ops, run.z_loss)
        loss.backward()
        losses.append(float(loss.data))
        grads = {name: values[name].grad for name in named}
        for name, grad in grads.items():
            if not isinstance(grad, torch.Tensor) or grad.shape != named[name].shape:
                got = f"shape {tuple(grad.shape)}" if isinstance(grad, torch.Tensor) else repr(grad)
                raise RuntimeError(
                    f"after loss.backward() the Value of parameter {name} {tuple(named[name].shape)} holds .grad "
                    f"{got}: every parameter needs a gradient of its own shape"
                )
        _note_gradients(step, grads, grad_norms, first_grads)
        for name, param in named.items():
            exp_avg, exp_avg_sq = state[name]
            adamw(param.data, grads[name], exp_avg, exp_avg_sq, step, run.lr, *run.betas, run.eps, run.weight_decay)
    return losses


def train_tiny_torch(
    steps: int, *, seed: int = 0, grad_norms: list | None = None, first_grads: dict | None = None, **settings
) -> list[float]:
    """``train_tiny``'s run through torch: the model's own forward, the same objective
    (``torch_training_loss``: cross-entropy plus the z-loss), ``torch.autograd`` and
    ``torch.optim.AdamW(foreach=False)``, on the same model and batches; the losses.

    Args:
        steps, seed, grad_norms, first_grads, settings: as ``train_tiny``'s.
    """
    model, batches, run = tiny_setup(seed, **settings)
    model.requires_grad_(True)
    named = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=run.lr, betas=run.betas, eps=run.eps, weight_decay=run.weight_decay, foreach=False
    )
    losses = []
    for step in range(1, steps + 1):
        tokens, targets = next(batches)
        loss = torch_training_loss(model, tokens, targets, run.z_loss)
        optimizer.zero_grad()
        loss.backward()
        losses.append(float(loss.detach()))
        _note_gradients(step, {name: p.grad for name, p in named.items()}, grad_norms, first_grads)
        optimizer.step()
    return losses


def torch_training_loss(model: Llama, tokens: torch.Tensor, targets: torch.Tensor, z_loss: float) -> torch.Tensor:
    """``training_loss`` in plain torch: the next-token cross-entropy plus ``z_loss`` times the mean over
    positions of log^2 Z (``torch.logsumexp``, which subtracts each row's maximum: safe for logits of any size);
    ``z_loss=0``: the cross-entropy alone."""
    logits = torch_llama_logits(model, tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return loss + z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean() if z_loss else loss


def torch_llama_logits(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """The logits ``[batch, t, vocab]`` of ``model`` (no cache) in plain torch, every step in the model's dtype.

    The course's ``Llama`` computes its norms and softmax in float32 (for bf16 weights); a float64 run
    compared with a float64 autograd must not round to float32 anywhere, so this is its forward with
    those two steps kept in the model's dtype.
    """
    config = model.config
    t = tokens.shape[1]
    cos, sin = model.rope_cos[:t], model.rope_sin[:t]

    def norm(x, module):
        return module.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps)

    x = model.embed_tokens(tokens)
    for layer in model.layers:
        attn = layer.self_attn
        q, k, v = attn.qkv(norm(x, layer.input_layernorm))  # [batch, heads, t, head_dim]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = repeat_kv(k, config.group_size), repeat_kv(v, config.group_size)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(config.head_dim)).masked_fill(~causal_mask(t, t), float("-inf"))
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).flatten(2)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(norm(x, layer.post_attention_layernorm))
    return model.lm_head(norm(x, model.norm))


def _note_gradients(step: int, grads: dict, grad_norms: list | None, first_grads: dict | None) -> None:
    if grad_norms is not None:
        grad_norms.append({name: float(grad.norm()) for name, grad in grads.items()})
    if first_grads is not None and step == 1:
        first_grads.update({name: grad.detach().clone() for name, grad in grads.items()})
