"""Lab 03 task 1: the fused softmax kernel on odd shapes, extreme and -inf logits, strided rows with
watched gaps, and one read of each element."""

from __future__ import annotations

import random

from grading.checks.common import reference
from grading.checks.softmax_cases import describe_softmax, softmax_buffers, softmax_case
from grading.checks.triton_cases import compare_bounds, compare_traffic, compare_values, row_block, seeded_tensor
from grading.registry import Check, Mismatch, register

from .kernel_launch import TOLERANCES, driver


def _softmax_case(
    rng: random.Random, rows: int, cols: int, *, pad: int = 0, out_pad: int = 0, scale: float = 3.0, special: str = ""
) -> dict:
    return softmax_case(rng, rows, cols, pad=pad, out_pad=out_pad, scale=scale, special=special)


def _softmax_shapes(rng):
    return [
        _softmax_case(rng, 1, 1),
        _softmax_case(rng, 1, rng.randint(100, 300)),
        _softmax_case(rng, rng.randint(3, 9), 1),
        _softmax_case(rng, rng.randint(20, 40), rng.randint(129, 255)),
        _softmax_case(rng, rng.randint(5, 12), rng.randint(33, 63), pad=rng.randint(1, 40), out_pad=rng.randint(1, 9)),
    ]


def _softmax_extremes(rng):
    return [
        _softmax_case(rng, 8, rng.randint(40, 120), scale=1e4),
        _softmax_case(rng, 6, rng.randint(20, 60), special="huge"),
        _softmax_case(rng, 7, rng.randint(20, 60), special="-inf"),
        _softmax_case(rng, 4, rng.randint(20, 60), scale=100.0, special="one finite"),
    ]


def _softmax_bounds_cases(rng):
    return [
        _softmax_case(rng, rng.randint(3, 8), rng.randint(17, 63), pad=rng.randint(3, 20)),
        _softmax_case(rng, rng.randint(2, 5), rng.randint(129, 200), out_pad=rng.randint(1, 9)),
    ]


def _softmax_traffic_cases(rng):
    return [_softmax_case(rng, rng.randint(16, 40), rng.randint(100, 300)), _softmax_case(rng, 3, 1)]


def softmax_setup(case):
    """(out, grid, args, meta) of task 1's launch on the case."""
    import torch

    rows, cols, special = case["rows"], case["cols"], case["special"]
    x = seeded_tensor(case["seed"], rows, cols, scale=case["scale"])
    if special == "huge":  # every logit near 1e4: exp overflows without the max subtraction
        x = x / case["scale"] * 0.5 + 1e4
    elif special in ("-inf", "one finite"):
        generator = torch.Generator().manual_seed(case["seed"] + 1)
        hide = (
            torch.rand(rows, cols, generator=generator) < 0.6
            if special == "-inf"
            else torch.ones(rows, cols, dtype=torch.bool)
        )
        hide[torch.arange(rows), torch.randint(0, cols, (rows,), generator=generator)] = False  # one finite per row
        x = x.masked_fill(hide.to(x.device), float("-inf"))
    x, out = softmax_buffers(x, case)
    return out, (rows,), (out, x, cols, x.stride(0), out.stride(0)), {"BLOCK": row_block(cols)}


_SPECIALS = {
    "huge": ", every logit near 1e4",
    "-inf": ", many logits -inf",
    "one finite": ", all but one logit per row -inf",
}


def _describe_softmax(case) -> str:
    return describe_softmax(case, _SPECIALS)


_SOFTMAX = reference("infra_lib.kernels.softmax", "softmax_kernel")
_SOFTMAX_HINT = (
    "one program owns one row, and each row starts one row stride after the previous one, with separate "
    "strides for the input and the output that may exceed n_cols; lanes past n_cols must be switched off "
    "and must load a value that changes neither the row's max nor its sum. Shapes here: [1, 1], one row, "
    "one column, widths that are not a power of two, strided rows (chapter 03, section “4 · Fused "
    "softmax: the same maths, half the bytes”)."
)

# the hint of a NaN or inf where the reference is finite (tests hold a softmax without the max to it)
SOFTMAX_NAN_HINT = (
    "a NaN or inf where every probability is finite comes from the exponential: without each row "
    "shifted by its own maximum first, exp overflows float32 above about 88 and inf / inf is NaN; "
    "a padded lane that loads a value which changes the row's max or sum spoils the row the same "
    "way (chapter 03, section “4 · Fused softmax: the same maths, half the bytes”)."
)

register(
    Check(
        check_id="lab03.softmax_odd_shapes",
        task="lab03 task 1: softmax_kernel",
        reference=_SOFTMAX,
        make_inputs=_softmax_shapes,
        drive=driver("softmax_kernel", softmax_setup),
        compare=compare_values("softmax_kernel", _describe_softmax, TOLERANCES["softmax_kernel"], SOFTMAX_NAN_HINT),
        hint=_SOFTMAX_HINT,
    )
)

_MINUS_INF_HINT = (
    "a -inf logit is a key that must not be attended at all: exp of -inf after the shift is exactly 0, "
    "and that 0 must reach the output unchanged; a floor or a small constant added to the probabilities "
    "gives such a key a weight after all (chapter 03, section “4 · Fused softmax: the same maths, half "
    "the bytes”)."
)


def _compare_softmax_extremes(got, expected, cases) -> Mismatch | None:
    """Values as every softmax check compares them; then, in the rows with -inf logits, a probability of
    exactly 0 for each of them (the reference's zeros there are the -inf positions: the finite logits of
    those cases are too close together to underflow)."""
    import numpy as np

    problem = compare_values("softmax_kernel", _describe_softmax, TOLERANCES["softmax_kernel"], SOFTMAX_NAN_HINT)(
        got, expected, cases
    )
    if problem:
        return problem
    for case, g, e in zip(cases, got, expected):
        if case["special"] not in ("-inf", "one finite"):
            continue
        mine, want = np.asarray(g["out"], dtype=np.float64), np.asarray(e["out"], dtype=np.float64)
        leaked = (want == 0) & (mine != 0)
        if leaked.any():
            index = tuple(int(i) for i in np.argwhere(leaked)[0])
            return Mismatch(
                "softmax_kernel gave a -inf logit a probability other than exactly 0",
                f"on {_describe_softmax(case)}: {int(leaked.sum())} of {int((want == 0).sum())} -inf "
                f"logits; at index {list(index)} expected 0, got {mine[index]:.3g}",
                hint=_MINUS_INF_HINT,
            )
    return None


register(
    Check(
        check_id="lab03.softmax_extreme_values",
        task="lab03 task 1: softmax_kernel",
        reference=_SOFTMAX,
        make_inputs=_softmax_extremes,
        drive=driver("softmax_kernel", softmax_setup),
        compare=_compare_softmax_extremes,
        hint="exp overflows float32 for any logit above about 88 (and inf / inf is NaN), so each row must be "
        "shifted by "
        "its own true maximum before the exponential; a padded lane must never become that maximum. -inf logits must "
        "come out as probability 0, even in a row where only one logit is finite. Cases: logits of scale 1e4, every "
        "logit near 1e4, many -inf logits, all but one logit per row -inf.",
    )
)

register(
    Check(
        check_id="lab03.softmax_in_bounds",
        task="lab03 task 1: softmax_kernel",
        reference=_SOFTMAX,
        make_inputs=_softmax_bounds_cases,
        drive=driver("softmax_kernel", softmax_setup),
        compare=compare_bounds("softmax_kernel", _describe_softmax),
        hint="BLOCK is n_cols rounded up to a power of two, so the last lanes of every row lie past its end, in the "
        "gap "
        "before the next row or past the tensor: the load and the store both need a mask that switches those lanes "
        "off. "
        "Here the rows of x or out are strided, with gaps that the checker watches (chapter 03, section “6 · "
        "Catching a "
        "missing mask”).",
    )
)

register(
    Check(
        check_id="lab03.softmax_reads_once",
        task="lab03 task 1: softmax_kernel",
        reference=_SOFTMAX,
        make_inputs=_softmax_traffic_cases,
        drive=driver("softmax_kernel", softmax_setup, count_traffic=True),
        compare=compare_traffic(
            "softmax_kernel",
            _describe_softmax,
            "each element of x read once, each element of out written once",
            TOLERANCES["softmax_kernel"],
            nan_hint=SOFTMAX_NAN_HINT,
        ),
        hint="the fused kernel's promise is one trip to memory per element: once loaded, the row stays in registers "
        "until the result is stored, and nothing in between is written out or read again. Lanes past n_cols count as "
        "traffic too unless masked off. Budget: each element of x read once, each element of out written once "
        "(chapter 03, section “4 · Fused softmax: the same maths, half the bytes”).",
    )
)
