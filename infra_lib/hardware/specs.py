"""Datasheet figures of the accelerators the course talks about, per GPU, dense (no sparsity).

Vendors often quote tensor-core throughput "with sparsity" (2:4 structured sparsity doubles
the headline). Those numbers are halved here, because a dense GEMM cannot use them.
Bandwidth is in decimal TB/s. Memory is the number vendors quote in "GB", which the course
turns into bytes with 1 GB = 1e9; HBM stacks are binary-sized, so the true capacity is often
that many GiB (up to 7% more), which makes 1e9 the safe side. Each row names its public
source; where a vendor has published no exact figure, the comment above the row says so and
which value was picked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from infra_lib.hardware import roofline


@dataclass(frozen=True)
class Accelerator:
    """One accelerator's ceilings, per device.

    Attributes:
        bf16_dense_tflops: dense BF16 tensor/matrix throughput, TFLOP/s.
        fp8_dense_tflops: dense FP8 throughput, TFLOP/s; None where the chip has no FP8.
        hbm_gb: on-package memory, GB as the vendor quotes it.
        hbm_tbps: memory bandwidth, TB/s.
        interconnect_gbps: scale-up link bandwidth per device, GB/s (all links, both directions).
        interconnect: the link's name (NVLink, Infinity Fabric, HCCS).
        source: the public document the figures come from.
    """

    name: str
    vendor: str
    bf16_dense_tflops: float
    fp8_dense_tflops: float | None
    hbm_gb: float
    hbm_tbps: float
    interconnect_gbps: float
    interconnect: str
    source: str

    def __post_init__(self):
        for field in ("bf16_dense_tflops", "hbm_gb", "hbm_tbps", "interconnect_gbps"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{self.name}: {field} must be a positive number, got {value!r}")
        if self.fp8_dense_tflops is not None and not self.fp8_dense_tflops > 0:
            raise ValueError(f"{self.name}: fp8_dense_tflops must be positive or None, got {self.fp8_dense_tflops!r}")
        if not self.source.strip():
            raise ValueError(f"{self.name}: every row needs a source")

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb * 1e9

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense peak in FLOP/s for "bf16" or "fp8".

        Raises:
            ValueError: unknown dtype, or FP8 on a chip without it.
        """
        if dtype == "bf16":
            return self.bf16_dense_tflops * 1e12
        if dtype == "fp8":
            if self.fp8_dense_tflops is None:
                raise ValueError(f"{self.name} has no FP8 support; use dtype='bf16'")
            return self.fp8_dense_tflops * 1e12
        raise ValueError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")

    def ridge_point(self, dtype: str = "bf16") -> float:
        """FLOPs per byte at which this chip stops waiting on memory: peak / bandwidth."""
        return roofline.ridge_point(self.peak_flops(dtype), self.bandwidth_bytes_per_s)


_ROWS = [
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column: BF16 1,979 and FP8 3,958 TFLOPS are
    # quoted with sparsity (halved here); 80 GB HBM3 at 3.35 TB/s; NVLink 4 at 900 GB/s.
    Accelerator(
        "H100 SXM", "NVIDIA", 989, 1979, 80, 3.35, 900, "NVLink 4", "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"
    ),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM column: the H100's compute with 141 GB of
    # HBM3e at 4.8 TB/s; NVLink 4 at 900 GB/s.
    Accelerator(
        "H200 SXM", "NVIDIA", 989, 1979, 141, 4.8, 900, "NVLink 4", "NVIDIA H200 Tensor Core GPU datasheet (SXM)"
    ),
    # NVIDIA HGX B200 / DGX B200 datasheets (8-GPU totals divided by 8): FP16/BF16 36 PFLOPS and
    # FP8 72 PFLOPS with sparsity, so about 2,250 and 4,500 dense per GPU. The package carries
    # 192 GB of HBM3e at 8 TB/s (Blackwell launch, GTC 2024); the DGX B200 datasheet lists
    # 1,440 GB per 8 GPUs, i.e. 180 GB usable per GPU. NVLink 5 at 1.8 TB/s.
    Accelerator(
        "B200",
        "NVIDIA",
        2250,
        4500,
        192,
        8.0,
        1800,
        "NVLink 5",
        "NVIDIA HGX B200 / DGX B200 datasheets; Blackwell launch, GTC 2024",
    ),
    # NVIDIA GB300 NVL72 product page, rack totals divided by 72 GPUs: FP8 720 and BF16 360 PFLOPS
    # with sparsity give about 5,000 and 2,500 dense per GPU (approximate: NVIDIA publishes no
    # per-GPU dense table); 288 GB HBM3e per GPU, 576 TB/s per rack = 8 TB/s; NVLink 5 130 TB/s
    # per rack = 1.8 TB/s per GPU.
    Accelerator(
        "GB300 (per GPU)",
        "NVIDIA",
        2500,
        5000,
        288,
        8.0,
        1800,
        "NVLink 5",
        "NVIDIA GB300 NVL72 product page (rack figures / 72)",
    ),
    # AMD Instinct MI300X data sheet: peak BF16 1,307.4 and FP8 2,614.9 TFLOPS dense (the sheet
    # lists the sparse figures separately); 192 GB HBM3 at 5.3 TB/s; 7 Infinity Fabric links of
    # 128 GB/s = 896 GB/s aggregate.
    Accelerator(
        "MI300X", "AMD", 1307, 2615, 192, 5.3, 896, "Infinity Fabric", "AMD Instinct MI300X accelerator data sheet"
    ),
    # Huawei has published no full datasheet for the Ascend 910B. Public figures (Atlas 800T A2
    # material, press and analyst reports) vary by variant: FP16/BF16 roughly 280-400 TFLOPS;
    # we pick 320, the most often cited. 64 GB HBM2e at about 1.6 TB/s and HCCS about 392 GB/s
    # are approximate. The 910B has no FP8 units, hence None.
    Accelerator(
        "Ascend 910B",
        "Huawei",
        320,
        None,
        64,
        1.6,
        392,
        "HCCS",
        "Huawei Atlas 800T A2 material and press reports (approximate; no full public datasheet)",
    ),
]

ACCELERATORS: dict[str, Accelerator] = {row.name: row for row in _ROWS}


def get_accelerator(name: str) -> Accelerator:
    """The spec row called ``name``.

    Raises:
        KeyError: no such row; the message lists the names there are.
    """
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise KeyError(f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}") from None


def to_rows() -> list[dict]:
    """The table for display: one dict per accelerator, units in the keys, BF16 ridge point added."""
    return [{**asdict(acc), "bf16_ridge_flop_per_byte": acc.ridge_point("bf16")} for acc in ACCELERATORS.values()]
