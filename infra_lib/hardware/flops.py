"""Counting floating-point work, and turning a measured time into a rate."""

from __future__ import annotations


def gemm_flops(m: int, n: int, k: int) -> int:
    """Floating-point operations of C = A @ B with A (m, k) and B (k, n).

    Each of the m*n outputs is a dot product of length k: k multiplies and k adds
    (a fused multiply-add counts as two operations), so 2*m*n*k.
    """
    for name, value in (("m", m), ("n", n), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return 2 * m * n * k


def achieved_tflops(m: int, n: int, k: int, seconds: float) -> float:
    """TFLOP/s reached by an (m, k) @ (k, n) GEMM that took ``seconds``.

    Raises:
        ValueError: ``seconds`` is not a positive number.
    """
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    return gemm_flops(m, n, k) / seconds / 1e12
