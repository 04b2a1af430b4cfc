"""The compiled-Triton steps of ``python -m course_tools.gpu.check``: every kernel of the course against its reference.

On a CPU the tests run these kernels in Triton's interpreter; here each is compiled for the GPU
(the matmul autotuned by Triton's autotuner; FlashAttention's and the 4-bit GEMV's tiles tuned by
``sweep_tiles``), run twice (the first call pays for the compile) and compared, case by case, with
PyTorch. Most shapes leave a ragged last tile, so the masks are exercised too.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from course_tools.gpu.steps import (
    SEED,
    StepFailed,
    StepSkipped,
    check_case,
    compiled_triton,
    randn,
    require_cases_close,
)


def _bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median")


def sweep_tiles(
    facts: dict, label: str, configs: list[dict], run, want: torch.Tensor, tol: float, bench=_bench_ms
) -> dict:
    """Tune a kernel's tiles by measurement: each config (keyword arguments of ``run``) is checked
    against ``want`` like any case, then timed (``bench``: median milliseconds over repeated calls);
    the fastest config that is right is kept.

    Records ``facts["tile_sweep"][label]`` = ``{"ms": {config: ms}, "best": config}`` and returns
    the best config's keyword arguments. A config outside the tolerance is a failed case (and the
    step fails on it in ``require_cases_close``), never a candidate.
    """
    timed: dict[str, float] = {}
    by_name: dict[str, dict] = {}
    for config in configs:
        name = f"{label}.tiles(" + ",".join(f"{k}={v}" for k, v in config.items()) + ")"
        check_case(facts, name, lambda: run(**config), want, tol)
        if facts["cases"][name]["ok"]:
            timed[name] = round(float(bench(lambda: run(**config))), 4)
            by_name[name] = config
    best = min(timed, key=timed.get) if timed else None
    facts.setdefault("tile_sweep", {})[label] = {"ms": timed, "best": best}
    return by_name.get(best, {})


def vector_add_step(facts: dict, quick: bool) -> None:
    device = compiled_triton(facts)
    from infra_lib.kernels.vector_add import add

    n = 100_003 if quick else 1_000_003  # not a multiple of the block: the last one is masked
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 1e-3)):
        x, y = randn(n, device=device, dtype=dtype), randn(n, device=device, dtype=dtype, seed=1)
        check_case(facts, f"{n}.{str(dtype)[6:]}", lambda: add(x, y), x + y, tol)
    require_cases_close(facts)


def softmax_step(facts: dict, quick: bool) -> None:
    device = compiled_triton(facts)
    from infra_lib.kernels.softmax import softmax, softmax_three_pass

    shapes = [(128, 1000)] + ([] if quick else [(64, 4096)])
    for rows, cols in shapes:
        x = randn(rows, cols, device=device) * 4
        want = torch.softmax(x, dim=-1)
        check_case(facts, f"fused.{rows}x{cols}.float32", lambda: softmax(x), want, 1e-5)
        check_case(facts, f"three_pass.{rows}x{cols}.float32", lambda: softmax_three_pass(x), want, 1e-5)
        narrow = x.bfloat16()
        check_case(
            facts, f"fused.{rows}x{cols}.bfloat16", lambda: softmax(narrow), torch.softmax(narrow.float(), -1), 2e-2
        )
    require_cases_close(facts)


def matmul_step(facts: dict, quick: bool) -> None:
    device = compiled_triton(facts)
    from infra_lib.kernels import matmul as module

    m, n, k = (300, 260, 200) if quick else (777, 1000, 520)  # no dimension a multiple of a tile
    tol = 4e-3 * math.sqrt(k)  # tl.dot rounds float32 inputs to tf32: errors grow like sqrt(k)
    a, b = randn(m, k, device=device), randn(k, n, device=device, seed=1)
    want = (a.double() @ b.double()).float()
    facts["autotuned"] = module.matmul_kernel_autotuned is not None
    facts["configs"] = len(getattr(module.matmul_kernel_autotuned, "configs", ()))
    check_case(facts, "autotuned.float32", lambda: module.matmul(a, b), want, tol)
    facts["best_config"] = str(getattr(module.matmul_kernel_autotuned, "best_config", None))
    check_case(
        facts, "blocks_64x64x32.float32", lambda: module.matmul(a, b, block_m=64, block_n=64, block_k=32), want, tol
    )
    a16, b16 = a.half(), b.T.contiguous().half().T  # b column-major: strides, not a copy, reach the kernel
    check_case(
        facts,
        "autotuned.float16.b_transposed",
        lambda: module.matmul(a16, b16),
        (a16.double() @ b16.double()).float(),
        tol,
    )
    if facts["best_config"] == "None":
        raise StepFailed("the autotuned matmul ran but its autotuner recorded no best config")
    require_cases_close(facts)


def rmsnorm_step(facts: dict, quick: bool) -> None:
    device = compiled_triton(facts)
    from infra_lib.kernels.rmsnorm import rmsnorm
    from infra_lib.model.model import RMSNorm

    rows, cols = (16, 576) if quick else (256, 576)  # SmolLM2's width: not a power of two
    reference = RMSNorm(cols, 1e-5).to(device)
    with torch.no_grad():
        reference.weight.copy_(randn(cols, device=device, seed=1))
    x = randn(rows, cols, device=device)
    with torch.no_grad():
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            xd, wd = x.to(dtype), reference.weight.to(dtype)
            check_case(
                facts, f"{rows}x{cols}.{str(dtype)[6:]}", lambda: rmsnorm(xd, wd, 1e-5), reference(xd.float()), tol
            )
    require_cases_close(facts)


def flash_attention_step(facts: dict, quick: bool) -> None:
    device = compiled_triton(facts)
    from infra_lib.kernels.flash_attention import attention_reference, flash_attention, naive_attention

    t = 40 if quick else 300  # SmolLM2's heads: 9 query heads over 3 KV heads, head_dim 64
    q, k, v = (randn(2, heads, t, 64, device=device, seed=s) for s, heads in ((0, 9), (1, 3), (2, 3)))
    tol = 2e-2  # tl.dot rounds float32 inputs to tf32
    for name, causal, q_used, dtype in (
        ("prefill.causal", True, q, torch.float32),
        ("full", False, q, torch.float32),
        ("decode", True, q[:, :, -1:], torch.float32),
        ("prefill.causal.bfloat16", True, q, torch.bfloat16),
    ):
        qd, kd, vd = (x.to(dtype) for x in (q_used, k, v))
        want_out, want_lse = attention_reference(qd.float(), kd.float(), vd.float(), causal=causal)
        case_tol = tol if dtype == torch.float32 else 5e-2
        check_case(facts, f"{name}.out", lambda: flash_attention(qd, kd, vd, causal=causal)[0], want_out, case_tol)
        check_case(facts, f"{name}.lse", lambda: flash_attention(qd, kd, vd, causal=causal)[1], want_lse, case_tol)
    want = attention_reference(q, k, v, causal=True)[0]
    check_case(facts, "naive_three_kernels.causal", lambda: naive_attention(q, k, v, causal=True), want, tol)
    tiles = [{"block_m": m, "block_n": n} for m, n in ((16, 16), (32, 32), (64, 32), (64, 64), (128, 32), (128, 64))]
    sweep_tiles(
        facts,
        "prefill.causal",
        tiles if not quick else tiles[:3],
        lambda **t: flash_attention(q, k, v, causal=True, **t)[0],
        want,
        tol,
    )
    require_cases_close(facts)


def paged_decode_step(facts: dict, quick: bool) -> None:
    device = compiled_triton(facts)
    from infra_lib.kernels.paged_decode import paged_decode_attention
    from infra_lib.serving.paged_attention import paged_attention

    lengths = [1, 5, 16, 17, 0, 40] if quick else [1, 5, 16, 17, 0, 40, 333, 1000]
    block_size, n_kv_heads, group, head_dim = 16, 3, 3, 64
    needed = [-(-s // block_size) for s in lengths]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(SEED)).tolist()  # scattered blocks
    tables = [order[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(lengths))]
    k_cache, v_cache = (randn(num_blocks, block_size, n_kv_heads, head_dim, device=device, seed=s) for s in (1, 2))
    q = randn(len(lengths), n_kv_heads * group, 1, head_dim, device=device, seed=3)
    keep = [i for i, s in enumerate(lengths) if s]  # an empty context's output is zeros
    want = torch.zeros_like(q)
    want[keep] = paged_attention(q[keep], k_cache, v_cache, [tables[i] for i in keep], [lengths[i] for i in keep])
    facts["seq_lens"] = lengths
    for split_k in (None, 4):
        check_case(
            facts,
            f"split_k={split_k or 1}.float32",
            lambda: paged_decode_attention(q, k_cache, v_cache, tables, lengths, split_k=split_k),
            want,
            1e-4,
        )
    check_case(
        facts,
        "split_k=1.float16",
        lambda: paged_decode_attention(q.half(), k_cache.half(), v_cache.half(), tables, lengths),
        want,
        1e-2,
    )
    require_cases_close(facts)


def gemv_q4_step(facts: dict, quick: bool) -> None:
    if importlib.util.find_spec("infra_lib.kernels.gemv_q4") is None:
        raise StepSkipped("infra_lib/kernels/gemv_q4.py is not there yet")
    device = compiled_triton(facts)
    from infra_lib.kernels.gemv_q4 import q4_1_matmul, q4_matmul
    from infra_lib.model.quant import Q4_1Linear, QuantLinear

    n, k = (256, 576) if quick else (1536, 576)
    layer = QuantLinear(randn(n, k, device=device), randn(n, device=device, seed=1), bits=4, group_size=64)
    gen = torch.Generator().manual_seed(SEED)
    blocks = k // Q4_1Linear.BLOCK
    q4_1 = Q4_1Linear(
        torch.rand(n, blocks, generator=gen) / 8,
        -torch.rand(n, blocks, generator=gen),
        torch.randint(0, 256, (n, blocks, Q4_1Linear.BLOCK // 2), generator=gen, dtype=torch.uint8),
    )
    q4_1 = q4_1.to(device)
    with torch.no_grad():
        for rows in (1, 5):  # a GEMV, and a few decodes at once
            x = randn(rows, k, device=device, seed=2)
            check_case(
                facts,
                f"q4_symmetric.m={rows}",
                lambda: q4_matmul(x, layer.qweight, layer.scales, layer.group_size, layer.bias),
                layer(x),
                1e-3,
            )
            check_case(facts, f"q4_1_gguf.m={rows}", lambda: q4_1_matmul(x, q4_1.d, q4_1.m, q4_1.qs), q4_1(x), 1e-3)
        x = randn(1, k, device=device, seed=2)
        tiles = [{"block_n": n, "k_groups": g} for n in (32, 64, 128, 256) for g in (2, 8)]
        sweep_tiles(
            facts,
            "q4_symmetric.m=1",
            tiles if not quick else tiles[::3],
            lambda **t: q4_matmul(x, layer.qweight, layer.scales, layer.group_size, layer.bias, **t),
            layer(x),
            1e-3,
        )
        sweep_tiles(
            facts,
            "q4_1_gguf.m=1",
            tiles if not quick else tiles[::3],
            lambda **t: q4_1_matmul(x, q4_1.d, q4_1.m, q4_1.qs, **t),
            q4_1(x),
            1e-3,
        )
    require_cases_close(facts)
