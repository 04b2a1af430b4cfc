"""Lab 15 task 4 (bonus): the fused 4-bit GEMV kernel, on odd shapes with padded rows and its traffic
(only the packed bytes and scales cross memory)."""

from __future__ import annotations

import random

from grading.checks.common import reference
from grading.checks.lab15.kernel_checks import (
    LESSON,
    Failure,
    KernelSpec,
    as_values,
    compare_traffic,
    compare_values,
    draw_seed,
    gaps_hint,
    generator,
    launch,
    not_a_multiple,
    require_kernel,
    task_parts,
    to_device,
)
from grading.checks.triton_cases import UNWRITTEN
from grading.registry import Check, register

REFERENCE = reference("infra_lib.kernels.gemv_q4", "q4_gemv_kernel")


def _gemv_case(
    rng: random.Random,
    m: int,
    n: int,
    k: int,
    group: int,
    block_n: int,
    *,
    pad: int = 0,
    y_pad: int = 0,
    w_pad: int = 0,
) -> dict:
    """``pad``, ``y_pad``, ``w_pad``: elements past the end of each row of x, of y, and of packed and scales."""
    return {
        "seed": draw_seed(rng),
        "m": m,
        "n": n,
        "k": k,
        "group": group,
        "block_n": block_n,
        "pad": pad,
        "y_pad": y_pad,
        "w_pad": w_pad,
    }


def _gemv_odd_shapes(rng):
    return [
        _gemv_case(rng, 1, not_a_multiple(rng, 20, 50), 64, 32, 16),
        _gemv_case(
            rng, 3, not_a_multiple(rng, 40, 70, 32), 128, 32, 32, pad=rng.randint(1, 9), y_pad=rng.randint(1, 5)
        ),
        _gemv_case(rng, rng.randint(17, 20), 16, 128, 64, 16, y_pad=rng.randint(1, 5), w_pad=rng.randint(1, 7)),
    ]


def _gemv_traffic_cases(rng):
    return [
        _gemv_case(rng, 1, not_a_multiple(rng, 33, 64), 256, 32, 16),
        _gemv_case(rng, 1, 96, 576, 64, 32),
        _gemv_case(rng, 2, not_a_multiple(rng, 17, 31), 96, 32, 16),
    ]


def _gemv_tensors(case):
    """x [m, k] (rows padded by ``pad``), packed uint8 [n, k // 2] and scales [n, k // group] as
    ``QuantLinear(bits=4)`` stores a random weight (both with rows padded by ``w_pad``)."""
    import torch

    from infra_lib.model.quant import pack_int4, quantize_symmetric

    seeded = generator(case["seed"])
    m, n, k = case["m"], case["n"], case["k"]
    q, scales = quantize_symmetric(torch.randn(n, k, generator=seeded), 4, case["group"])
    x = torch.randn(m, k + case["pad"], generator=seeded)[:, :k]
    packed, padded_scales = (
        torch.nn.functional.pad(t, (0, case["w_pad"]))[:, : t.shape[1]] for t in (pack_int4(q), scales)
    )
    return x, packed, padded_scales, q


def _gemv_alternatives(case, x, q, scales) -> dict:
    """y for the usual misreadings of the storage, in float64: nibbles swapped within each byte, the
    +8 offset never taken off, one scale per row instead of per group."""
    import torch

    group = case["group"]
    stored = q.to(torch.int64) + 8  # the nibbles as stored, 0..15
    swapped = stored.reshape(q.shape[0], -1, 2).flip(-1).reshape(q.shape) - 8
    per_group = scales.double().repeat_interleave(group, 1)
    found = {
        "nibbles_swapped": swapped.double() * per_group,
        "no_offset": stored.double() * per_group,
        "first_scale_only": q.double() * scales.double()[:, :1],
    }
    truth = x.double() @ (q.double() * per_group).T
    return {
        name: (x.double() @ w.T).tolist()
        for name, w in found.items()
        if not torch.allclose(x.double() @ w.T, truth, atol=1e-4)
    }


def drive_gemv(kernel, cases):
    """Task 4's driver: each case's x against a random 4-bit weight, with the usual misreadings' outputs."""
    import torch

    require_kernel(kernel, "q4_gemv_kernel")
    results = []
    for case in cases:
        x, packed, scales, q = _gemv_tensors(case)
        alternatives = _gemv_alternatives(case, x, q, scales)
        x, packed, scales = to_device(x, packed, scales)
        y = torch.full((case["m"], case["n"] + case["y_pad"]), UNWRITTEN, device=x.device)[:, : case["n"]]
        grid = (-(-case["m"] // 16), -(-case["n"] // case["block_n"]))
        args = (
            x,
            packed,
            scales,
            y,
            case["m"],
            case["n"],
            case["k"],
            x.stride(0),
            packed.stride(0),
            scales.stride(0),
            y.stride(0),
        )
        meta = {"GROUP": case["group"], "BLOCK_M": 16, "BLOCK_N": case["block_n"]}
        result = launch(kernel, grid, args, meta, {"x_ptr": x, "packed_ptr": packed, "scales_ptr": scales})
        result.update(out=as_values(y), alternatives=alternatives)
        results.append(result)
    return results


def _describe_gemv(case) -> str:
    m, n, k = case["m"], case["n"], case["k"]
    strides = (
        f"row strides: x {k + case['pad']}, y {n + case['y_pad']}, packed {k // 2 + case['w_pad']}, "
        f"scales {k // case['group'] + case['w_pad']}"
    )
    return (
        f"x [{m}, {k}] @ W.T with W [{n}, {k}] in groups of {case['group']} ({strides}), "
        f"BLOCK_M=16, BLOCK_N={case['block_n']}, grid ({-(-m // 16)}, {-(-n // case['block_n'])})"
    )


_GEMV = f"{LESSON} “6 · A fused 4-bit GEMV”"
GEMV_NIBBLE_HINT = (
    "the two weights of a byte are swapped: byte j of a row holds weight 2j in its low four bits "
    f"(byte & 15) and weight 2j + 1 in its high four bits (byte >> 4) ({_GEMV})."
)
GEMV_OFFSET_HINT = (
    "each nibble stores q + 8, so that q in -8..7 fits 0..15: the weight is (nibble - 8) times its "
    f"group's scale ({_GEMV})."
)
GEMV_SCALE_HINT = (
    "every weight used the first scale of its row: a row has one scale per group of GROUP weights, "
    f"and weight k takes the scale of group k // GROUP ({_GEMV})."
)


GEMV_STRIDES_HINT = (
    "only a case with padded rows differs: x, y, the packed bytes and the scales each have a row "
    "stride of their own (stride_xm, stride_ym, stride_pn, stride_sn), longer than the row there. "
    f"Every address comes from them, never from K, N, K // 2 or K // GROUP ({_GEMV})."
)


def _diagnose_gemv(failure: Failure) -> str:
    for name, hint in (
        ("nibbles_swapped", GEMV_NIBBLE_HINT),
        ("no_offset", GEMV_OFFSET_HINT),
        ("first_scale_only", GEMV_SCALE_HINT),
    ):
        if failure.matches(name):
            return hint
    if failure.only_where(lambda c: c["pad"] or c["y_pad"] or c["w_pad"]):
        return GEMV_STRIDES_HINT
    return ""


def _gemv_access_hint(violation: dict) -> str:
    if violation["side"] == "between":
        return gaps_hint(violation["argument"], _GEMV)
    return (
        f"an access reached outside `{violation['argument']}`: the tiles at the edges hang over, rows of x and "
        f"y past M and columns of y (rows of W, of the packed bytes and of the scales) past N must be neither "
        f"read nor stored ({_GEMV})."
    )


_GEMV_KERNEL = KernelSpec("q4_gemv_kernel", (("out", "y_ptr"),), _describe_gemv, _gemv_access_hint, _diagnose_gemv)


register(
    Check(
        check_id="lab15.gemv_q4_odd_shapes",
        make_inputs=_gemv_odd_shapes,
        compare=compare_values(_GEMV_KERNEL),
        hint="each program owns a BLOCK_M x BLOCK_N tile of y and walks k one group at a time: the group's packed "
        "bytes "
        "of its BLOCK_N rows give two tiles of small integers (low and high nibbles, each less 8), each multiplied by "
        "the x columns it pairs with (even and odd k), and the group's scale multiplies the partial sum; accumulate in "
        "float32. Shapes here: a single row of x (a GEMV), N not a multiple of BLOCK_N, x with padded rows, groups of "
        f"32 and 64 ({_GEMV}).",
        **task_parts(4, REFERENCE, drive_gemv),
    )
)

register(
    Check(
        check_id="lab15.gemv_q4_reads_packed",
        make_inputs=_gemv_traffic_cases,
        compare=compare_traffic(
            _GEMV_KERNEL,
            "per program its BLOCK_N rows of packed bytes and scales once, its rows of x once; y stored once",
        ),
        hint="the point of the fused kernel is that only the stored bytes cross memory: half a byte per weight and its "
        "share of a scale, read once by each program, never a float copy of W. Budget: per program its BLOCK_N rows "
        f"of packed bytes and scales once, its rows of x once, and its tile of y stored once ({_GEMV}).",
        **task_parts(4, REFERENCE, drive_gemv),
    )
)
