"""L0/L1: what the hardware can do: FLOP counts, probes of this machine, (later) the roofline."""

from infra_lib.hardware.flops import achieved_tflops, gemm_flops

__all__ = ["achieved_tflops", "gemm_flops"]
