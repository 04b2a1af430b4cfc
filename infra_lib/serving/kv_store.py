"""The paged KV store: every layer's keys and values, cut into blocks.

Per layer, keys and values are ``[num_blocks, block_size, n_kv_heads, head_dim]``. Flattened to
``[num_blocks * block_size, n_kv_heads, head_dim]`` there is one row per **slot**
``block_id * block_size + offset``, so writing a step's tokens is one indexed store at their
slots (the "slot mapping") and reading a sequence is one gather through its block table.
The store keeps no books: which block belongs to whom is the ``BlockPool``'s business.
"""

from __future__ import annotations

import torch

from infra_lib.serving.paged_attention import gather_kv


class PagedKVStore:
    """Every layer's K and V blocks: ``k[layer]``, ``v[layer]`` ``[num_blocks, block_size, n_kv_heads, head_dim]``."""

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.n_layers, self.num_blocks, self.block_size = n_layers, num_blocks, block_size
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]

    @classmethod
    def for_model(
        cls,
        config,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "PagedKVStore":
        """A store shaped for ``config`` (a ``LlamaConfig``)."""
        return cls(config.n_layers, num_blocks, block_size, config.n_kv_heads, config.head_dim, dtype, device)

    def write(self, layer: int, slots: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store ``k_new``/``v_new`` ``[1, n_kv_heads, t, head_dim]`` at ``slots`` ``[t]``."""
        for cache, new in ((self.k[layer], k_new), (self.v[layer], v_new)):
            rows = cache.view(-1, cache.shape[2], cache.shape[3])  # [slots, kv_heads, head_dim]
            rows[slots] = new[0].transpose(0, 1).to(cache.dtype)  # [t, kv_heads, head_dim]

    def gather(self, layer: int, block_ids: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's keys and values, ``[1, n_kv_heads, seq_len, head_dim]`` each."""
        return (gather_kv(self.k[layer], [block_ids], [seq_len]), gather_kv(self.v[layer], [block_ids], [seq_len]))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write's copy: block ``src``'s slots into block ``dst``, every layer."""
        for cache in self.k + self.v:
            cache[dst] = cache[src]

    def bytes_allocated(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def bytes_per_block(self) -> int:
        return self.bytes_allocated() // self.num_blocks

    def check_invariants(self) -> None:
        """One K and one V tensor per layer, all of the same ``[num_blocks, block_size, ...]`` shape."""
        if len(self.k) != self.n_layers or len(self.v) != self.n_layers:
            raise AssertionError(f"{len(self.k)} K and {len(self.v)} V tensors for {self.n_layers} layers")
        shapes = {tuple(t.shape) for t in self.k + self.v}
        if len(shapes) != 1 or next(iter(shapes))[:2] != (self.num_blocks, self.block_size):
            raise AssertionError(
                f"K/V tensors shaped {sorted(shapes)}, expected [{self.num_blocks}, "
                f"{self.block_size}, n_kv_heads, head_dim]"
            )
