"""The roofline model: how fast an operation can go on a chip, from its arithmetic intensity.

Attainable FLOP/s = min(peak FLOP/s, intensity x memory bandwidth). Below the ridge point
(peak / bandwidth) an operation waits on memory; above it, on arithmetic.
"""

from __future__ import annotations

MEMORY_BOUND = "memory-bound"
COMPUTE_BOUND = "compute-bound"


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def arithmetic_intensity(m: int, n: int, k: int, bytes_per_element: float = 2) -> float:
    """FLOPs per byte of an (m, k) @ (k, n) GEMM that reads A and B and writes C once.

    2*m*n*k FLOPs over (m*k + k*n + m*n) * bytes_per_element bytes: the best case, with
    perfect on-chip reuse. m = 1 is a GEMV (decode), whose intensity stays near 1 FLOP per
    weight byte however large n and k grow.
    """
    for name, value in (("m", m), ("n", n), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    _positive("bytes_per_element", bytes_per_element)
    return 2 * m * n * k / ((m * k + k * n + m * n) * bytes_per_element)


def elementwise_intensity(
    flops_per_element: float = 1, inputs: int = 2, outputs: int = 1, bytes_per_element: float = 2
) -> float:
    """FLOPs per byte of an elementwise op (c = a + b: 1 FLOP, 2 inputs, 1 output)."""
    _positive("flops_per_element", flops_per_element, allow_zero=True)
    _positive("bytes_per_element", bytes_per_element)
    if inputs + outputs < 1:
        raise ValueError("an elementwise op moves at least one tensor")
    return flops_per_element / ((inputs + outputs) * bytes_per_element)


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: min(peak_flops, intensity * bandwidth), in FLOP/s.

    Args:
        intensity: FLOPs per byte moved to or from memory.
        peak_flops: the chip's compute ceiling, FLOP/s.
        bandwidth: its memory bandwidth, bytes/s.
    """
    _positive("intensity", intensity, allow_zero=True)
    _positive("peak_flops", peak_flops)
    _positive("bandwidth", bandwidth)
    return min(peak_flops, intensity * bandwidth)


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The intensity (FLOP/byte) where the memory roof meets the compute roof."""
    _positive("peak_flops", peak_flops)
    _positive("bandwidth", bandwidth)
    return peak_flops / bandwidth


def bound(intensity: float, peak_flops: float, bandwidth: float) -> str:
    """ "memory-bound" below the ridge point, "compute-bound" at or above it."""
    return MEMORY_BOUND if intensity < ridge_point(peak_flops, bandwidth) else COMPUTE_BOUND
