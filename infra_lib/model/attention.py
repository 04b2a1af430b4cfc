"""Attention with a KV cache: the step every decoder layer takes for every new token.

Shapes (after the q/k/v projections and rotary embeddings):

* ``q``     ``[batch, n_heads,    t, head_dim]``: this step's queries (t = prompt length at
  prefill, 1 at decode);
* ``k_new`` ``[batch, n_kv_heads, t, head_dim]``: this step's keys, and ``v_new`` its values;
* the cache already holds the ``s - t`` earlier tokens' keys and values.

Query ``i`` of this step sits at absolute position ``s - t + i`` and may look at keys
``0 .. s - t + i`` (the causal mask). Query head ``h`` reads key/value head
``h // (n_heads // n_kv_heads)`` (grouped-query attention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from infra_lib.model.cache import LayerCache


def causal_mask(t: int, s: int, device=None) -> torch.Tensor:
    """``[t, s]`` booleans: True where query ``i`` (position ``s - t + i``) may see key ``j``."""
    rows = torch.arange(t, device=device).unsqueeze(1) + (s - t)
    cols = torch.arange(s, device=device).unsqueeze(0)
    return cols <= rows


def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[batch, n_kv_heads, s, head_dim]`` -> ``[batch, n_kv_heads * group, s, head_dim]``: each
    key/value head repeated for the ``group`` query heads that read it (head h reads h // group)."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention of ``q`` (the last ``t`` positions) over all ``s`` keys.

    Written out step by step; ``cached_attention`` uses the fused kernel for the same maths.
    """
    batch, n_heads, t, head_dim = q.shape
    group = n_heads // k.shape[1]
    k, v = repeat_kv(k, group), repeat_kv(v, group)  # [batch, n_heads, s, head_dim]
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)  # [batch, n_heads, t, s]
    scores = scores.masked_fill(~causal_mask(t, k.shape[2], q.device), float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return weights @ v


def cached_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: LayerCache) -> torch.Tensor:
    """Append this step's keys/values to ``cache`` and attend over everything cached.

    Returns ``[batch, n_heads, t, head_dim]``.
    """
    keys, values = cache.append(k_new, v_new)
    t, s = q.shape[2], keys.shape[2]
    group = q.shape[1] // keys.shape[1]
    keys, values = repeat_kv(keys, group), repeat_kv(values, group)
    if t == 1:  # one new token sees every cached key: no mask needed
        return F.scaled_dot_product_attention(q, keys, values)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_mask(t, s, q.device))
