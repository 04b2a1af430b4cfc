"""Roofline and KV-cache math against hand-computed values."""

from __future__ import annotations

import pytest

from infra_lib.hardware.kv_cache import (
    MODELS,
    ModelConfig,
    dtype_bytes,
    kv_bytes_per_token,
    kv_capacity_tokens,
    max_concurrency,
    model_kv_bytes_per_token,
    weight_bytes,
)
from infra_lib.hardware.roofline import (
    COMPUTE_BOUND,
    MEMORY_BOUND,
    arithmetic_intensity,
    attainable_flops,
    bound,
    elementwise_intensity,
    ridge_point,
)

MIB = 1 << 20
H100_BF16, H100_HBM = 989e12, 3.35e12


def test_kv_bytes_for_published_models():
    assert model_kv_bytes_per_token(MODELS["Llama-2-7B"], "fp16") == 0.5 * MIB  # 2*32*32*128*2
    assert model_kv_bytes_per_token(MODELS["Llama-3-8B"], "fp16") == 0.125 * MIB  # GQA: 8 KV heads
    assert model_kv_bytes_per_token(MODELS["Qwen2.5-7B"], "bf16") == 2 * 28 * 4 * 128 * 2  # 57,344 B
    assert model_kv_bytes_per_token(MODELS["SmolLM2-135M"], "fp32") == 2 * 30 * 3 * 64 * 4
    assert model_kv_bytes_per_token(MODELS["Llama-3-8B"], "fp8") == 0.0625 * MIB


def test_multi_query_attention_caches_one_head():
    assert kv_bytes_per_token(24, 1, 128, 2) == 2 * 24 * 128 * 2


def test_seed_worked_example_80gb_card_7b_model():
    """80 GB card, 7B model in fp16 (14 GB), ~6 GB framework overhead, 0.5 MiB per token."""
    per_token = model_kv_bytes_per_token(MODELS["Llama-2-7B"], "fp16")
    tokens = kv_capacity_tokens(80e9, 14e9, per_token, reserve_bytes=6e9)
    assert tokens == 60e9 // per_token == 114_440  # the seed rounds this to "about 120k"
    assert max_concurrency(80e9, 14e9, per_token, 2048, 6e9) == 55  # "about 60"


def test_concurrency_is_zero_not_negative_when_weights_do_not_fit():
    assert max_concurrency(24e9, 26e9, 524288, 2048) == 0
    assert kv_capacity_tokens(80e9, 70e9, 524288, reserve_bytes=12e9) == 0
    assert max_concurrency(16e9, 14e9, 524288, 4096, 2e9) == 0


def test_concurrency_rounds_down_partial_tokens_and_sequences():
    per_token, context = 524288, 2048
    assert max_concurrency(3 * context * per_token - 1, 0, per_token, context) == 2
    assert max_concurrency(3 * context * per_token, 0, per_token, context) == 3


def test_weights_and_dtypes():
    assert weight_bytes(MODELS["Llama-2-7B"], "fp16") == pytest.approx(13.48e9)
    assert dtype_bytes("int4") == 0.5 and dtype_bytes(2) == 2
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("fp7")
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig("bad", 2, n_heads=10, n_kv_heads=3, head_dim=8, n_params=1)


def test_gemm_and_gemv_intensity():
    assert arithmetic_intensity(1024, 1024, 1024, 2) == pytest.approx(2 * 1024**3 / (3 * 1024**2 * 2))
    gemv = arithmetic_intensity(1, 4096, 4096, 2)
    assert gemv == pytest.approx(2 * 4096 * 4096 / ((4096 + 4096 * 4096 + 4096) * 2))
    assert 0.99 < gemv < 1.0  # a GEMV does ~1 FLOP per byte of weights in bf16
    assert arithmetic_intensity(1, 4096, 4096, 1) == pytest.approx(2 * gemv)  # fp8 halves the bytes
    assert elementwise_intensity() == pytest.approx(1 / 6)  # c = a + b in bf16: 1 FLOP, 6 bytes


def test_roofline_and_ridge_for_h100():
    ridge = ridge_point(H100_BF16, H100_HBM)
    assert ridge == pytest.approx(295.2, abs=0.1)
    assert attainable_flops(1.0, H100_BF16, H100_HBM) == H100_HBM
    assert attainable_flops(1000.0, H100_BF16, H100_HBM) == H100_BF16
    assert attainable_flops(ridge, H100_BF16, H100_HBM) == pytest.approx(H100_BF16)
    assert attainable_flops(0.0, H100_BF16, H100_HBM) == 0.0
    assert bound(arithmetic_intensity(1, 4096, 4096), H100_BF16, H100_HBM) == MEMORY_BOUND
    assert bound(arithmetic_intensity(4096, 4096, 4096), H100_BF16, H100_HBM) == COMPUTE_BOUND


@pytest.mark.parametrize(
    "call",
    [
        lambda: arithmetic_intensity(0, 1, 1),
        lambda: arithmetic_intensity(1, 1, 1, 0),
        lambda: attainable_flops(-1, 1, 1),
        lambda: attainable_flops(1, 0, 1),
        lambda: ridge_point(1, 0),
        lambda: kv_bytes_per_token(0, 1, 1, 2),
        lambda: max_concurrency(1, 0, 1, 0),
        lambda: kv_capacity_tokens(1, 0, 0),
    ],
)
def test_bad_inputs_raise_value_error(call):
    with pytest.raises(ValueError):
        call()
