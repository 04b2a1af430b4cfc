"""Numbers the lessons state in prose, recomputed with the library functions the lessons use: two
chapters that quote the same plan quote the same figures."""

from __future__ import annotations

import re

import nbformat

from conftest import REPO
from infra_lib.hardware.kv_cache import MODELS, kv_capacity_tokens, max_concurrency, model_kv_bytes_per_token, \
    weight_bytes


def _markdown(chapter: str) -> str:
    path = next((REPO / "notebooks").glob(f"{chapter}_*.ipynb"))
    text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
    return re.sub(r"\s+", " ", text)


def test_the_kv_capacity_plan_of_chapter_00_is_chapter_02s():
    """Llama-2-7B in fp16 on an 80 GB card, with chapter 02's 6 GB reserve."""
    llama2 = MODELS["Llama-2-7B"]
    weights, per_token = weight_bytes(llama2, "fp16"), model_kv_bytes_per_token(llama2, "fp16")
    tokens = kv_capacity_tokens(80e9, weights, per_token, 6e9)
    at_2k, at_8k = (max_concurrency(80e9, weights, per_token, n, 6e9) for n in (2048, 8192))
    no_reserve = max_concurrency(80e9, weights, per_token, 2048, 0)
    stack = _markdown("00")
    assert f"about {round(tokens, -3):,} tokens of cache" in stack, tokens
    assert f"{at_2k} requests of 2,048 tokens, or {at_8k} of 8,192" in stack, (at_2k, at_8k)
    assert f"the arithmetic promises {no_reserve}" in stack, no_reserve
    # Chapter 02 works the same plan from the seed's round 14 GB of weights, then the true 13.5 GB.
    seed = max_concurrency(80e9, 7e9 * 2, per_token, 2048, 6e9)
    roofline = _markdown("02")
    assert f"so {seed} sequences, not 60" in roofline and at_2k == seed + 1 and "one more sequence fits" in roofline


def test_chapter_07_offload_size_is_llama3_8bs_kv_cache():
    per_token = model_kv_bytes_per_token(MODELS["Llama-3-8B"], "bf16")
    assert per_token == 128 * 2**10
    assert f"a 2,000-token sequence is {2000 * per_token / 2**20:.0f} MiB each way" in _markdown("07")


def test_chapter_00_draws_the_lessons_stack_and_the_chapters_use_its_numbering():
    """The L0.1 lesson's seven layers, with its names, are chapter 00's second map, and every
    chapter's header names its layer in that numbering."""
    stack = _markdown("00")
    for layer in ("L0/L1 hardware", "L2 data and operators", "L3 training", "L4 inference and serving",
                  "L5 MLOps/LLMOps", "L6 application architecture"):
        assert f"**{layer}**" in stack, layer
    names = {"L0/L1": "hardware", "L2": "data and operators", "L3": "training", "L4": "inference and serving",
             "L5": "MLOps/LLMOps", "L6": "application architecture"}
    for path in sorted((REPO / "notebooks").glob("[01][0-9]_*.ipynb"))[1:]:
        header = nbformat.read(path, as_version=4).cells[0].source.splitlines()[2]
        assert header.startswith("*Layer"), (path.name, header)
        layers = re.findall(r"L[0-6](?:/L1)?", header.split("·")[0])
        assert layers and all(name in header for name in (names.get(layer, "") for layer in layers[:1])), \
            (path.name, header)
