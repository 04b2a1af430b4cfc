"""Bytes per weight of one decode GEMV: fp32, fused int4 and fused Q4_1, counted in Triton's interpreter.

At SmolLM2's layer shapes (n x k: 576 x 576 for q/o, 1536 x 576 for gate/up, 576 x 1536 for
down) and one row of x, the traffic counter counts what each kernel loads and stores: the
course's tiled fp32 matmul reading W as stored (x @ W.T), ``q4_matmul`` on ``QuantLinear(bits=4)``
storage (groups of 64) and ``q4_1_matmul`` on GGUF Q4_1 blocks, all with 64 output features per
program. Each count must equal its formula, and the script stops if one does not.

The derived column turns bytes per weight into time: one decode token of a 135M-parameter model
whose every weight moves that many bytes, read at an H100's 3.35 TB/s. That is a floor (the
weights read once, at full bandwidth), and the reason decoding wants fewer bytes per weight.

Counting needs the interpreter. With a GPU, Triton compiles and the script reports the formulas
(flag ``counted`` false): measure there with Nsight Compute instead.

Usage:
    python benchmarks/q4_gemv_traffic.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import sys

import torch
from benchmark_cli import benchmark_main

from infra_lib.hardware.probes import machine_info
from infra_lib.hardware.specs import get_accelerator
from infra_lib.kernels.gemv_q4 import q4_1_matmul, q4_1_matmul_bytes, q4_matmul, q4_matmul_bytes, tile_shape
from infra_lib.kernels.matmul import matmul, tiled_matmul_bytes
from infra_lib.kernels.traffic import count_traffic
from infra_lib.kernels.triton_env import interpreter_active
from infra_lib.model.quant import QuantLinear

SEED = 0
SHAPES = [(576, 576), (1536, 576), (576, 1536)]  # (n, k): q/o, gate/up, down
ROWS = 1  # one decode token
GROUP_SIZE = 64
BLOCK_N = 64
MODEL_PARAMS = 135e6
ACCELERATOR = "H100 SXM"


def _fp32_gemv(x, weight):
    return matmul(x, weight.t(), block_m=16, block_n=BLOCK_N, block_k=32)


def _random_q4_1(n: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Q4_1 blocks of random bytes, with scales and minimums of a plausible size."""
    d = (torch.rand(n, k // 32, generator=generator) * 0.02).half()
    m_min = (-torch.rand(n, k // 32, generator=generator) * 0.15).half()
    qs = torch.randint(0, 256, (n, k // 32, 16), generator=generator, dtype=torch.uint8)
    return d, m_min, qs


def shape_rows(n: int, k: int, seed: int = SEED) -> list[dict]:
    """One row per kernel for y[1, n] = x[1, k] @ W.T: counted and formula bytes."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, k, generator=generator)
    weight = torch.randn(n, k, generator=generator) * 0.05
    layer = QuantLinear(weight, bits=4, group_size=GROUP_SIZE)
    d, m_min, qs = _random_q4_1(n, k, generator)
    block_m = tile_shape(ROWS, BLOCK_N)[0]
    kernels = [
        ("fp32 GEMV", lambda: _fp32_gemv(x, weight), tiled_matmul_bytes(ROWS, n, k, 16, BLOCK_N), 4.0),
        (
            "int4 fused",
            lambda: q4_matmul(x, layer.qweight, layer.scales, GROUP_SIZE, block_n=BLOCK_N),
            q4_matmul_bytes(ROWS, n, k, GROUP_SIZE, block_m=block_m, block_n=BLOCK_N),
            0.5 + 4 / GROUP_SIZE,
        ),
        (
            "Q4_1 fused",
            lambda: q4_1_matmul(x, d, m_min, qs, block_n=BLOCK_N),
            q4_1_matmul_bytes(ROWS, n, k, block_m=block_m, block_n=BLOCK_N),
            20 / 32,
        ),
    ]
    rows = []
    for name, launch, formula, weight_only in kernels:
        counted = None
        if interpreter_active():
            with count_traffic() as traffic:
                launch()
            counted = {"loaded": traffic.bytes_loaded, "stored": traffic.bytes_stored}
            if counted != formula:
                raise SystemExit(f"{name} at {n} x {k}: counted {counted} but the formula says {formula}")
        moved = formula["loaded"] + formula["stored"]
        rows.append(
            {
                "shape": [n, k],
                "kernel": name,
                "counted": counted,
                "formula": formula,
                "bytes_per_weight": moved / (n * k),
                "weight_bytes_per_weight": weight_only,
            }
        )
    for row in rows:
        row["fraction_of_fp32"] = row["bytes_per_weight"] / rows[0]["bytes_per_weight"]
    return rows


def run_traffic(device: torch.device, quick: bool) -> dict:
    """Count every kernel at every shape; add the per-token time they imply on the accelerator."""
    accelerator = get_accelerator(ACCELERATOR)
    rows = [row for n, k in (SHAPES[:1] if quick else SHAPES) for row in shape_rows(n, k)]
    for row in rows:
        token_bytes = MODEL_PARAMS * row["bytes_per_weight"]
        row["token_bytes"] = token_bytes
        row["token_floor_us"] = token_bytes / accelerator.bandwidth_bytes_per_s * 1e6
    return {
        "benchmark": "q4_gemv_traffic",
        "machine_info": machine_info(device),
        "seed": SEED,
        "flags": {
            "quick": quick,
            "device": str(device),
            "counted": interpreter_active(),
            "rows": ROWS,
            "group_size": GROUP_SIZE,
            "block_n": BLOCK_N,
        },
        "model_params": MODEL_PARAMS,
        "accelerator": {"name": accelerator.name, "hbm_tbps": accelerator.hbm_tbps, "source": accelerator.source},
        "results": rows,
    }


def format_table(result: dict) -> str:
    """Bytes per weight per shape and kernel, and the per-token floor on the accelerator."""
    acc, how = result["accelerator"], "counted" if result["flags"]["counted"] else "by formula"
    lines = [
        f"y = x @ W.T for one row of x, bytes {how}; last column: one token of a "
        f"{result['model_params'] / 1e6:.0f}M-parameter model at {acc['name']}'s {acc['hbm_tbps']} TB/s",
        f"{'n x k':>11} {'kernel':<11} {'loaded B':>10} {'stored B':>9} {'B/weight':>9} {'weights only':>12} "
        f"{'of fp32':>8} {'token floor':>12}",
    ]
    for row in result["results"]:
        n, k = row["shape"]
        lines.append(
            f"{f'{n} x {k}':>11} {row['kernel']:<11} {row['formula']['loaded']:>10,} "
            f"{row['formula']['stored']:>9,} {row['bytes_per_weight']:>9.4f} "
            f"{row['weight_bytes_per_weight']:>12.4f} {row['fraction_of_fp32']:>8.1%} "
            f"{row['token_floor_us']:>9.1f} us"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "q4_gemv_traffic", run_traffic, format_table)


if __name__ == "__main__":
    sys.exit(main())
