"""Lab 03 task 3: the RMSNorm kernel on odd shapes, separate row strides and a large eps, and the
bytes it reads of a row and of the weights."""

from __future__ import annotations

import random

from grading.checks.common import reference
from grading.checks.triton_cases import (
    compare_traffic,
    compare_values,
    empty_rows,
    row_block,
    seeded_tensor,
    with_row_gaps,
)
from grading.registry import Check, register

from .kernel_launch import TOLERANCES, driver


def _rmsnorm_case(
    rng: random.Random, rows: int, cols: int, *, pad: int = 0, out_pad: int = 0, eps: float = 1e-5
) -> dict:
    return {
        "seed": rng.randrange(10**6),
        "rows": rows,
        "cols": cols,
        "pad": pad,
        "out_pad": out_pad,
        "eps": eps,
        "scale": rng.choice([0.01, 1.0, 30.0]),
    }


def _rmsnorm_shapes(rng):
    return [
        _rmsnorm_case(rng, 1, 1),
        _rmsnorm_case(rng, rng.randint(2, 6), 576, eps=1e-6),
        # x and out padded differently, so that using one's row stride for the other shows
        _rmsnorm_case(rng, rng.randint(10, 30), rng.randint(33, 200), pad=rng.randint(4, 20), out_pad=3),
        _rmsnorm_case(rng, rng.randint(3, 8), rng.randint(5, 30), eps=0.5),
    ]


def _rmsnorm_bounds_cases(rng):
    return [
        _rmsnorm_case(rng, rng.randint(3, 8), rng.randint(17, 100), pad=rng.randint(3, 20)),
        _rmsnorm_case(rng, 2, rng.randint(129, 200), out_pad=5),
    ]


def rmsnorm_setup(case):
    """(out, grid, args, meta) of task 3's launch on the case."""
    rows, cols = case["rows"], case["cols"]
    x = with_row_gaps(seeded_tensor(case["seed"], rows, cols, scale=case["scale"]), case["pad"])
    w = seeded_tensor(case["seed"] + 1, cols)
    out = empty_rows(x, cols, case["out_pad"])
    return out, (rows,), (out, x, w, cols, x.stride(0), out.stride(0), case["eps"]), {"BLOCK": row_block(cols)}


def _describe_rmsnorm(case) -> str:
    return (
        f"x of shape [{case['rows']}, {case['cols']}] (x_row_stride {case['cols'] + case['pad']}, out_row_stride "
        f"{case['cols'] + case['out_pad']}), values of scale {case['scale']:g}, eps={case['eps']:g}, "
        f"grid ({case['rows']},), BLOCK={row_block(case['cols'])}"
    )


_RMSNORM = reference("infra_lib.kernels.rmsnorm", "rmsnorm_kernel")

register(
    Check(
        check_id="lab03.rmsnorm_odd_shapes",
        task="lab03 task 3: rmsnorm_kernel",
        reference=_RMSNORM,
        make_inputs=_rmsnorm_shapes,
        drive=driver("rmsnorm_kernel", rmsnorm_setup),
        compare=compare_values("rmsnorm_kernel", _describe_rmsnorm, TOLERANCES["rmsnorm_kernel"]),
        hint="the mean square is over the n_cols real elements only: padded lanes must add nothing to the sum of "
        "squares, and the divisor is n_cols, not BLOCK. eps belongs inside the square root, added to the mean square "
        "(it reaches 0.5 here, so its place shows), and each row of x and of out starts at its own row stride "
        "(chapter 03, section “Lab 03: what you will write”).",
    )
)

# the hint for each argument an RMSNorm kernel reads more of than it needs (tests hold the failures to them)
RMSNORM_EXCESS_HINTS = {
    "w_ptr": "the weight vector has n_cols elements, like a row: the lanes of its load past n_cols must be switched "
    "off even though their products are never stored (no value check sees them, only the bytes do), and each "
    "program reads the weights once.",
    "x_ptr": "each program reads its row of x once, with the lanes past n_cols switched off: the row stays in "
    "registers from the mean square to the scaling instead of being loaded again.",
}

register(
    Check(
        check_id="lab03.rmsnorm_in_bounds",
        task="lab03 task 3: rmsnorm_kernel",
        reference=_RMSNORM,
        make_inputs=_rmsnorm_bounds_cases,
        drive=driver("rmsnorm_kernel", rmsnorm_setup, count_traffic=True),
        compare=compare_traffic(
            "rmsnorm_kernel",
            _describe_rmsnorm,
            "each program reads its row of x and the n_cols weights once",
            TOLERANCES["rmsnorm_kernel"],
            excess_hints=RMSNORM_EXCESS_HINTS,
        ),
        hint="the weight vector has only n_cols elements, like a row, so its load overruns just as the row's does: the "
        "row of x, the weights and the store all need their lanes past n_cols switched off. A lane past n_cols must "
        "not "
        "be read even when its result is never stored; here rows are strided, with gaps that the checker watches. "
        "Budget: each program reads its row of x and the n_cols weights once.",
    )
)
