"""Checks for lab 02 (the roofline and KV-cache capacity)."""

from __future__ import annotations

import random

from grading.checks.common import call_each, number_mismatch, reference, type_mismatch
from grading.registry import Check, Mismatch, register, register_shortcuts

register_shortcuts(
    "lab02",
    [
        "infra_lib.hardware.roofline:arithmetic_intensity",
        "infra_lib.hardware.roofline:attainable_flops",
        "infra_lib.hardware.roofline:ridge_point",
        "infra_lib.hardware.kv_cache:kv_bytes_per_token",
        "infra_lib.hardware.kv_cache:model_kv_bytes_per_token",
        "infra_lib.hardware.kv_cache:kv_capacity_tokens",
        "infra_lib.hardware.kv_cache:max_concurrency",
    ],
)

_ROOFLINE = "infra_lib.hardware.roofline"
_KV = "infra_lib.hardware.kv_cache"


# --- task 1: arithmetic_intensity -------------------------------------------------------------


def _square_ish(rng: random.Random) -> list[list]:
    return [
        [
            rng.choice([64, 128, 512, 1024, 4096]),
            rng.choice([64, 256, 1024, 4096]),
            rng.choice([64, 256, 1024, 4096]),
            2,
        ]
        for _ in range(6)
    ]


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
    return number_mismatch(
        got, expected, cases, "arithmetic_intensity returned the wrong FLOPs per byte", _describe_gemm, 1e-9
    )


register(
    Check(
        check_id="lab02.arithmetic_intensity",
        task="lab02 task 1: arithmetic_intensity",
        reference=reference(_ROOFLINE, "arithmetic_intensity"),
        make_inputs=_square_ish,
        drive=call_each,
        compare=_compare_intensity,
        hint="intensity is the GEMM's FLOPs (chapter 01's count) per byte that crosses the memory bus, and all three "
        "matrices cross it exactly once: A and B are read, C is written, every element costing bytes_per_element. "
        "chapter 02, section “2 · The roofline: FLOPs per byte decide which ceiling you hit”.",
    )
)

register(
    Check(
        check_id="lab02.arithmetic_intensity_skinny_and_dtypes",
        task="lab02 task 1: arithmetic_intensity",
        reference=reference(_ROOFLINE, "arithmetic_intensity"),
        make_inputs=_skinny_and_dtypes,
        drive=call_each,
        compare=_compare_intensity,
        hint="the same counting holds for a single row (a decode GEMV, where the output is tiny next to the weight) "
        "and for any element size, fractional ones included: 1 byte for fp8, half a byte for int4. Nothing is rounded: "
        "the result is a float.",
    )
)


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
    return [
        [peak / bandwidth, peak, bandwidth],
        [0.0, peak, bandwidth],
        [1e9, peak, bandwidth],
        [peak / bandwidth * (1 - 1e-6), peak, bandwidth],
    ]


def _describe_roof(case) -> str:
    return "intensity={:.6g}, peak_flops={:.4g}, bandwidth={:.4g}".format(*case)


def _compare_roof(got, expected, cases):
    return number_mismatch(got, expected, cases, "attainable_flops returned the wrong rate", _describe_roof, 1e-9)


register(
    Check(
        check_id="lab02.attainable_flops",
        task="lab02 task 2: attainable_flops",
        reference=reference(_ROOFLINE, "attainable_flops"),
        make_inputs=_roofs,
        drive=call_each,
        compare=_compare_roof,
        hint="the roofline is the lower of two ceilings: the compute peak, and the FLOP rate that memory can feed at "
        "this intensity (every byte delivered carries that many FLOPs).",
    )
)

register(
    Check(
        check_id="lab02.attainable_flops_edges",
        task="lab02 task 2: attainable_flops",
        reference=reference(_ROOFLINE, "attainable_flops"),
        make_inputs=_roof_edges,
        drive=call_each,
        compare=_compare_roof,
        hint="the lower-of-two-roofs rule covers the edges with no special case: on the ridge point both roofs give "
        "the peak, just left of it memory binds, at intensity 0 nothing can be computed, and far right the peak.",
    )
)


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


register(
    Check(
        check_id="lab02.kv_bytes_per_token",
        task="lab02 task 3: kv_bytes_per_token",
        reference=reference(_KV, "kv_bytes_per_token"),
        make_inputs=_mha_configs,
        drive=call_each,
        compare=_compare_kv,
        hint="every layer caches, for every KV head, two vectors of head_dim numbers, a key and a value (leaving one "
        "out halves the size), each number taking bytes_per_element bytes. chapter 02, section “5 · From bandwidth "
        "to capacity: the KV cache”.",
    )
)

register(
    Check(
        check_id="lab02.kv_bytes_per_token_gqa_fp8",
        task="lab02 task 3: kv_bytes_per_token",
        reference=reference(_KV, "kv_bytes_per_token"),
        make_inputs=_gqa_fp8_configs,
        drive=call_each,
        compare=_compare_kv,
        hint="only KV heads are cached (several query heads share one under grouped-query attention, all of them "
        "share a single one under multi-query), and the element size is a parameter, not always 2 bytes: 1 for an "
        "FP8 cache, 4 for fp32.",
    )
)


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
    return (
        "memory_bytes={:.6g}, weight_bytes={:.6g}, kv_bytes_per_token={}, context_len={}, reserve_bytes={:.6g}"
    ).format(*case)


def _compare_fit(got, expected, cases) -> Mismatch | None:
    if type(got) is list:
        for case, g, e in zip(cases, got, expected):
            if type(g) in (int, float) and g < 0:
                return Mismatch(
                    "max_concurrency returned a negative number of sequences",
                    f"on {_describe_fit(case)}: expected {e}, got {g!r}; when nothing fits the answer is 0",
                )
    return number_mismatch(
        got,
        expected,
        cases,
        "max_concurrency returned the wrong number of sequences",
        _describe_fit,
        0.0,
        integral=True,
    ) or type_mismatch(
        got,
        cases,
        int,
        "max_concurrency must return the number of sequences as an int",
        _describe_fit,
        "a number of sequences is a count, an int: sizes given as floats (80e9) "
        "make every division of them a float too, even a floor division, so the whole number "
        "must be turned into an int before it is returned.",
    )


register(
    Check(
        check_id="lab02.max_concurrency",
        task="lab02 task 4: max_concurrency",
        reference=reference(_KV, "max_concurrency"),
        make_inputs=_fitting,
        drive=call_each,
        compare=_compare_fit,
        hint="the cache may use only the memory left after the weights and the reserve; that holds a whole number of "
        "tokens' caches, which make a whole number of full-length sequences, so round down at each step and return "
        "an int. chapter 02, section “5 · From bandwidth to capacity: the KV cache”.",
    )
)

register(
    Check(
        check_id="lab02.max_concurrency_tight",
        task="lab02 task 4: max_concurrency",
        reference=reference(_KV, "max_concurrency"),
        make_inputs=_tight,
        drive=call_each,
        compare=_compare_fit,
        hint="when the weights and reserve leave no room the answer is 0, never negative, and a partial token or a "
        "partial sequence does not fit. Weights that alone overflow memory, a reserve that does, exactly nothing "
        "left, one byte short of one more sequence, and contexts from one token to ten million.",
    )
)
