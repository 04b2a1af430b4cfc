"""A Llama-family decoder in plain torch, readable top to bottom.

    tokens -> embedding -> n_layers x [RMSNorm -> attention (+ residual) -> RMSNorm -> SwiGLU (+ residual)]
           -> RMSNorm -> output projection -> logits

Parameter names follow Hugging Face's ``LlamaForCausalLM`` without its ``model.`` prefix, so a
``transformers`` state dict loads with one rename (see ``infra_lib.model.loaders``).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from infra_lib.model.attention import attention, cached_attention
from infra_lib.model.cache import KVCache, LayerCache
from infra_lib.model.config import LlamaConfig

# (q, k_new, v_new, layer_cache) -> [batch, n_heads, t, head_dim]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LayerCache], torch.Tensor]


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight: LayerNorm without the mean and the bias."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(head_dim: int, max_position: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, ``[max_position, head_dim]``, for the rotate-half form of RoPE.

    Dimension ``i`` and ``i + head_dim/2`` form one rotating pair, turning at frequency
    ``theta ** (-2i / head_dim)`` radians per position.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [pos, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, heads, t, head_dim]`` by its positions' angles (``cos``/``sin`` ``[t, head_dim]``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.n_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.n_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.n_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.hidden_size, bias=config.output_bias)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of ``x`` ``[batch, t, d]``, each ``[batch, heads, t, head_dim]``
        (before RoPE)."""
        batch, t, _ = x.shape
        # [batch, t, heads * head_dim] -> [batch, heads, t, head_dim]
        q = self.q_proj(x).view(batch, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def forward(self, x, cos, sin, cache: LayerCache | None, attention_fn: AttentionFn):
        batch, t, _ = x.shape
        q, k, v = self.qkv(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            out = attention(q, k, v)  # no cache: the whole sequence is in this call
        else:
            out = attention_fn(q, k, v, cache)
        return self.o_proj(out.transpose(1, 2).reshape(batch, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache, attention_fn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, attention_fn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """The decoder. ``forward(tokens, cache)`` returns logits.

    Args:
        config: the model's shape.
        attention_fn: the cached attention step (default ``cached_attention``); a lab can plug in
            its own with ``model.using_attention(fn)``.
    """

    def __init__(self, config: LlamaConfig, attention_fn: AttentionFn | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(config.head_dim, config.max_position, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.attention_fn: AttentionFn = attention_fn or cached_attention

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` ``[batch, heads, t, head_dim]`` rotated by RoPE at ``positions`` (a LongTensor ``[t]``, any
        positions): what a runner that flattens several sequences into one step calls."""
        return apply_rope(x, self.rope_cos[positions], self.rope_sin[positions])

    @contextlib.contextmanager
    def using_attention(self, attention_fn: AttentionFn):
        """Run the model with another cached-attention step inside the ``with`` block."""
        previous, self.attention_fn = self.attention_fn, attention_fn
        try:
            yield self
        finally:
            self.attention_fn = previous

    def using_backend(self, name: str):
        """Run the model with its attention in PyTorch (``"torch"``, the default) or in the course's
        Triton FlashAttention kernel (``"triton"``) inside the ``with`` block."""
        if name == "torch":
            return self.using_attention(cached_attention)
        if name == "triton":
            from infra_lib.kernels.flash_attention import flash_cached_attention

            return self.using_attention(flash_cached_attention)
        raise ValueError(f"the attention backend must be 'torch' or 'triton', got {name!r}")

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits ``[batch, t, vocab]`` for ``tokens`` ``[batch, t]``.

        With a ``cache`` the tokens continue the cached sequence (their positions start at
        ``cache.seq_len``) and their keys/values are appended to it; without one they are the
        whole sequence. ``last_only`` computes logits for the last position only (all that
        generation needs), ``[batch, 1, vocab]``.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, t], got shape {list(tokens.shape)}")
        start = cache.seq_len if cache is not None else 0
        end = start + tokens.shape[1]
        if end > self.config.max_position:
            raise ValueError(f"sequence of {end} tokens exceeds the model's context of {self.config.max_position}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}); got {int(tokens.min())}..{int(tokens.max())}"
            )
        cos, sin = self.rope_cos[start:end], self.rope_sin[start:end]
        x = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.layer(i) if cache is not None else None, self.attention_fn)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))

    def weight_bytes(self) -> int:
        """Bytes of all parameters, a tied table counted once."""
        return sum(p.nbytes for p in self.parameters())
