"""Checks for lab 03 (Triton): the fused softmax, tiled matmul and RMSNorm kernels.

Each driver launches the learner's @triton.jit kernel itself, with the grid and block sizes
the task states, on seeded shapes that are not multiples of the blocks; the reference
kernel is launched the same way. Every launch goes through ``check_bounds``: each tensor
sits between guard bands, so a missing mask is reported by name instead of corrupting the
kernel's memory; in the interpreter ``count_traffic`` also counts the bytes moved, per argument.
"""

from grading.registry import register_shortcuts

register_shortcuts(
    "lab03",
    [
        "infra_lib.kernels.softmax:softmax",
        "infra_lib.kernels.softmax:softmax_three_pass",
        "infra_lib.kernels.softmax:online_softmax_kernel",  # lab 15's reference: a softmax in one pass
        "infra_lib.kernels.matmul:matmul",
        "infra_lib.kernels.rmsnorm:rmsnorm",
    ],
)

# each task's module registers its checks, in task order; TOLERANCES are what each task's text states
from . import task1_softmax, task2_matmul, task3_rmsnorm  # noqa: E402,F401
from .kernel_launch import TOLERANCES  # noqa: E402,F401
