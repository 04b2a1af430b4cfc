"""Memory traffic of causal attention: the naive three kernels against FlashAttention, per sequence length.

For each length s (prefill: t = s queries over s keys, one batch, one head, float32), the
bytes every tl.load and tl.store moves are counted in Triton's interpreter: the naive
version writes the t x s score matrix and reads it back twice; FlashAttention reads Q once
and K and V once per query block (skipping the blocks the causal mask hides), and writes O
and the log-sum-exp. Counted bytes are compared with the formulas in
``infra_lib.kernels.flash_attention``; on a GPU, where kernels are compiled and nothing can be
counted from Python, the formulas alone are reported (``counted: false``). Two query block
sizes show the K/V re-reads shrinking as the block grows.

Usage:
    python benchmarks/flash_traffic.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import sys

import torch
from benchmark_cli import benchmark_main

from infra_lib.hardware.probes import machine_info
from infra_lib.kernels.flash_attention import (
    DEFAULT_BLOCK,
    flash_attention,
    flash_attention_bytes,
    naive_attention,
    naive_attention_bytes,
)
from infra_lib.kernels.traffic import count_traffic
from infra_lib.kernels.triton_env import interpreter_active, kernel_device

SEED = 0
HEAD_DIM = 64
LENGTHS = [32, 64, 128, 256]
QUICK_LENGTHS = [32, 64]
LARGE_BLOCK_M = 64  # a second FlashAttention query block: fewer K/V re-reads


def _bytes(formula: dict, traffic=None) -> dict:
    """{"loaded", "stored", "total"} from the counter when there is one, else from the formula."""
    loaded, stored = (traffic.bytes_loaded, traffic.bytes_stored) if traffic else (formula["loaded"], formula["stored"])
    return {"loaded": loaded, "stored": stored, "total": loaded + stored}


def _measure(formula: dict, counting: bool, fn, *args, **kwargs) -> tuple[dict, torch.Tensor]:
    """Run ``fn(*args, **kwargs)``; return its bytes (counted when ``counting``) and its output."""
    if not counting:
        return _bytes(formula), fn(*args, **kwargs)
    with count_traffic() as traffic:
        out = fn(*args, **kwargs)
    return _bytes(formula, traffic), out


def measure_length(s: int, device: torch.device, counting: bool) -> dict:
    """Naive and flash (two query blocks) at t = s, causal; bytes, ratio, and the outputs' difference."""
    generator = torch.Generator().manual_seed(SEED + s)
    q, k, v = (torch.randn(1, 1, s, HEAD_DIM, generator=generator).to(device) for _ in range(3))
    naive_formula = naive_attention_bytes(1, 1, s, s, HEAD_DIM)
    naive, naive_out = _measure(naive_formula, counting, naive_attention, q, k, v)
    naive["scores"] = naive_formula["scores"]
    row = {"s": s, "t": s, "naive": naive}
    matches = naive == {**_bytes(naive_formula), "scores": naive_formula["scores"]}
    difference = 0.0
    for key, block_m in (("flash", DEFAULT_BLOCK), (f"flash_block_m_{LARGE_BLOCK_M}", LARGE_BLOCK_M)):
        formula = flash_attention_bytes(1, 1, s, s, HEAD_DIM, causal=True, block_m=block_m)
        row[key], (out, _) = _measure(formula, counting, flash_attention, q, k, v, block_m=block_m)
        row[key]["block_m"] = block_m
        matches = matches and row[key]["total"] == formula["loaded"] + formula["stored"]
        difference = max(difference, float((out - naive_out).abs().max()))
    row["naive_over_flash"] = naive["total"] / row["flash"]["total"]
    row["matches_formula"] = matches
    row["max_abs_difference"] = difference
    return row


def run_flash_traffic(device: torch.device, quick: bool) -> dict:
    counting = interpreter_active()
    device = kernel_device()  # the kernels run where Triton runs them: the GPU, or the CPU in the interpreter
    lengths = QUICK_LENGTHS if quick else LENGTHS
    return {
        "benchmark": "flash_traffic",
        "machine_info": machine_info(device),
        "seed": SEED,
        "flags": {
            "quick": quick,
            "device": str(device),
            "lengths": lengths,
            "head_dim": HEAD_DIM,
            "batch": 1,
            "n_heads": 1,
            "causal": True,
            "dtype": "float32",
            "block_n": DEFAULT_BLOCK,
            "counted": counting,
        },
        "results": [measure_length(s, device, counting) for s in lengths],
    }


def format_table(result: dict) -> str:
    flags = result["flags"]
    source = "counted in Triton's interpreter" if flags["counted"] else "from the formulas (compiled kernels)"
    large = f"flash_block_m_{LARGE_BLOCK_M}"
    lines = [
        f"causal attention, t = s, head_dim {flags['head_dim']}, {flags['dtype']}, one head; bytes {source}",
        f"{'s':>5} {'naive loaded':>13} {'stored':>10} {'total':>10} {'scores':>9} | {'flash loaded':>12} "
        f"{'stored':>7} {'total':>9} {'naive/flash':>11} | {'block_m 64':>10}",
    ]
    for row in result["results"]:
        naive, flash = row["naive"], row["flash"]
        lines.append(
            f"{row['s']:5d} {naive['loaded']:13,} {naive['stored']:10,} {naive['total']:10,} "
            f"{naive['scores']:9,} | {flash['loaded']:12,} {flash['stored']:7,} {flash['total']:9,} "
            f"{row['naive_over_flash']:10.2f}x | {row[large]['total']:10,}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "flash_traffic", run_flash_traffic, format_table)


if __name__ == "__main__":
    sys.exit(main())
