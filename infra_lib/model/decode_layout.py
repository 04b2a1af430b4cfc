"""The same model with its weights laid out for decoding: fused, and stored the way the product
that reads them streams fastest.

At batch 1 a decode step is a chain of matrix-vector products (GEMVs), and a GEMV's speed is how
fast it streams its weight from memory. ``benchmarks/decode_profile.py`` measured PyTorch's GEMV
for ``nn.Linear``'s ``[out, in]`` weight at about a third of this machine's STREAM bandwidth.
``decode_layout(model)`` builds, once at load time, a copy of the model whose projections are
stored for the product, with two fusions on top:

* q, k and v become one ``[d, (H + 2 * KV) * head_dim]`` product (one pass over ``x``, one op
  instead of three);
* the MLP's gate and up become one ``[d, 2 * intermediate]`` product.

With ``weights="fp32"`` the maths is unchanged (the same products, summed in another order:
logits agree with the original's within 1e-4 in the input-major layout and 3e-4 in the packed one
(logits run to about 30), and greedy tokens are the same on the course's prompts; a test checks
both). The fp32 weights are stored one of two ways:

* **packed** (the default, ``PackedLinear``): in oneDNN's blocked layout, the one PyTorch's CPU
  GEMM library reads fastest, packed once here so that no product repacks it. At batch 1 a GEMV
  reads each weight once, in any order, and packing does not pay: side by side in
  ``benchmarks/decode.py`` the two layouts were even on one of the course's machines and the packed
  one 0.77-0.81 times the input-major one on another. The packed one is well ahead at the batches of
  8 to 32 the serving engine runs, where a step is a GEMM (``benchmarks/offline_throughput.py``);
* **input-major** (``pack=False``, or where PyTorch has no oneDNN; ``InputMajorLinear``): ``W_t``
  stored ``[in, out]``, contiguous along the output, the product written ``x @ W_t``.

Two smaller weight formats read fewer bytes per step:

* ``"bf16"``: the projections' weights in bfloat16 (2 bytes a weight), fused as above but kept
  ``[out, in]``: PyTorch's bf16 product streams that layout faster here (about 10% a step, side by
  side). The activations are cast to bf16 for each product and the result back to fp32; everything
  else stays fp32;
* ``"int8"``: symmetric int8 weights with one fp32 scale per output row (1 byte a weight, chapter
  09's quantisation with a group as long as the row), multiplied by PyTorch's CPU kernel for int8
  weights (``aten._weight_int8pack_mm``, bf16 activations), which dequantises in registers.

Both change the numbers a little: ``benchmarks/decode.py`` reports each format's perplexity and how
many greedy tokens it shares with fp32 next to its speed. The copy keeps the model's interface:
``forward(tokens, cache, last_only)``,
``using_attention``, ``config``, so ``generate``, ``greedy_decode`` and the serving engine's runner
take it as they take the original.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from infra_lib.model.model import MLP, Attention, Llama, apply_rope


def _fused(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights ``[sum of out, in]`` and biases (None if none has one) of several ``nn.Linear``
    reading the same input, stacked: one product gives their outputs side by side."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    if all(lin.bias is None for lin in linears):
        return weight, None
    return weight, torch.cat(
        [
            lin.bias.detach() if lin.bias is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype)
            for lin in linears
        ]
    )


class InputMajorLinear(nn.Module):
    """``y = x @ weight_t (+ bias)`` with ``weight_t`` ``[in, out]``: ``nn.Linear``'s product, the
    weight stored transposed (contiguous along the output, the layout a GEMV streams fastest)."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight_t = nn.Parameter(weight_t.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linears(cls, *linears: nn.Linear, dtype: torch.dtype = torch.float32) -> "InputMajorLinear":
        """One product for several ``nn.Linear`` reading the same input, its weight stored in ``dtype``."""
        weight, bias = _fused(*linears)
        return cls(weight.t().to(dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t.dtype != x.dtype:  # bf16 weights: the product in bf16, the result in x's dtype
            y = torch.matmul(x.to(self.weight_t.dtype), self.weight_t).to(x.dtype)
        else:
            y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


@torch.library.custom_op("infra_lib::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W.T`` with ``W`` packed by oneDNN (``torch.ops.mkldnn._reorder_linear_weight``).

    An operator of its own so that ``torch.compile`` calls it as an opaque kernel: Inductor lowers
    oneDNN's own linear only for weights it packed itself (frozen constants), not for a packed
    weight handed in as an input, as ``StaticDecoder``'s layer graph hands in every weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


_ONEDNN: bool | None = None


def onednn_packing_available() -> bool:
    """Whether this PyTorch build can pack an fp32 weight for oneDNN and multiply with it here."""
    global _ONEDNN
    if _ONEDNN is None and not torch.backends.mkldnn.is_available():
        _ONEDNN = False
    if _ONEDNN is None:
        try:
            w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8))
            y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8), w, None, "none", [], "")
            _ONEDNN = bool(torch.all(y == 8))
        except (RuntimeError, AttributeError, NotImplementedError):
            _ONEDNN = False
    return _ONEDNN


class PackedLinear(nn.Module):
    """``y = x @ weight.T (+ bias)`` in fp32 with the weight packed once, at load time, into
    oneDNN's blocked layout (the layout PyTorch's own CPU GEMM library reads fastest): the same
    product as ``nn.Linear``, summed in another order.

    The packed weight is an opaque tensor (``layout == torch._mkldnn``): it lives on the CPU, is not
    saved in a ``state_dict`` and cannot be moved; ``weight_bytes`` says how many bytes of weights
    one product reads.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        weight = weight.detach().float().contiguous()
        if weight.device.type != "cpu":
            raise ValueError(f"oneDNN packs CPU weights; this one is on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.weight_bytes = weight.nbytes
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linears(cls, *linears: nn.Linear) -> "PackedLinear":
        return cls(*_fused(*linears))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features; this product takes {self.in_features}")
        if torch.compiler.is_compiling():
            y = packed_linear(x, self.packed, self.out_features)
        else:  # eager: oneDNN directly, without the custom operator's dispatch
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return y if self.bias is None else y + self.bias


class Bf16Linear(nn.Module):
    """``y = x @ weight.T (+ bias)`` with bfloat16 weights kept ``[out, in]``, as ``nn.Linear`` keeps
    them: PyTorch's bf16 product at batch 1 streams this layout faster than the input-major one on
    the course's CPU (``benchmarks/decode_profile.py``). The activations are cast to bf16 for the
    product and the result back to ``x``'s dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.bfloat16).contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linears(cls, *linears: nn.Linear) -> "Bf16Linear":
        return cls(*_fused(*linears))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int8RowLinear(nn.Module):
    """``y = x @ (q * scale).T (+ bias)``: int8 weights ``q`` ``[out, in]``, one scale per output row.

    ``scale = max |w| over the row / 127`` (kept in bf16, the kernel's type) and
    ``q = round(w / scale)``, so every weight is within about ``scale / 2`` of the original. The
    product runs in PyTorch's int8-weight CPU kernel with bf16 activations; the result comes back in
    ``x``'s dtype.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.bfloat16)  # the kernel's scale type
        q = torch.clamp(torch.round(w / scale.float()[:, None]), -127, 127)  # rounded against the stored scale
        self.q = nn.Parameter(q.to(torch.int8).contiguous(), requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linears(cls, *linears: nn.Linear) -> "Int8RowLinear":
        return cls(*_fused(*linears))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(rows, self.q, self.scale).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.q.shape[0])
        return y if self.bias is None else y + self.bias


WEIGHT_FORMATS = ("fp32", "bf16", "int8")


def _projection(weights: str, pack: bool, *linears: nn.Linear) -> nn.Module:
    if weights == "int8":
        return Int8RowLinear.from_linears(*linears)
    if weights == "bf16":
        return Bf16Linear.from_linears(*linears)
    if weights == "fp32" and pack and linears[0].weight.device.type == "cpu" and onednn_packing_available():
        return PackedLinear.from_linears(*linears)
    return InputMajorLinear.from_linears(*linears)


class FusedAttention(nn.Module):
    """``Attention`` with q, k and v in one product, stored as ``decode_layout``'s format says."""

    def __init__(self, attn: Attention, weights: str = "fp32", pack: bool = True):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.qkv_proj = _projection(weights, pack, attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = _projection(weights, pack, attn.o_proj)
        self.split = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``Attention.qkv``: each ``[batch, heads, t, head_dim]``, before RoPE; one product."""
        batch, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        return (
            q.view(batch, t, self.n_heads, self.head_dim).transpose(1, 2),
            k.view(batch, t, self.n_kv_heads, self.head_dim).transpose(1, 2),
            v.view(batch, t, self.n_kv_heads, self.head_dim).transpose(1, 2),
        )

    def forward(self, x, cos, sin, cache, attention_fn):
        from infra_lib.model.attention import attention

        batch, t, _ = x.shape
        q, k, v = self.qkv(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v) if cache is None else attention_fn(q, k, v, cache)
        return self.o_proj(out.transpose(1, 2).reshape(batch, t, self.n_heads * self.head_dim))


class FusedMLP(nn.Module):
    """SwiGLU with gate and up in one product, stored as ``decode_layout``'s format says."""

    def __init__(self, mlp: MLP, weights: str = "fp32", pack: bool = True):
        super().__init__()
        self.intermediate = mlp.gate_proj.out_features
        self.gate_up_proj = _projection(weights, pack, mlp.gate_proj, mlp.up_proj)
        self.down_proj = _projection(weights, pack, mlp.down_proj)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def decode_layout(model: Llama, weights: str = "fp32", pack: bool = True) -> Llama:
    """A copy of ``model`` whose projections are fused, stored for decoding, in the weight format
    ``weights`` (``"fp32"``, ``"bf16"`` or ``"int8"``; see the module's text). With fp32 weights,
    ``pack`` chooses oneDNN's packed layout (``PackedLinear``, for a model on the CPU where this
    PyTorch build has oneDNN) over the input-major one (``InputMajorLinear``, always available).

    The original is untouched; the copy holds its own projection weights (the output head gets its
    own copy of a tied embedding table; the embedding lookup and the norms stay shared).
    """
    if not isinstance(model, Llama):
        raise TypeError(f"decode_layout takes an infra_lib Llama, got {type(model).__name__}")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("decode_layout starts from a float32 model (load_default() gives one)")
    fast = copy.copy(model)  # the module's attributes, then fresh containers for what changes
    fast._modules = dict(model._modules)
    fast._parameters = dict(model._parameters)
    fast._buffers = dict(model._buffers)
    layers = nn.ModuleList()
    for layer in model.layers:
        new = copy.copy(layer)
        new._modules = dict(layer._modules)
        new.self_attn = FusedAttention(layer.self_attn, weights, pack)
        new.mlp = FusedMLP(layer.mlp, weights, pack)
        layers.append(new)
    fast.layers = layers
    fast.lm_head = _projection(weights, pack, model.lm_head)
    return fast.eval()


def bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once, except the embedding table,
    of which a step reads one row (unless the table is also the output head, read whole)."""
    table = getattr(getattr(model, "embed_tokens", None), "weight", None)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    total = 0
    total += sum(m.weight_bytes for m in model.modules() if isinstance(m, PackedLinear))
    for parameter in model.parameters():  # a tied tensor is listed once
        if parameter is table and head is not table:
            total += parameter.shape[1] * parameter.element_size()
        else:
            total += parameter.nbytes
    return total


@torch.inference_mode()
def greedy_answers(model: Llama, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``model``'s greedy answer to each prompt (``new_tokens`` each, stop tokens included)."""
    from infra_lib.model.generation import greedy_decode

    return [greedy_decode(model, prompt, new_tokens) for prompt in prompts]


@torch.inference_mode()
def top1_agreement(reference: Llama, other: Llama, prompts: list[list[int]], answers: list[list[int]]) -> float:
    """How often ``other`` picks ``reference``'s greedy token, teacher-forced: each prompt continued
    by ``reference``'s greedy answer (``greedy_answers``), both models read the same tokens and their
    argmax is compared at every answer position (so one early difference does not decide the rest)."""
    from infra_lib.model.generation import placement

    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    device = placement(reference)[0]
    hits = total = 0
    for prompt, answer in zip(prompts, answers):
        tokens = torch.tensor([prompt + answer[:-1]], device=device)
        start = len(prompt) - 1
        picks = reference(tokens)[0, start:].argmax(-1), other(tokens)[0, start:].argmax(-1)
        hits += int((picks[0] == picks[1]).sum())
        total += len(answer)
    return hits / total if total else float("nan")
