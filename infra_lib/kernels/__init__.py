"""L2: how one line of Python becomes kernels: profiling now, Triton and compilation later."""

from infra_lib.kernels.profiling import (
    achieved_tflops,
    dominant_op,
    gemm_flops,
    profile_op,
    time_op,
)

__all__ = ["achieved_tflops", "dominant_op", "gemm_flops", "profile_op", "time_op"]
