"""KV-cache capacity: how many tokens, and so how many concurrent sequences, fit in memory.

The chain this module makes computable: memory capacity, minus weights and a reserve,
bounds the KV cache; the KV cache bounds the number of sequences served at once; that
bounds the batch size and the throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes per element of the formats weights and KV caches are stored in.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class ModelConfig:
    """The shape facts KV-cache math needs.

    Attributes:
        n_layers: transformer blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads (= n_heads: multi-head; 1: multi-query; between: grouped-query).
        head_dim: size of one head.
        n_params: parameter count, for the weights' size.
    """

    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_params: float

    def __post_init__(self):
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{self.name}: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )


# Published configurations (each model's config.json on its model card).
MODELS = {
    # meta-llama/Llama-2-7b-hf: 32 layers, 32 heads, no GQA, hidden 4096.
    "Llama-2-7B": ModelConfig("Llama-2-7B", n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128, n_params=6.74e9),
    # meta-llama/Meta-Llama-3-8B: 32 layers, 32 query heads sharing 8 KV heads.
    "Llama-3-8B": ModelConfig("Llama-3-8B", n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, n_params=8.03e9),
    # Qwen/Qwen2.5-7B: 28 layers, 28 query heads, 4 KV heads, hidden 3584.
    "Qwen2.5-7B": ModelConfig("Qwen2.5-7B", n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128, n_params=7.62e9),
    # HuggingFaceTB/SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads, hidden 576.
    "SmolLM2-135M": ModelConfig("SmolLM2-135M", n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, n_params=134.5e6),
}


def dtype_bytes(dtype: str | float) -> float:
    """Bytes per element for a dtype name ("bf16", "fp8"...) or a number of bytes."""
    if isinstance(dtype, str):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
        return DTYPE_BYTES[dtype]
    if isinstance(dtype, bool) or not isinstance(dtype, (int, float)) or not dtype > 0:
        raise ValueError(f"bytes per element must be > 0, got {dtype!r}")
    return dtype


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, bytes_per_element: float) -> float:
    """Bytes of KV cache one token occupies: a key and a value vector per KV head per layer.

    2 * n_layers * n_kv_heads * head_dim * bytes_per_element. Grouped-query attention
    shrinks it by n_heads / n_kv_heads; multi-query attention (one KV head) the most.
    """
    for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return 2 * n_layers * n_kv_heads * head_dim * dtype_bytes(bytes_per_element)


def model_kv_bytes_per_token(model: ModelConfig, dtype: str | float = "bf16") -> float:
    return kv_bytes_per_token(model.n_layers, model.n_kv_heads, model.head_dim, dtype_bytes(dtype))


def weight_bytes(model: ModelConfig, dtype: str | float = "bf16") -> float:
    return model.n_params * dtype_bytes(dtype)


def kv_capacity_tokens(
    memory_bytes: float, weight_bytes: float, kv_bytes_per_token: float, reserve_bytes: float = 0
) -> int:
    """Tokens of KV cache that fit once the weights and a reserve are in memory (never < 0)."""
    for name, value in (
        ("memory_bytes", memory_bytes),
        ("weight_bytes", weight_bytes),
        ("reserve_bytes", reserve_bytes),
    ):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    if not kv_bytes_per_token > 0:
        raise ValueError(f"kv_bytes_per_token must be > 0, got {kv_bytes_per_token!r}")
    free = memory_bytes - weight_bytes - reserve_bytes
    return max(0, int(free // kv_bytes_per_token))


def max_concurrency(
    memory_bytes: float, weight_bytes: float, kv_bytes_per_token: float, context_len: int, reserve_bytes: float = 0
) -> int:
    """Sequences of ``context_len`` tokens whose KV caches fit at once (0 when the weights
    and reserve leave no room): the physical ceiling of a serving engine's max batch."""
    if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < 1:
        raise ValueError(f"context_len must be a positive int, got {context_len!r}")
    return kv_capacity_tokens(memory_bytes, weight_bytes, kv_bytes_per_token, reserve_bytes) // context_len
