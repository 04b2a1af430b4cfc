"""Checks for lab 15 (serving kernels): the online softmax, FlashAttention forward and paged decode
attention kernels, and the bonus fused 4-bit GEMV.

Each driver launches the learner's ``@triton.jit`` kernel itself, with the grid and block sizes the
task states, on seeded shapes that are not multiples of the blocks; the reference kernel is launched
the same way. Every launch goes through ``check_bounds`` (guard bands around each tensor), and in the
interpreter ``count_traffic`` counts the bytes it moved. When values differ, the comparison names
the mistake the data shows: the driver also computes in torch what the usual mistakes would give
(an accumulator never rescaled, a mask on the wrong diagonal, heads mapped the wrong way...), and
the comparison reads those from the reference's side only, so the learner's process never decides
its own verdict.
"""

from __future__ import annotations

from grading.registry import register_shortcuts

register_shortcuts(
    "lab15",
    [
        "infra_lib.kernels.softmax:softmax",
        "infra_lib.kernels.flash_attention:flash_attention",
        "infra_lib.kernels.flash_attention:naive_attention",
        "infra_lib.kernels.flash_attention:attention_reference",
        "infra_lib.kernels.flash_attention:flash_cached_attention",
        "infra_lib.kernels.paged_decode:paged_decode_attention",
        "infra_lib.kernels.paged_decode:decode_launches",
        "infra_lib.kernels.paged_decode:gather_then_attend",
        "infra_lib.kernels.paged_decode:paged_decode_cached_attention",
        "infra_lib.kernels.gemv_q4:q4_matmul",
        "infra_lib.kernels.gemv_q4:q4_matmul_launch",
        "infra_lib.kernels.gemv_q4:q4_1_matmul",
        "infra_lib.kernels.gemv_q4:fused_forward",
    ],
)

from . import task1_online_softmax, task2_flash_attention, task3_paged_decode, task4_q4_gemv  # noqa: E402,F401
