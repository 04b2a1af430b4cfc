"""Weight-only quantisation: store weights in 8 or 4 bits, compute in fp32.

Group-wise symmetric quantisation cuts each row of a weight ``[out, in]`` into groups of
``group_size`` consecutive values and gives every group its own scale:

    scale = max |w| over the group / qmax          qmax = 127 (int8), 7 (int4)
    q     = clamp(round(w / scale), -qmax, qmax)   stored as int8 (int4: two per byte)
    w'    = q * scale                              |w - w'| <= scale / 2 for every weight

Small groups follow the weights' local range (an outlier spoils only its own group) at the cost
of more scales: 4 bytes per group, 1/16 of a byte per weight at group 64. The GGUF file the course
ships is already quantised: Q4_1 blocks of 32 weights with a scale d and a minimum m (asymmetric:
w' = d * q + m, q in 0..15). ``Q4_1Linear`` keeps those blocks exactly as stored.

A ``QuantLinear`` dequantises its weight on the fly at every call, then runs an ordinary fp32
matmul. That saves memory (and, with a kernel that dequantises in registers, memory bandwidth,
the bound of decoding); in eager PyTorch the extra dequantisation pass costs time instead, which
chapter 09 measures.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

QMAX = {8: 127, 4: 7}


def _check_group_size(group_size: int, row_length: int) -> None:
    """A group size is a positive int (not a bool, although Python counts True as 1) dividing the row."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(
            f"group_size must be a positive int, got {group_size!r} ({type(group_size).__name__}); "
            f"pass a whole number of values per scale, such as 64"
        )
    if row_length % group_size:
        raise ValueError(
            f"group_size {group_size} does not divide the row length {row_length}; pick a divisor of {row_length}"
        )


def _check_weight(w: torch.Tensor, group_size: int) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(
            f"expected a floating-point weight [out, in], got "
            f"{type(w).__name__ if not isinstance(w, torch.Tensor) else f'{w.dtype} {list(w.shape)}'}"
        )
    _check_group_size(group_size, w.shape[1])
    finite = torch.isfinite(w)
    if not bool(finite.all()):
        row, col = (int(i) for i in (~finite).nonzero()[0])
        raise ValueError(
            f"{int((~finite).sum())} of the weight's values are nan or inf, the first w[{row}, {col}] = "
            f"{float(w[row, col])}: its group's scale would not be a number; find where the weight "
            f"overflowed or was corrupted before quantising it"
        )


def quantize_symmetric(w: torch.Tensor, bits: int = 8, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise symmetric quantisation of ``w`` ``[out, in]``.

    Returns:
        q: int8 ``[out, in]`` with values in [-qmax, qmax] (qmax = 127 for 8 bits, 7 for 4).
        scales: float32 ``[out, in // group_size]``; a group of zeros gets scale 0.

    Raises:
        ValueError: ``w`` is not a 2-D floating-point tensor or holds nan or inf, or ``group_size`` is
            not a positive int (a bool is not one) dividing the row length.
    """
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    _check_weight(w, group_size)
    qmax = QMAX[bits]
    groups = w.float().reshape(w.shape[0], -1, group_size)  # [out, n_groups, group_size]
    scales = groups.abs().amax(dim=-1) / qmax  # [out, n_groups]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.clamp(torch.round(groups / safe[..., None]), -qmax, qmax).to(torch.int8)
    return q.reshape(w.shape), scales


def dequantize_symmetric(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 ``[out, in]`` from int8 values ``q`` ``[out, in]`` and ``scales`` ``[out, in // group_size]``.

    Raises:
        ValueError: ``q`` is not a 2-D int8 tensor, ``group_size`` is not a positive int dividing the row
            length, or ``scales`` does not hold one scale per group.
    """
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.dim() != 2:
        got = f"{q.dtype} {list(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(
            f"q must be a torch.int8 tensor [out, in], got {got}; pass the q that quantisation "
            f"returned (an int4 weight unpacked with unpack_int4)"
        )
    _check_group_size(group_size, q.shape[1])
    if not isinstance(scales, torch.Tensor) or scales.shape != (q.shape[0], q.shape[1] // group_size):
        got = list(scales.shape) if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise ValueError(
            f"scales must hold one scale per group, [{q.shape[0]}, {q.shape[1] // group_size}] for q "
            f"{list(q.shape)} and group_size {group_size}, got {got}"
        )
    groups = q.float().reshape(q.shape[0], -1, group_size)
    return (groups * scales[..., None]).reshape(q.shape)


def quantize_int8_groupwise(w: torch.Tensor, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 quantisation (lab 09's task): ``(q int8 [out, in], scales float32 [out, in // group_size])``."""
    return quantize_symmetric(w, 8, group_size)


def dequantize_int8_groupwise(q: torch.Tensor, scales: torch.Tensor, group_size: int = 64) -> torch.Tensor:
    """The float32 weight back from ``quantize_int8_groupwise``'s output."""
    return dequantize_symmetric(q, scales, group_size)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two int4 values (-8..7) per byte: ``[out, in]`` int8 -> ``[out, in // 2]`` uint8, even index low."""
    if q.shape[-1] % 2:
        raise ValueError(f"an int4 row needs an even length, got {q.shape[-1]}")
    u = (q.to(torch.int16) + 8).to(torch.uint8)  # 0..15
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``: int8 values in -8..7, ``[out, 2 * in_packed]``."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def error_bound(scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """The largest error rounding may cause per weight, ``[out, in]``: half a step of its group's scale."""
    return (scales / 2).repeat_interleave(group_size, dim=-1)


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored group-wise in 8 or 4 bits and dequantised at each call.

    Args:
        weight: the float weight ``[out, in]`` to quantise.
        bias: optional float bias ``[out]`` (kept in float).
        bits: 8 or 4.
        group_size: values per scale along each row.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, bits: int = 8, group_size: int = 64):
        super().__init__()
        q, scales = quantize_symmetric(weight.detach(), bits, group_size)
        self.bits, self.group_size = bits, group_size
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("qweight", pack_int4(q) if bits == 4 else q)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        q = unpack_int4(self.qweight) if self.bits == 4 else self.qweight
        return dequantize_symmetric(q, self.scales, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int{self.bits}, group={self.group_size}"


class Q4_1Linear(nn.Module):
    """A linear layer holding GGUF Q4_1 blocks as stored: per 32 weights a scale d, a minimum m and
    32 4-bit values (16 bytes: the low nibbles are weights 0-15, the high nibbles 16-31)."""

    BLOCK = 32

    def __init__(self, d: torch.Tensor, m: torch.Tensor, qs: torch.Tensor):
        super().__init__()
        if qs.dim() != 3 or qs.shape[-1] != self.BLOCK // 2 or d.shape != qs.shape[:2] or m.shape != d.shape:
            raise ValueError(
                f"expected d, m [out, blocks] and qs [out, blocks, 16], got {list(d.shape)}, "
                f"{list(m.shape)}, {list(qs.shape)}"
            )
        self.register_buffer("d", d.to(torch.float16))
        self.register_buffer("m", m.to(torch.float16))
        self.register_buffer("qs", qs.to(torch.uint8))
        self.out_features, self.in_features = qs.shape[0], qs.shape[1] * self.BLOCK
        self.bias = None

    @classmethod
    def from_gguf_rows(cls, raw: torch.Tensor) -> Q4_1Linear:
        """From a GGUF tensor's raw bytes ``[out, blocks * 20]`` (uint8)."""
        blocks = raw.reshape(raw.shape[0], -1, 20)
        d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
        m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
        return cls(d, m, blocks[..., 4:].contiguous())

    def permute_rows(self, order) -> None:
        """Reorder output rows (the loader's rotate-half un-permutation of Q and K)."""
        self.d, self.m, self.qs = order(self.d), order(self.m), order(self.qs)

    def dequantized(self) -> torch.Tensor:
        low, high = (self.qs & 0x0F).float(), (self.qs >> 4).float()
        q = torch.cat((low, high), dim=-1)  # [out, blocks, 32]
        w = q * self.d.float()[..., None] + self.m.float()[..., None]
        return w.reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized().to(x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, GGUF Q4_1"


LINEAR_NAMES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _set(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, name = dotted.rpartition(".")
    setattr(model.get_submodule(parent), name, module)


def quantize_model(model, bits: int = 8, group_size: int = 64):
    """A copy of ``model`` (a ``Llama``) with every decoder-layer linear weight in ``bits`` bits.

    The embedding table (tied to the output head in SmolLM2) and the norms stay in float.
    """
    # Copy everything but the float weights about to be replaced (most of the model's bytes): the
    # copy shares them with ``model`` only until each is swapped for its QuantLinear just below.
    replaced = (layer.get_submodule(name).weight for layer in model.layers for name in LINEAR_NAMES)
    out = copy.deepcopy(model, memo={id(w): w for w in replaced})
    for i, layer in enumerate(out.layers):
        for name in LINEAR_NAMES:
            linear = layer.get_submodule(name)
            _set(out, f"layers.{i}.{name}", QuantLinear(linear.weight, linear.bias, bits, group_size))
    return out.eval()


def load_gguf_q4_1(path=None):
    """The course's GGUF model with its Q4_1 linear weights kept as stored (``Q4_1Linear``), the rest
    (embeddings, norms) as the fp32 loader makes them. Returns a ``LoadedModel``."""
    from infra_lib.model.loaders import (
        default_gguf_path,
        gguf_tensor_name,
        load_gguf,
        stored_blocks,
        unpermute_rope_rows,
    )

    path = path or default_gguf_path()
    loaded = load_gguf(path)
    model, config = loaded.model, loaded.model.config
    for gguf_name, rows in stored_blocks(path, "Q4_1")[1].items():
        name = gguf_tensor_name(gguf_name).removesuffix(".weight")
        module = Q4_1Linear.from_gguf_rows(rows)
        if name.endswith("self_attn.q_proj"):
            module.permute_rows(lambda w: unpermute_rope_rows(w, config.n_heads))
        elif name.endswith("self_attn.k_proj"):
            module.permute_rows(lambda w: unpermute_rope_rows(w, config.n_kv_heads))
        _set(model, name, module)
    return loaded


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers that hold weights (tied tensors once; RoPE tables excluded)."""
    seen, total = set(), 0
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("rope_") or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.nbytes
    return total


def heldout_text() -> str:
    """English prose that ships with Python (the language reference's topics), for perplexity."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in ("assignment", "if", "while", "for", "try", "with", "function", "class"))


@torch.inference_mode()
def perplexity(model, token_ids: list[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood) of ``token_ids`` under ``model``, in windows of ``window`` tokens."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        logits = model(torch.tensor([chunk[:-1]], device=device))[0].float()
        nll += float(F.cross_entropy(logits, torch.tensor(chunk[1:], device=device), reduction="sum"))
        count += len(chunk) - 1
    return math.exp(nll / count)
