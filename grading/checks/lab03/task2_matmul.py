"""Lab 03 task 2: the tiled matmul kernel on shapes that are not multiples of the blocks, transposed
views, unequal block sizes, and the bytes its tile loads and stores move."""

from __future__ import annotations

import random

from grading.checks.common import reference
from grading.checks.triton_cases import compare_bounds, compare_traffic, compare_values, seeded_tensor
from grading.registry import Check, register

from .kernel_launch import TOLERANCES, driver


def _matmul_case(rng: random.Random, m: int, n: int, k: int, blocks=(32, 32, 32), layout: str = "contiguous") -> dict:
    return {"seed": rng.randrange(10**6), "m": m, "n": n, "k": k, "blocks": list(blocks), "layout": layout}


def _matmul_shapes(rng):
    return [
        _matmul_case(rng, 1, 1, 1, (16, 16, 16)),
        _matmul_case(rng, rng.randint(40, 70), rng.randint(20, 50), rng.randint(33, 90)),
        _matmul_case(rng, rng.randint(17, 31), rng.randint(9, 15), rng.randint(65, 80), (16, 16, 16)),
        _matmul_case(rng, 64, 32, 64),
    ]


def _matmul_strided(rng):
    return [
        _matmul_case(rng, rng.randint(33, 60), rng.randint(17, 40), rng.randint(20, 70), layout="transposed"),
        _matmul_case(rng, rng.randint(5, 15), rng.randint(40, 70), rng.randint(33, 50), (16, 32, 16), "transposed"),
    ]


def _matmul_block_shapes(rng):
    return [
        _matmul_case(rng, rng.randint(20, 40), rng.randint(50, 90), rng.randint(17, 40), (16, 64, 16)),
        _matmul_case(rng, rng.randint(50, 90), rng.randint(10, 30), rng.randint(20, 60), (64, 16, 32)),
    ]


def _matmul_edge_cases(rng):
    return [
        _matmul_case(rng, rng.randint(33, 50), rng.randint(17, 30), rng.randint(33, 60), layout="transposed"),
        _matmul_case(rng, rng.randint(3, 12), rng.randint(3, 12), rng.randint(3, 12), (16, 16, 16)),
    ]


def matmul_setup(case):
    """(out, grid, args, meta) of task 2's launch on the case."""
    import torch

    m, n, k = case["m"], case["n"], case["k"]
    bm, bn, bk = case["blocks"]
    a, b = seeded_tensor(case["seed"], m, k), seeded_tensor(case["seed"] + 1, k, n)
    if case["layout"] == "transposed":  # column-major A, B and C: strides (1, rows)
        a, b = a.t().contiguous().t(), b.t().contiguous().t()
        c = torch.full((n, m), -7.0, device=a.device).t()
    else:
        c = torch.full((m, n), -7.0, device=a.device)
    grid = (-(-m // bm), -(-n // bn))
    return (
        c,
        grid,
        (a, b, c, m, n, k, *a.stride(), *b.stride(), *c.stride()),
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
    )


def _describe_matmul(case) -> str:
    m, n, k = case["m"], case["n"], case["k"]
    bm, bn, bk = case["blocks"]
    layout = "A, B and C column-major (transposed strides)" if case["layout"] == "transposed" else "contiguous"
    return (
        f"A [{m}, {k}] @ B [{k}, {n}], {layout}, BLOCK_M={bm}, BLOCK_N={bn}, BLOCK_K={bk}, "
        f"grid ({-(-m // bm)}, {-(-n // bn)})"
    )


_MATMUL = reference("infra_lib.kernels.matmul", "matmul_kernel")
_MATMUL_HINT = (
    "each program owns one BLOCK_M × BLOCK_N tile of C, built up over the slices of K in a float32 "
    "accumulator that stays in registers until the one store (chapter 03, section “5 · Tiled matrix "
    "multiplication”)."
)


def matmul_values() -> dict:
    """The fields task 2's value checks share: the task, the reference, the driver and the comparison."""
    return {
        "task": "lab03 task 2: matmul_kernel",
        "reference": _MATMUL,
        "drive": driver("matmul_kernel", matmul_setup),
        "compare": compare_values("matmul_kernel", _describe_matmul, TOLERANCES["matmul_kernel"]),
    }


register(
    Check(
        check_id="lab03.matmul_odd_shapes",
        make_inputs=_matmul_shapes,
        hint=_MATMUL_HINT
        + " M, N and K are not multiples of the blocks: the edge tiles and the last step along K hang "
        "over A and B, and their outside lanes must contribute nothing to the product, while C's outside lanes must "
        "not "
        "be stored.",
        **matmul_values(),
    )
)

register(
    Check(
        check_id="lab03.matmul_strided",
        make_inputs=_matmul_strided,
        hint=_MATMUL_HINT + " Every address in A, B and C comes from the strides passed in, never from an assumed row "
        "length such as K or N: here A, B and C are transposed views.",
        **matmul_values(),
    )
)

register(
    Check(
        check_id="lab03.matmul_block_shapes",
        make_inputs=_matmul_block_shapes,
        hint=_MATMUL_HINT
        + " BLOCK_M and BLOCK_N differ here: a tile's rows belong with the first grid axis and BLOCK_M, "
        "its columns with the second and BLOCK_N, so a mix-up that square tiles hide shows up.",
        **matmul_values(),
    )
)

_MATMUL_EXCESS_HINTS = {
    argument: f"the loads of {matrix} read more of it than the product needs. {matrix}'s edge tiles reach {axis} "
    f"as well as past K, and those lanes only feed {feeds} of C that the store leaves out, so no value check sees "
    f"them; only the bytes do. Each tile load must stay inside {matrix} along both of its dimensions, and each part "
    "of a tile is read once per step along K (chapter 03, section “5 · Tiled matrix multiplication”)."
    for argument, matrix, axis, feeds in (
        ("a_ptr", "A", "rows past M (its first axis)", "rows"),
        ("b_ptr", "B", "columns past N (its second axis)", "columns"),
    )
}
_MATMUL_EXCESS_HINTS["c_ptr"] = (
    "each program stores its tile of C once, after the last step along K: the partial sums stay in the float32 "
    "accumulator, inside the program, from one step to the next, so C is neither written nor read back between "
    "steps (chapter 03, section “5 · Tiled matrix multiplication”)."
)

register(
    Check(
        check_id="lab03.matmul_in_bounds",
        task="lab03 task 2: matmul_kernel",
        reference=_MATMUL,
        make_inputs=_matmul_edge_cases,
        drive=driver("matmul_kernel", matmul_setup),
        compare=compare_bounds("matmul_kernel", _describe_matmul),
        hint="the tiles at the bottom and right edges, and the last step along K, hang over the matrices: each tile "
        "load "
        "needs a mask that keeps it inside its matrix along both of its dimensions, with a fill value that adds "
        "nothing "
        "to the product, and the store one that keeps it inside C. Here some matrices are smaller than one block, and "
        "some are transposed views (chapter 03, section “6 · Catching a missing mask”).",
    )
)

register(
    Check(
        check_id="lab03.matmul_traffic",
        task="lab03 task 2: matmul_kernel",
        reference=_MATMUL,
        make_inputs=_matmul_edge_cases,
        drive=driver("matmul_kernel", matmul_setup, count_traffic=True),
        compare=compare_traffic(
            "matmul_kernel",
            _describe_matmul,
            "each program reads only the parts of its tiles inside A and B",
            TOLERANCES["matmul_kernel"],
            excess_hints=_MATMUL_EXCESS_HINTS,
        ),
        hint="a lane that reads outside A or B costs memory traffic even when its product never reaches C: the tile "
        "loads must stay inside their matrices along every dimension, rows of A past M and columns of B past N "
        "included, not only along K. Budget: each program reads only the parts of its tiles inside A and B.",
    )
)
