"""Checks for lab 06 (the KV cache): causal mask, GQA head sharing, the cached attention step,
and a cached greedy decode loop, each compared with the reference on seeded inputs and, plugged
into a real decoder, by the tokens it generates."""

from __future__ import annotations

from grading.checks.model_cases import tiny_model  # noqa: F401  (tests build the lab's small model from here)
from grading.registry import register_shortcuts

register_shortcuts(
    "lab06",
    [
        "infra_lib.model.attention:causal_mask",
        "infra_lib.model.attention:repeat_kv",
        "infra_lib.model.attention:attention",
        "infra_lib.model.attention:cached_attention",
        "infra_lib.model.generation:greedy_decode",
        "infra_lib.model.generation:generate",
        "infra_lib.model.generation:stream",
    ],
)

from . import (  # noqa: E402,F401  (each task's module registers its checks, in task order)
    task1_causal_mask,
    task2_repeat_kv,
    task3_cached_attention,
    task4_greedy_decode,
)
