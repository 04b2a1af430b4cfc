"""The KV cache: where attention keeps the keys and values of every token it has seen.

The model talks to a cache through two small interfaces, so later chapters can swap the
storage (paged blocks, a shared prefix) without touching the model:

* ``KVCache.layer(i)`` gives the cache of decoder layer ``i``;
* ``LayerCache.append(k_new, v_new)`` stores this step's keys and values and returns the keys
  and values of the whole sequence so far, shaped ``[batch, n_kv_heads, seq_len, head_dim]``.

``DenseKVCache`` is the simplest storage: one preallocated tensor per layer, filled left to
right. Every sequence in the batch has the same length.
"""

from __future__ import annotations

import torch


class LayerCache:
    """The cache of one decoder layer (the interface attention sees)."""

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k_new``/``v_new`` ``[batch, n_kv_heads, t, head_dim]`` after the tokens already
        cached; return all keys and values, ``[batch, n_kv_heads, cached + t, head_dim]``."""
        raise NotImplementedError

    @property
    def length(self) -> int:
        """Tokens stored so far."""
        raise NotImplementedError


class KVCache:
    """A whole model's cache (the interface the model sees)."""

    def layer(self, index: int) -> LayerCache:
        raise NotImplementedError

    @property
    def seq_len(self) -> int:
        """Tokens already cached: the position of the next token."""
        raise NotImplementedError


class DenseLayerCache(LayerCache):
    """Preallocated ``[batch, n_kv_heads, capacity, head_dim]`` buffers for keys and values."""

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (batch, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def append(self, k_new, v_new):
        expected = (self.k.shape[0], self.k.shape[1], None, self.k.shape[3])
        for name, tensor in (("k_new", k_new), ("v_new", v_new)):
            if tensor.dim() != 4 or any(e is not None and e != s for e, s in zip(expected, tensor.shape)):
                raise ValueError(
                    f"{name} must be [batch={expected[0]}, n_kv_heads={expected[1]}, t, "
                    f"head_dim={expected[3]}], got {list(tensor.shape)}"
                )
        if k_new.shape != v_new.shape:
            raise ValueError(f"k_new {list(k_new.shape)} and v_new {list(v_new.shape)} differ in shape")
        end = self._length + k_new.shape[2]
        if end > self.capacity:
            raise RuntimeError(
                f"the KV cache holds {self.capacity} tokens; appending {k_new.shape[2]} "
                f"to {self._length} would overflow it (make a larger cache)"
            )
        self.k[:, :, self._length : end] = k_new
        self.v[:, :, self._length : end] = v_new
        self._length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def truncate(self, length: int) -> None:
        """Forget every token after the first ``length``, as if they had never been appended."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} tokens to {length}")
        self.k[:, :, length : self._length] = 0
        self.v[:, :, length : self._length] = 0
        self._length = length


class DenseKVCache(KVCache):
    """One ``DenseLayerCache`` per decoder layer."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.layers = [DenseLayerCache(batch, n_kv_heads, capacity, head_dim, dtype, device) for _ in range(n_layers)]

    @classmethod
    def for_model(
        cls,
        config,
        batch: int = 1,
        capacity: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "DenseKVCache":
        """A cache sized for ``config`` (a ``LlamaConfig``); ``capacity`` defaults to its context."""
        return cls(
            config.n_layers, batch, config.n_kv_heads, capacity or config.max_position, config.head_dim, dtype, device
        )

    def layer(self, index: int) -> DenseLayerCache:
        return self.layers[index]

    @property
    def seq_len(self) -> int:
        return self.layers[0].length

    def truncate(self, length: int) -> None:
        """Roll every layer back to its first ``length`` tokens (speculative decoding's rejections)."""
        for layer in self.layers:
            layer.truncate(length)

    def check_invariants(self) -> None:
        """Every layer holds the same number of tokens, within its capacity."""
        lengths = {c.length for c in self.layers}
        if len(lengths) != 1:
            raise AssertionError(f"layers hold different numbers of tokens: {sorted(lengths)}")
        for i, c in enumerate(self.layers):
            if not 0 <= c.length <= c.capacity:
                raise AssertionError(f"layer {i} holds {c.length} tokens, capacity {c.capacity}")
            if c.k.shape != c.v.shape:
                raise AssertionError(f"layer {i}: K {list(c.k.shape)} and V {list(c.v.shape)} differ")

    def bytes_allocated(self) -> int:
        return sum(c.k.nbytes + c.v.nbytes for c in self.layers)

    def bytes_used(self) -> int:
        """Bytes holding cached tokens (what a token-exact allocator would reserve)."""
        return sum((c.k[:, :, : c.length].nbytes + c.v[:, :, : c.length].nbytes) for c in self.layers)
