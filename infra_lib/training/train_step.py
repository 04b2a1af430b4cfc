"""One real training step of a tiny Llama, and where its bytes go.

    tokens -> forward (activations saved for backward) -> cross-entropy -> backward (gradients)
           -> AdamW step (optimizer state) -> new weights

Two precisions and one memory trade:

* ``"fp32"``: weights, gradients and AdamW's momentum and variance all in fp32:
  4 + 4 + 8 = 16 bytes per parameter.
* ``"bf16"``: mixed precision with an fp32 master copy. The model computes in bf16 (weights and
  gradients 2 bytes each); the optimizer keeps fp32 masters plus momentum and variance
  (4 + 8 = 12 bytes): 2 + 2 + 12 = 16 bytes per parameter, the figure ``zero.py`` shards.
* ``checkpoint=True``: each decoder block keeps only its input for backward and recomputes the
  rest, trading one more forward pass for most of the activation memory.

On this model at batch 8 x 128 the activations outweigh the weights, gradients and optimizer
state together several times over, and bf16 does not halve them: attention's softmax and
RMSNorm compute in fp32 and save fp32 tensors (``memory_report`` prints the table).

The data is byte-level (vocabulary 256, no tokenizer): the English prose of ``heldout_text``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as checkpoint_block

from infra_lib.model.config import LlamaConfig
from infra_lib.model.model import Llama

PRECISIONS = ("fp32", "bf16")
WORKING_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = {
    "fp32": ("fp32", False),
    "fp32+checkpoint": ("fp32", True),
    "bf16": ("bf16", False),
    "bf16+checkpoint": ("bf16", True),
}


def tiny_config(
    vocab_size: int = 256,
    hidden_size: int = 128,
    n_layers: int = 4,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 384,
    max_position: int = 256,
) -> LlamaConfig:
    """A Llama small enough to train on one CPU thread: 0.82 M parameters with the defaults."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position=max_position,
    )


def tiny_model(config: LlamaConfig | None = None, seed: int = 0, std: float = 0.02) -> Llama:
    """A freshly initialised fp32 ``Llama``: every matrix drawn from N(0, std²), norms at 1.

    A small ``std`` makes the first logits nearly equal, so training starts at a loss of about
    ln(vocab_size) (5.55 for bytes).
    """
    model = Llama(config or tiny_config())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                nn.init.normal_(param, std=std, generator=generator)
    return model


def text_tokens() -> torch.Tensor:
    """The course's English sample text as bytes, ``[n_tokens]`` int64 (about 35 500 tokens)."""
    from infra_lib.model.quant import heldout_text

    return torch.tensor(list(heldout_text().encode("utf-8")), dtype=torch.long)


def text_batches(
    tokens: torch.Tensor, batch: int, seq_len: int, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random windows of ``tokens``: ``(inputs, targets)``, each ``[batch, seq_len]``, where
    ``targets`` is ``inputs`` shifted one token to the left (the next token at every position)."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be one sequence [n_tokens], got shape {list(tokens.shape)}")
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be >= 1, got batch={batch}, seq_len={seq_len}")
    if tokens.numel() <= seq_len:
        raise ValueError(f"a window needs seq_len + 1 = {seq_len + 1} tokens; the text has {tokens.numel()}")
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, tokens.numel() - seq_len, (batch, 1), generator=generator)
        windows = tokens[starts + offsets]  # [batch, seq_len + 1]
        yield windows[:, :-1], windows[:, 1:]


class MasterWeightAdamW:
    """AdamW on fp32 master copies of a bf16 model's weights.

    The model computes in bf16, so its gradients arrive in bf16. ``step`` casts them up, lets
    AdamW update the fp32 masters, and rounds the masters back into the bf16 working weights.
    The masters are what make small updates count: the spacing of bf16 numbers near 1.0 is
    2⁻⁷ ≈ 0.008, so an update of 1e-4 applied to the bf16 weight itself would round away, step
    after step; the fp32 master accumulates it until the sum shows.

    No loss scaling is needed. fp16 keeps 5 exponent bits: values below about 6e-8 flush to zero,
    and many gradients of a deep network sit down there, so fp16 training multiplies the loss by
    a scale S (about 2¹⁶, lowered whenever a gradient overflows) before backward and divides the
    gradients by S, in fp32, before the update. bf16 keeps fp32's 8 exponent bits (down to about
    1e-38): it gives up precision, not range, and the gradients do not underflow.

    Args:
        params: the model's bf16 parameters (its working weights).
        masters: fp32 copies of the same weights, in the same order, taken before the cast.
        lr, betas, weight_decay: passed to ``torch.optim.AdamW``.
    """

    def __init__(self, params, masters, lr: float, betas: tuple[float, float], weight_decay: float):
        self.params = list(params)
        self.masters = [m.detach().float().clone() for m in masters]
        if [p.shape for p in self.params] != [m.shape for m in self.masters]:
            raise ValueError("the masters must match the working parameters one for one, in order")
        self.inner = torch.optim.AdamW(self.masters, lr=lr, betas=betas, weight_decay=weight_decay)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for param, master in zip(self.params, self.masters):
            master.grad = None if param.grad is None else param.grad.float()
        self.inner.step()
        for param, master in zip(self.params, self.masters):
            param.copy_(master)  # round to the nearest bf16
            master.grad = None  # the fp32 gradient copies live only during the step

    def state_bytes(self) -> int:
        """Bytes of the masters plus AdamW's state on them."""
        return sum(m.nbytes for m in self.masters) + optimizer_state_bytes(self.inner)


def make_optimizer(
    model: Llama,
    precision: str = "fp32",
    *,
    lr: float = 3e-3,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.01,
):
    """The optimizer for ``precision``; for ``"bf16"`` this also casts ``model`` to bf16 in place.

    ``"fp32"``: ``torch.optim.AdamW`` on the parameters themselves. ``"bf16"``: fp32 masters are
    copied from the (fp32) model, then the model, its RoPE tables included (the model's
    ``apply_rope`` would otherwise promote q and k to fp32), becomes bf16.
    """
    check_precision(precision)
    params = list(model.parameters())
    if precision == "fp32":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if any(p.dtype != torch.float32 for p in params):
        raise ValueError(
            "make_optimizer(model, 'bf16') copies its fp32 masters from the model, so it needs an "
            "fp32 model; build a fresh one (tiny_model()) instead of passing one already cast"
        )
    masters = [p.detach().clone() for p in params]
    model.to(torch.bfloat16)
    return MasterWeightAdamW(params, masters, lr=lr, betas=betas, weight_decay=weight_decay)


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def forward_logits(model: Llama, tokens: torch.Tensor, *, checkpoint: bool = False) -> torch.Tensor:
    """Logits ``[batch, t, vocab]`` of ``tokens`` ``[batch, t]``, no KV cache.

    With ``checkpoint`` the steps of ``Llama.forward`` run here with every decoder block under
    ``torch.utils.checkpoint``: a block saves only its input, and backward runs it again.
    """
    if not checkpoint:
        return model(tokens)
    t = tokens.shape[1]
    cos, sin = model.rope_cos[:t], model.rope_sin[:t]
    x = model.embed_tokens(tokens)  # [batch, t, d]
    for layer in model.layers:
        x = checkpoint_block(layer, x, cos, sin, None, model.attention_fn, use_reentrant=False)
    return model.lm_head(model.norm(x))


def check_batch(model: Llama, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    if inputs.dim() != 2 or inputs.shape != targets.shape:
        raise ValueError(
            f"inputs and targets must both be [batch, seq_len]; got {list(inputs.shape)} and "
            f"{list(targets.shape)} (text_batches gives matching pairs)"
        )
    if inputs.shape[1] > model.config.max_position:
        raise ValueError(f"seq_len {inputs.shape[1]} exceeds the model's max_position {model.config.max_position}")
    for name, tokens in (("inputs", inputs), ("targets", targets)):
        if tokens.dtype != torch.long or int(tokens.min()) < 0 or int(tokens.max()) >= model.config.vocab_size:
            raise ValueError(
                f"{name} must be int64 token ids in [0, {model.config.vocab_size}); got dtype "
                f"{tokens.dtype}, values {int(tokens.min())}..{int(tokens.max())}"
            )


def train_step(
    model: Llama,
    optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    precision: str = "fp32",
    checkpoint: bool = False,
) -> float:
    """Forward, cross-entropy, backward and one optimizer step; returns the loss.

    The gradients of this step stay on the parameters afterwards (they are cleared at the start
    of the next step), so they can be inspected and counted.

    Args:
        model: a ``Llama`` in the working dtype of ``precision`` (see ``make_optimizer``).
        optimizer: ``make_optimizer(model, precision)``.
        inputs: ``[batch, seq_len]`` token ids.
        targets: ``[batch, seq_len]`` the next token at every position.
        precision: ``"fp32"`` or ``"bf16"`` (bf16 model, fp32 masters in the optimizer).
        checkpoint: recompute each decoder block's activations in backward.

    Returns:
        The mean cross-entropy over all ``batch * seq_len`` positions, in nats, before the update.
    """
    check_precision(precision)
    dtype = WORKING_DTYPE[precision]
    if next(model.parameters()).dtype != dtype:
        raise ValueError(
            f"precision={precision!r} needs a {dtype} model, this one is "
            f"{next(model.parameters()).dtype}; make its optimizer with make_optimizer(model, "
            f"{precision!r})"
        )
    if (precision == "bf16") != isinstance(optimizer, MasterWeightAdamW):
        raise ValueError(
            f"precision={precision!r} does not match the optimizer {type(optimizer).__name__}; "
            f"use make_optimizer(model, {precision!r})"
        )
    check_batch(model, inputs, targets)
    optimizer.zero_grad()  # set to None: the previous step's gradients are freed before the forward
    logits = forward_logits(model, inputs, checkpoint=checkpoint)  # [batch, seq_len, vocab]
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # softmax in fp32
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor an optimizer keeps (for ``MasterWeightAdamW``, its masters too)."""
    if isinstance(optimizer, MasterWeightAdamW):
        return optimizer.state_bytes()
    return sum(
        value.nbytes
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


@contextlib.contextmanager
def saved_activation_bytes(model: nn.Module) -> Iterator[dict[int, int]]:
    """Count what autograd saves for backward inside the ``with`` block.

    Yields a dict, storage address -> bytes, filled as tensors are saved: a storage saved twice
    (or through two views) counts once, and the model's own parameters and buffers (saved by
    every linear layer) are not activations and are left out. Sum its values after the block.
    """
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved


def memory_breakdown(
    model: Llama,
    optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    precision: str = "fp32",
    checkpoint: bool = False,
) -> dict[str, float]:
    """Take one real training step and count its bytes.

    Returns:
        ``parameters``, ``gradients``, ``optimizer`` (AdamW's momentum and variance, the fp32
        masters under bf16, and one 4-byte step count per parameter tensor), ``activations``
        (saved for backward during the forward), ``peak`` (the sum of the four: an upper bound,
        since backward frees activations as gradients appear), ``num_parameters`` and
        ``bytes_per_parameter`` ((parameters + gradients + optimizer) / num_parameters, 16 for both
        precisions, as ``zero_memory_per_device(n, 1, 0, ...)`` counts them).
    """
    with saved_activation_bytes(model) as saved:
        train_step(model, optimizer, inputs, targets, precision=precision, checkpoint=checkpoint)
    params = list(model.parameters())  # a tied table once
    num_parameters = sum(p.numel() for p in params)
    parameters = sum(p.nbytes for p in params)
    gradients = sum(p.grad.nbytes for p in params if p.grad is not None)
    optimizer_bytes = optimizer_state_bytes(optimizer)
    activations = sum(saved.values())
    return {
        "parameters": parameters,
        "gradients": gradients,
        "optimizer": optimizer_bytes,
        "activations": activations,
        "peak": parameters + gradients + optimizer_bytes + activations,
        "num_parameters": num_parameters,
        "bytes_per_parameter": (parameters + gradients + optimizer_bytes) / num_parameters,
    }


def memory_report(
    config: LlamaConfig | None = None, batch: int = 8, seq_len: int = 128, seed: int = 0
) -> dict[str, dict[str, float]]:
    """``memory_breakdown`` of a fresh model for each of ``VARIANTS`` (fp32, bf16, each with and
    without checkpointing), on the same batch of text."""
    inputs, targets = next(text_batches(text_tokens(), batch, seq_len, seed))
    report = {}
    for name, (precision, checkpoint) in VARIANTS.items():
        model = tiny_model(config, seed)
        optimizer = make_optimizer(model, precision)
        report[name] = memory_breakdown(model, optimizer, inputs, targets, precision=precision, checkpoint=checkpoint)
    return report


def train(
    steps: int = 300,
    *,
    precision: str = "fp32",
    checkpoint: bool = False,
    batch: int = 8,
    seq_len: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
    config: LlamaConfig | None = None,
) -> list[float]:
    """Train a fresh ``tiny_model`` on the sample text for ``steps`` steps; the loss of every step.

    With the defaults the loss falls from ln(256) ≈ 5.5 through a plateau near 3 (byte frequencies
    learnt, context not yet) to under 2 by step 300.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    model = tiny_model(config, seed)
    optimizer = make_optimizer(model, precision, lr=lr)
    batches = text_batches(text_tokens(), batch, seq_len, seed)
    return [
        train_step(model, optimizer, *next(batches), precision=precision, checkpoint=checkpoint) for _ in range(steps)
    ]
