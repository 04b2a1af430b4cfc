"""Bytes moved by paged decode attention in place against gather-then-attend, at several context lengths.

One decode step of a batch of sequences, with SmolLM2-135M's attention shape (9 query heads over
3 KV heads, head_dim 64, float32) and blocks of 16 slots scattered over the cache:

* in place: ``paged_decode_attention`` reads each K/V row through the block table, once per KV head;
* gathered: ``gather_then_attend`` copies each sequence's rows into consecutive blocks (torch
  indexing: its bytes are computed, every row and block id read once, every row written once),
  then runs the same kernel over the copy, which reads the rows again.

In Triton's interpreter the kernels' bytes are counted (``count_traffic``, active lanes only) and
checked against ``paged_decode_bytes``; compiled on a GPU only the formula is reported (measure
there with Nsight Compute). The ratio approaches 3 as the K/V rows dominate.

Usage:
    python benchmarks/paged_decode_traffic.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import sys

import torch
from benchmark_cli import benchmark_main

from infra_lib.hardware.probes import machine_info
from infra_lib.kernels.paged_decode import gather_then_attend, paged_decode_attention, paged_decode_bytes
from infra_lib.kernels.traffic import count_traffic
from infra_lib.kernels.triton_env import interpreter_active, kernel_device

SEED = 0
DTYPE = torch.float32
BATCH, N_HEADS, N_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 9, 3, 64, 16
CONTEXTS, QUICK_CONTEXTS = (64, 256, 1024), (16, 32)  # quick: 1 and 2 blocks a sequence


def decode_inputs(context_len: int, device: torch.device):
    """One decode step: BATCH sequences of ``context_len`` tokens, their blocks shuffled over the cache."""
    gen = torch.Generator().manual_seed(SEED)
    per_seq = -(-context_len // BLOCK_SIZE)
    num_blocks = BATCH * per_seq
    k_cache, v_cache = (
        torch.randn(num_blocks, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM, generator=gen).to(device, DTYPE) for _ in range(2)
    )
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(BATCH)]
    q = torch.randn(BATCH, N_HEADS, 1, HEAD_DIM, generator=gen).to(device, DTYPE)
    return q, k_cache, v_cache, tables, [context_len] * BATCH


def counted(run) -> tuple[torch.Tensor, int | None]:
    """``run()``'s result and the bytes its kernels moved (None when compiled: no counting on a GPU)."""
    if not interpreter_active():
        return run(), None
    with count_traffic() as traffic:
        out = run()
    return out, traffic.bytes_moved


def measure(context_len: int, device: torch.device) -> dict:
    q, k_cache, v_cache, tables, seq_lens = decode_inputs(context_len, device)
    element_size = q.element_size()
    shape = (seq_lens, N_HEADS, N_KV_HEADS, HEAD_DIM, BLOCK_SIZE, element_size)
    in_place, in_place_bytes = counted(lambda: paged_decode_attention(q, k_cache, v_cache, tables, seq_lens))
    baseline, attend_bytes = counted(lambda: gather_then_attend(q, k_cache, v_cache, tables, seq_lens))
    kv_rows = sum(seq_lens) * N_KV_HEADS * HEAD_DIM * 2 * element_size
    gather = 2 * kv_rows + sum(-(-s // BLOCK_SIZE) for s in seq_lens) * 4  # rows in and out, one block id per block
    formula, gathered = (sum(paged_decode_bytes(*shape, gathered=g).values()) for g in (False, True))
    return {
        "context_len": context_len,
        "batch": BATCH,
        "kv_row_bytes": kv_rows,
        "in_place": {"counted": in_place_bytes, "formula": formula},
        "gathered": {"counted_attend": attend_bytes, "gather": gather, "formula": gathered},
        "ratio": gathered / formula,
        "max_abs_difference": float((in_place.float() - baseline.float()).abs().max()),
    }


def run_traffic(device: torch.device, quick: bool) -> dict:
    """Count both paths at each context length; return the JSON-ready result."""
    torch.manual_seed(SEED)
    device = kernel_device()  # the kernels run where Triton runs: the GPU, else the CPU in the interpreter
    contexts = QUICK_CONTEXTS if quick else CONTEXTS
    return {
        "benchmark": "paged_decode_traffic",
        "machine_info": machine_info(device),
        "seed": SEED,
        "flags": {
            "quick": quick,
            "device": str(device),
            "interpreter": interpreter_active(),
            "dtype": str(DTYPE).replace("torch.", ""),
            "batch": BATCH,
            "n_heads": N_HEADS,
            "n_kv_heads": N_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "context_lens": list(contexts),
        },
        "results": [measure(n, device) for n in contexts],
    }


def format_table(result: dict) -> str:
    flags = result["flags"]
    lines = [
        f"decode step, batch {flags['batch']}, {flags['n_heads']} query / {flags['n_kv_heads']} KV heads, "
        f"head_dim {flags['head_dim']}, block_size {flags['block_size']}, {flags['dtype']}"
        + ("" if flags["interpreter"] else " (compiled: formula only, counts need the interpreter)"),
        f"{'context':>8} {'K/V rows':>12} {'in place':>12} {'gathered':>12} {'ratio':>6}",
    ]
    for row in result["results"]:
        lines.append(
            f"{row['context_len']:8d} {row['kv_row_bytes']:12,d} {row['in_place']['formula']:12,d} "
            f"{row['gathered']['formula']:12,d} {row['ratio']:6.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "paged_decode_traffic", run_traffic, format_table)


if __name__ == "__main__":
    sys.exit(main())
