"""Numbers the lessons state in prose, recomputed with the library functions the lessons use: two
chapters that quote the same plan quote the same figures."""

from __future__ import annotations

import re

import nbformat
from conftest import REPO
from test_lesson_claims import lesson_text

from infra_lib.hardware.kv_cache import (
    MODELS,
    kv_capacity_tokens,
    max_concurrency,
    model_kv_bytes_per_token,
    weight_bytes,
)
from infra_lib.hardware.roofline import arithmetic_intensity, attainable_flops, ridge_point
from infra_lib.hardware.specs import get_accelerator
from infra_lib.kernels.matmul import tiled_matmul_bytes
from infra_lib.kernels.softmax import softmax_bytes


def test_the_kv_capacity_plan_of_chapter_00_is_chapter_02s():
    """Llama-2-7B in fp16 on an 80 GB card, with chapter 02's 6 GB reserve."""
    llama2 = MODELS["Llama-2-7B"]
    weights, per_token = weight_bytes(llama2, "fp16"), model_kv_bytes_per_token(llama2, "fp16")
    tokens = kv_capacity_tokens(80e9, weights, per_token, 6e9)
    at_2k, at_8k = (max_concurrency(80e9, weights, per_token, n, 6e9) for n in (2048, 8192))
    no_reserve = max_concurrency(80e9, weights, per_token, 2048, 0)
    stack = lesson_text("00")
    assert f"about {round(tokens, -3):,} tokens of cache" in stack, tokens
    assert f"{at_2k} requests of 2,048 tokens, or {at_8k} of 8,192" in stack, (at_2k, at_8k)
    assert f"the arithmetic promises {no_reserve}" in stack, no_reserve
    # Chapter 02 works the same plan from the seed's round 14 GB of weights, then the true 13.5 GB.
    seed = max_concurrency(80e9, 7e9 * 2, per_token, 2048, 6e9)
    roofline = lesson_text("02")
    assert f"so {seed} sequences, not 60" in roofline and at_2k == seed + 1 and "one more sequence fits" in roofline


def test_chapter_07_offload_size_is_llama3_8bs_kv_cache():
    per_token = model_kv_bytes_per_token(MODELS["Llama-3-8B"], "bf16")
    assert per_token == 128 * 2**10
    assert f"a 2,000-token sequence is {2000 * per_token / 2**20:.0f} MiB each way" in lesson_text("07")


def test_chapter_00_draws_the_lessons_stack_and_the_chapters_use_its_numbering():
    """The L0.1 lesson's seven layers, with its names, are chapter 00's second map, and every
    chapter's header names its layer in that numbering."""
    stack = lesson_text("00")
    for layer in (
        "L0/L1 hardware",
        "L2 data and operators",
        "L3 training",
        "L4 inference and serving",
        "L5 MLOps/LLMOps",
        "L6 application architecture",
    ):
        assert f"**{layer}**" in stack, layer
    names = {
        "L0/L1": "hardware",
        "L2": "data and operators",
        "L3": "training",
        "L4": "inference and serving",
        "L5": "MLOps/LLMOps",
        "L6": "application architecture",
    }
    for path in sorted((REPO / "notebooks").glob("[01][0-9]_*.ipynb"))[1:]:
        header = nbformat.read(path, as_version=4).cells[0].source.splitlines()[2]
        assert header.startswith("*Layer"), (path.name, header)
        layers = re.findall(r"L[0-6](?:/L1)?", header.split("·")[0])
        assert layers and all(name in header for name in (names.get(layer, "") for layer in layers[:1])), (
            path.name,
            header,
        )


def test_chapter_02_quotes_the_spec_tables_ratios():
    h100, h200, b200 = (get_accelerator(name) for name in ("H100 SXM", "H200 SXM", "B200"))
    roofline = lesson_text("02")
    flops, bandwidth = b200.bf16_dense_tflops / h100.bf16_dense_tflops, b200.hbm_tbps / h100.hbm_tbps
    assert f"the B200 has {flops:.1f} times the H100's BF16 FLOP/s and {bandwidth:.1f} times its bandwidth" in roofline
    h100_ridge = ridge_point(h100.peak_flops("bf16"), h100.bandwidth_bytes_per_s)
    h200_ridge = ridge_point(h200.peak_flops("bf16"), h200.bandwidth_bytes_per_s)
    assert f"at about {h200_ridge:.0f} FLOPs per byte instead of {h100_ridge:.0f}" in roofline
    gemv = arithmetic_intensity(1, 4096, 4096, bytes_per_element=2)
    share = attainable_flops(gemv, h100.peak_flops("bf16"), h100.bandwidth_bytes_per_s) / h100.peak_flops("bf16")
    assert 250 < h100_ridge / gemv < 300 and "almost three hundred times left of the ridge" in roofline
    assert round(share * 300) == 1 and "about a third of a percent of its Tensor Cores" in roofline


def test_chapter_03_numbers_follow_from_the_byte_formulas():
    h100 = get_accelerator("H100 SXM")
    triton_text = lesson_text("03")
    # section 4: the toy softmax's predicted times, QUICK and full sizes, fused and three-pass
    toy = [
        sum(softmax_bytes(rows, cols, 4, three_pass=three).values()) / h100.bandwidth_bytes_per_s
        for rows, cols in ((64, 300), (256, 1000))
        for three in (False, True)
    ]
    assert max(toy) < 1.5e-6 and "the predicted times are about a microsecond at most" in triton_text
    fused, three = (sum(softmax_bytes(32 * 2048, 2048, 4, three_pass=t).values()) for t in (False, True))
    saved_ms = (three - fused) / h100.bandwidth_bytes_per_s * 1e3
    assert 0.28 < saved_ms < 0.38 and "About a third of a millisecond per layer" in triton_text
    assert f"Its {64 * 300 * 4 / 1e3:.0f} kB fit easily" in triton_text
    # thinking questions 3 and 4
    tiles = tiled_matmul_bytes(4096, 4096, 4096, 128, 128, element_size=2)
    assert f"about {2 * 4096**3 / tiles['loaded']:.0f} FLOPs per byte of tile loads" in triton_text
    assert (
        f"about {arithmetic_intensity(4096, 4096, 4096, bytes_per_element=2):,.0f} FLOPs per byte for this shape"
        in triton_text
    )
    padded = 2 * 96 * 64 * 96 / (2 * 77 * 45 * 93)  # 77 x 45 x 93 in 32-tiles: 3 x 2 x 3 tiles
    assert f"computed {padded:.2f} times the useful FLOPs" in triton_text
