"""Checks for lab 02 (the roofline and KV-cache capacity)."""

from __future__ import annotations

import random

from grading.checks.common import call_each, number_mismatch, reference
from grading.registry import Check, Mismatch, register, register_shortcuts

register_shortcuts("lab02", [
    "infra_lib.hardware.roofline:arithmetic_intensity",
    "infra_lib.hardware.roofline:attainable_flops",
    "infra_lib.hardware.roofline:ridge_point",
    "infra_lib.hardware.kv_cache:kv_bytes_per_token",
    "infra_lib.hardware.kv_cache:model_kv_bytes_per_token",
    "infra_lib.hardware.kv_cache:kv_capacity_tokens",
    "infra_lib.hardware.kv_cache:max_concurrency",
])

_ROOFLINE = "infra_lib.hardware.roofline"
_KV = "infra_lib.hardware.kv_cache"


# --- task 1: arithmetic_intensity -------------------------------------------------------------

def _square_ish(rng: random.Random) -> list[list]:
    return [[rng.choice([64, 128, 512, 1024, 4096]), rng.choice([64, 256, 1024, 4096]),
             rng.choice([64, 256, 1024, 4096]), 2] for _ in range(6)]


def _skinny_and_dtypes(rng: random.Random) -> list[list]:
    return [
        [1, rng.choice([2048, 4096, 8192]), rng.choice([2048, 4096]), 2],  # decode GEMV, bf16
        [rng.randint(2, 16), 4096, 4096, 2],  # a small decode batch
        [rng.choice([256, 2048]), 4096, 4096, 1],  # fp8
        [rng.choice([256, 2048]), 4096, 4096, 4],  # fp32
        [rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9), 0.5],  # int4
    ]


def _describe_gemm(case) -> str:
    return "m={}, n={}, k={}, bytes_per_element={}".format(*case)


def _compare_intensity(got, expected, cases):
    return number_mismatch(got, expected, cases, "arithmetic_intensity returned the wrong FLOPs per byte",
                           _describe_gemm, 1e-9)


register(Check(
    check_id="lab02.arithmetic_intensity",
    task="lab02 task 1: arithmetic_intensity",
    reference=reference(_ROOFLINE, "arithmetic_intensity"),
    make_inputs=_square_ish,
    drive=call_each,
    compare=_compare_intensity,
    hint="FLOPs are 2*m*n*k; bytes are (m*k + k*n + m*n) * bytes_per_element: A and B read once, C written once.",
))

register(Check(
    check_id="lab02.arithmetic_intensity_skinny_and_dtypes",
    task="lab02 task 1: arithmetic_intensity",
    reference=reference(_ROOFLINE, "arithmetic_intensity"),
    make_inputs=_skinny_and_dtypes,
    drive=call_each,
    compare=_compare_intensity,
    hint="the same formula holds for m=1 (a GEMV) and for any bytes_per_element, including 1 (fp8) and 0.5 (int4).",
))


# --- task 2: attainable_flops ------------------------------------------------------------------

def _roofs(rng: random.Random) -> list[list]:
    cases = []
    for _ in range(6):
        peak = rng.choice([989e12, 1979e12, 2250e12, 1307e12, 0.2e12])
        bandwidth = rng.choice([3.35e12, 4.8e12, 8e12, 5.3e12, 0.02e12])
        ridge = peak / bandwidth
        cases.append([ridge * rng.choice([0.01, 0.3, 0.9, 1.5, 20.0]), peak, bandwidth])
    return cases


def _roof_edges(rng: random.Random) -> list[list]:
    peak, bandwidth = rng.choice([(989e12, 3.35e12), (2250e12, 8e12), (0.19e12, 0.012e12)])
    return [[peak / bandwidth, peak, bandwidth], [0.0, peak, bandwidth], [1e9, peak, bandwidth],
            [peak / bandwidth * (1 - 1e-6), peak, bandwidth]]


def _describe_roof(case) -> str:
    return "intensity={:.6g}, peak_flops={:.4g}, bandwidth={:.4g}".format(*case)


def _compare_roof(got, expected, cases):
    return number_mismatch(got, expected, cases, "attainable_flops returned the wrong rate", _describe_roof, 1e-9)


register(Check(
    check_id="lab02.attainable_flops",
    task="lab02 task 2: attainable_flops",
    reference=reference(_ROOFLINE, "attainable_flops"),
    make_inputs=_roofs,
    drive=call_each,
    compare=_compare_roof,
    hint="the roofline is the lower of two roofs: the compute peak, and intensity * bandwidth.",
))

register(Check(
    check_id="lab02.attainable_flops_edges",
    task="lab02 task 2: attainable_flops",
    reference=reference(_ROOFLINE, "attainable_flops"),
    make_inputs=_roof_edges,
    drive=call_each,
    compare=_compare_roof,
    hint="at the ridge point both roofs give the peak; at intensity 0 nothing can be computed; far right, the peak.",
))


# --- task 3: kv_bytes_per_token ---------------------------------------------------------------

def _mha_configs(rng: random.Random) -> list[list]:
    cases = []
    for _ in range(5):
        heads = rng.choice([8, 16, 32, 40, 64])
        cases.append([rng.choice([12, 24, 32, 40, 80]), heads, rng.choice([64, 128]), 2])
    return cases


def _gqa_fp8_configs(rng: random.Random) -> list[list]:
    return [
        [32, 8, 128, 2],  # Llama-3-8B: 32 query heads share 8 KV heads
        [28, 4, 128, 2],  # Qwen2.5-7B
        [rng.choice([24, 32, 48]), 1, 128, 2],  # multi-query attention: one KV head
        [rng.choice([32, 80]), rng.choice([8, 16]), 128, 1],  # FP8 KV cache
        [30, 3, 64, 4],  # SmolLM2-135M in fp32
    ]


def _describe_kv(case) -> str:
    return "n_layers={}, n_kv_heads={}, head_dim={}, bytes_per_element={}".format(*case)


def _compare_kv(got, expected, cases):
    return number_mismatch(got, expected, cases, "kv_bytes_per_token returned the wrong size", _describe_kv, 1e-12)


register(Check(
    check_id="lab02.kv_bytes_per_token",
    task="lab02 task 3: kv_bytes_per_token",
    reference=reference(_KV, "kv_bytes_per_token"),
    make_inputs=_mha_configs,
    drive=call_each,
    compare=_compare_kv,
    hint="each layer stores a key AND a value vector of head_dim numbers for every KV head.",
))

register(Check(
    check_id="lab02.kv_bytes_per_token_gqa_fp8",
    task="lab02 task 3: kv_bytes_per_token",
    reference=reference(_KV, "kv_bytes_per_token"),
    make_inputs=_gqa_fp8_configs,
    drive=call_each,
    compare=_compare_kv,
    hint="only KV heads are cached: with grouped-query or multi-query attention use n_kv_heads, not the "
    "number of query heads; FP8 stores 1 byte per element.",
))


# --- task 4: max_concurrency ---------------------------------------------------------------------

_GB = 1e9


def _fitting(rng: random.Random) -> list[list]:
    cases = []
    for _ in range(5):
        memory = rng.choice([80, 141, 192, 288]) * _GB
        weights = rng.choice([7, 8, 14, 16]) * _GB
        per_token = rng.choice([131072, 262144, 524288, 65536])
        cases.append([memory, weights, per_token, rng.choice([512, 2048, 4096, 8192]), rng.choice([0, 2, 6]) * _GB])
    return cases


def _tight(rng: random.Random) -> list[list]:
    per_token, context = 524288, 2048
    return [
        [24 * _GB, 26 * _GB, per_token, context, 0],  # the weights alone do not fit
        [80 * _GB, 70 * _GB, per_token, context, 12 * _GB],  # weights fit, the reserve does not
        [16 * _GB, 14 * _GB, per_token, 4096, 2 * _GB],  # exactly nothing left
        [14 * _GB + 3 * context * per_token - 1, 14 * _GB, per_token, context, 0],  # one byte short of 3
        [80 * _GB, 14 * _GB, per_token, rng.choice([1, 7, 100_000, 10_000_000]), 6 * _GB],
    ]


def _describe_fit(case) -> str:
    return ("memory_bytes={:.6g}, weight_bytes={:.6g}, kv_bytes_per_token={}, context_len={}, "
            "reserve_bytes={:.6g}").format(*case)


def _compare_fit(got, expected, cases) -> Mismatch | None:
    if type(got) is list:
        for case, g, e in zip(cases, got, expected):
            if type(g) in (int, float) and g < 0:
                return Mismatch("max_concurrency returned a negative number of sequences",
                                f"on {_describe_fit(case)}: expected {e}, got {g!r}; when nothing fits the answer is 0")
    return number_mismatch(got, expected, cases, "max_concurrency returned the wrong number of sequences",
                           _describe_fit, 0.0, integral=True)


register(Check(
    check_id="lab02.max_concurrency",
    task="lab02 task 4: max_concurrency",
    reference=reference(_KV, "max_concurrency"),
    make_inputs=_fitting,
    drive=call_each,
    compare=_compare_fit,
    hint="free = memory - weights - reserve; tokens = free // kv_bytes_per_token; sequences = tokens // context_len.",
))

register(Check(
    check_id="lab02.max_concurrency_tight",
    task="lab02 task 4: max_concurrency",
    reference=reference(_KV, "max_concurrency"),
    make_inputs=_tight,
    drive=call_each,
    compare=_compare_fit,
    hint="when the weights and reserve leave no room the answer is 0, never negative; round down twice: "
    "a partial token or a partial sequence does not fit.",
))
