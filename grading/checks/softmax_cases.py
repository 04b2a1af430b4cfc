"""The row-softmax kernels' cases, shared by lab 03's fused softmax and lab 15's online softmax: a
seeded [rows, cols] input whose rows may be strided, the input and output laid out as the case
says, and the case in words."""

from __future__ import annotations

import random

from grading.checks.triton_cases import empty_rows, row_block, with_row_gaps


def softmax_case(
    rng: random.Random,
    rows: int,
    cols: int,
    *,
    block: int | None = None,
    pad: int = 0,
    out_pad: int = 0,
    scale: float | None = None,
    special: str = "",
) -> dict:
    """One case: ``pad`` and ``out_pad`` are the elements past each row of x and of out (its row strides
    cols + pad and cols + out_pad); ``block`` the BLOCK launched (None: cols rounded up to a power of
    two); ``scale`` the logits' scale, where the lab draws it; ``special`` the lab's name for extreme values."""
    case = {"seed": rng.randrange(10**6), "rows": rows, "cols": cols}
    if block is not None:
        case["block"] = block
    case.update(pad=pad, out_pad=out_pad)
    if scale is not None:
        case["scale"] = scale
    case["special"] = special
    return case


def softmax_block(case: dict) -> int:
    """The BLOCK the case is launched with."""
    return case.get("block") or row_block(case["cols"])


def softmax_buffers(x, case: dict):
    """(x, out) as the case lays them out: ``x`` [rows, cols] copied into rows with the case's gaps, and
    ``out`` with its own row stride, every element unwritten."""
    x = with_row_gaps(x, case["pad"])
    return x, empty_rows(x, case["cols"], case["out_pad"])


def describe_softmax(case: dict, specials: dict[str, str]) -> str:
    """The case in words; ``specials`` gives the words for each of the lab's extreme inputs."""
    extra = specials.get(case["special"], "")
    if not extra and case.get("scale", 0) >= 100:
        extra = f", logits of scale {case['scale']:g}"
    return (
        f"x of shape [{case['rows']}, {case['cols']}] (in_row_stride {case['cols'] + case['pad']}, out_row_stride "
        f"{case['cols'] + case['out_pad']}){extra}, grid ({case['rows']},), BLOCK={softmax_block(case)}"
    )
