"""Checks for lab 06 (the model and its KV cache): RMSNorm, RoPE and the Llama decoder itself on small random models
and on SmolLM2's weights, then the causal mask, GQA head sharing, the cached attention step (on tensors and inside the
learner's decoder) and a cached greedy decode loop, each compared with the reference on seeded inputs."""

from __future__ import annotations

from grading.checks.model_cases import tiny_model  # noqa: F401  (tests build the lab's small model from here)
from grading.registry import register_shortcuts

# The course's decoder and its pieces are tasks 1 to 3's reference: an answer importing them is not run, a call into
# any of them while a check drives the learner's code is a shortcut, and the graded kernel sees them as stubs (so
# every check builds the learner's class from weights, never the course's model).
register_shortcuts(
    "lab06",
    [
        "infra_lib.model.model:RMSNorm",
        "infra_lib.model.model:rope_tables",
        "infra_lib.model.model:apply_rope",
        "infra_lib.model.model:Attention",
        "infra_lib.model.model:MLP",
        "infra_lib.model.model:DecoderLayer",
        "infra_lib.model.model:Llama",
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
    task1_rms_norm,
    task2_rope,
    task3_llama,
    task4_causal_mask,
    task5_repeat_kv,
    task6_cached_attention,
    task7_greedy_decode,
)
