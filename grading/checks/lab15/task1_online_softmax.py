"""Lab 15 task 1: the online softmax kernel, on long rows walked block by block, extreme logits, and
its traffic (two reads of the row, one write)."""

from __future__ import annotations

import random

from grading.checks.common import reference
from grading.checks.lab15.kernel_checks import (
    LESSON,
    RTOL,
    Failure,
    KernelSpec,
    as_values,
    compare_traffic,
    compare_values,
    generator,
    launch,
    require_kernel,
    task_parts,
    to_device,
)
from grading.checks.softmax_cases import describe_softmax, softmax_buffers, softmax_case
from grading.registry import Check, register

REFERENCE = reference("infra_lib.kernels.softmax", "online_softmax_kernel")


def _softmax_case(
    rng: random.Random, rows: int, cols: int, block: int, *, pad: int = 0, out_pad: int = 0, special: str = ""
) -> dict:
    return softmax_case(rng, rows, cols, block=block, pad=pad, out_pad=out_pad, special=special)


def _softmax_long_rows(rng):
    return [
        _softmax_case(rng, 1, 1, 16),
        _softmax_case(rng, 3, rng.randint(100, 300), 32, special="rising"),
        _softmax_case(
            rng, rng.randint(5, 12), rng.randint(40, 63), 16, pad=rng.randint(1, 40), out_pad=rng.randint(1, 9)
        ),
        _softmax_case(rng, 4, 64, 16),
        _softmax_case(rng, 2, rng.randint(5, 15), 16),
        _softmax_case(rng, rng.randint(2, 6), rng.randint(70, 120), 16),
    ]


def _softmax_extremes(rng):
    return [
        _softmax_case(rng, 4, rng.randint(40, 120), 16, special="scale 1e4"),
        _softmax_case(rng, 3, rng.randint(33, 63), 16, special="huge"),
        _softmax_case(rng, 3, rng.randint(33, 63), 16, special="negative"),
        _softmax_case(rng, 4, rng.randint(50, 90), 16, special="-inf blocks"),
        _softmax_case(rng, 3, rng.randint(20, 60), 16, special="one finite"),
    ]


def _softmax_traffic_cases(rng):
    return [
        _softmax_case(rng, rng.randint(8, 20), rng.randint(100, 300), 32),
        _softmax_case(rng, 3, 1, 16),
        _softmax_case(rng, 2, 64, 16),
    ]


def logits(case):
    """The case's float32 logits [rows, cols] (before any row padding)."""
    import torch

    rows, cols, special = case["rows"], case["cols"], case["special"]
    seeded = generator(case["seed"])
    x = torch.randn(rows, cols, generator=seeded) * 3
    if special == "rising":  # the row's max grows block after block
        x = x + torch.arange(cols) * 0.2
    elif special == "scale 1e4":
        x = x * 3e3
    elif special in ("huge", "negative"):  # every logit near +1e4 (or -1e4)
        x = x * 0.2 + (1e4 if special == "huge" else -1e4)
    elif special == "-inf blocks":  # each row starts with one to three whole blocks of -inf
        for r in range(rows):
            x[r, : case["block"] * (1 + r % 3)] = float("-inf")
        x = x.masked_fill(torch.rand(rows, cols, generator=seeded) < 0.3, float("-inf"))
        x[:, -1] = 1.0  # at least one finite logit per row
    elif special == "one finite":
        keep = torch.randint(0, cols, (rows,), generator=seeded)
        hidden = torch.ones(rows, cols, dtype=torch.bool)
        hidden[torch.arange(rows), keep] = False
        x = (x * 30).masked_fill(hidden, float("-inf"))
    return x


def _sum_not_rescaled(x, block: int):
    """What a softmax gives whose running sum is never rescaled when the max grows (float64)."""
    import torch

    x = x.double()
    block_max = torch.stack([x[:, i : i + block].amax(1) for i in range(0, x.shape[1], block)], 1)
    running = torch.cummax(block_max, 1).values.repeat_interleave(block, 1)[:, : x.shape[1]]
    weights = torch.where(x == float("-inf"), 0.0, torch.exp(x - running))
    return torch.exp(x - running[:, -1:]) / weights.sum(1, keepdim=True)


def drive_softmax(kernel, cases):
    """Task 1's driver: each case's rows launched one program each, with the case's BLOCK."""
    import torch

    require_kernel(kernel, "online_softmax_kernel")
    results = []
    for case in cases:
        x_cpu = logits(case)
        x, out = softmax_buffers(*to_device(x_cpu), case)
        result = launch(
            kernel,
            (case["rows"],),
            (out, x, case["cols"], x.stride(0), out.stride(0)),
            {"BLOCK": case["block"]},
            {"in_ptr": x},
        )
        result["out"] = as_values(out)
        alternative = _sum_not_rescaled(x_cpu, case["block"])
        if not torch.allclose(alternative, torch.softmax(x_cpu.double(), 1), atol=1e-4):
            result["alternatives"] = {"sum_not_rescaled": alternative.tolist()}
        results.append(result)
    return results


_SPECIALS = {
    "rising": ", logits that grow along the row",
    "scale 1e4": ", logits of scale 1e4",
    "huge": ", every logit near +1e4",
    "negative": ", every logit near -1e4",
    "-inf blocks": ", rows that begin with whole blocks of -inf",
    "one finite": ", all but one logit per row -inf",
}


def _describe_softmax(case) -> str:
    return describe_softmax(case, _SPECIALS)


_ONLINE = f"{LESSON} “2 · Online softmax”"
SOFTMAX_RESCALE_HINT = (
    "the running sum was added to under an old maximum: when a block raises the running max, "
    "every exp already summed was taken against the smaller max and must shrink by "
    f"exp(old max - new max) before the block's own terms join it ({_ONLINE})."
)
SOFTMAX_MASK_HINT = (
    "a lane past n_cols took part in the maximum: with every logit near -1e4, a padded lane that "
    "loads 0 (or is masked only after the max) becomes the row's max, and every real exp then "
    "underflows to 0. Lanes past the row must be out of the max, the sum and the store alike "
    f"({_ONLINE})."
)
SOFTMAX_SHIFT_HINT = (
    "exp overflows float32 above about 88: every exponential must be taken against the running "
    f"maximum, never of a raw logit, so logits near +1e4 stay finite ({_ONLINE})."
)
SOFTMAX_EMPTY_BLOCK_HINT = (
    "a row may begin with whole blocks of -inf: while the running max is still -inf, "
    "exp(-inf - (-inf)) is NaN. Until a finite logit has been seen there is nothing to "
    f"rescale and nothing to add, and a -inf logit's probability is exactly 0 ({_ONLINE})."
)
SOFTMAX_LAST_BLOCK_HINT = (
    "only the last block of a row is wrong: it is partial (n_cols is not a multiple of BLOCK), "
    "and both walks must visit it, with its lanes past n_cols switched off "
    f"({_ONLINE})."
)


def _diagnose_softmax(failure: Failure) -> str:
    import numpy as np

    case = failure.case
    if failure.matches("sum_not_rescaled"):
        return SOFTMAX_RESCALE_HINT
    if failure.non_finite():
        return {
            "negative": SOFTMAX_MASK_HINT,
            "-inf blocks": SOFTMAX_EMPTY_BLOCK_HINT,
            "one finite": SOFTMAX_EMPTY_BLOCK_HINT,
        }.get(case["special"], SOFTMAX_SHIFT_HINT)
    wrong = ~np.isclose(
        np.asarray(failure.got["out"], dtype=np.float64),
        np.asarray(failure.expected["out"], dtype=np.float64),
        atol=failure.atol,
        rtol=RTOL,
    )
    full_blocks = case["cols"] - case["cols"] % case["block"]
    if full_blocks < case["cols"] and wrong.any() and not wrong[:, :full_blocks].any():
        return SOFTMAX_LAST_BLOCK_HINT
    return ""


def _softmax_access_hint(violation: dict) -> str:
    if violation["kind"] == "store":
        return (
            "a store reached past a row: the last block of a row is partial, and its lanes at n_cols and beyond "
            "lie in the gap before the next row or past the tensor; they must not be written. Rows start one "
            f"row stride apart, the input's and the output's each its own ({_ONLINE})."
        )
    return (
        "a load reached past a row, and its value reached the output: the last block of a row is partial, and "
        "its lanes at n_cols and beyond must not be read; the value they get instead must change neither the "
        f"row's max nor its sum ({_ONLINE})."
    )


_SOFTMAX = KernelSpec(
    "online_softmax_kernel", (("out", "out_ptr"),), _describe_softmax, _softmax_access_hint, _diagnose_softmax
)

register(
    Check(
        check_id="lab15.softmax_long_rows",
        make_inputs=_softmax_long_rows,
        compare=compare_values(_SOFTMAX),
        hint="each program walks its row block by block (BLOCK columns at a time, the last block partial): a first "
        "walk "
        "keeps the running max and the running sum of exp(x - max), rescaling the sum whenever the max grows; a second "
        "walk writes exp(x - max) / sum. Shapes here: one element, rows shorter and longer than a block, rows whose "
        "max "
        f"grows block after block, strided rows ({_ONLINE}).",
        **task_parts(1, REFERENCE, drive_softmax),
    )
)

register(
    Check(
        check_id="lab15.softmax_extreme_values",
        make_inputs=_softmax_extremes,
        compare=compare_values(_SOFTMAX),
        hint="extreme logits: every exp must be taken against the running max (logits near ±1e4), padded lanes must "
        "stay "
        "out of the max (every logit near -1e4), and a row may start with whole blocks of -inf, where the running max "
        f"is still -inf and nothing may be rescaled yet ({_ONLINE}).",
        **task_parts(1, REFERENCE, drive_softmax),
    )
)

register(
    Check(
        check_id="lab15.softmax_two_passes",
        make_inputs=_softmax_traffic_cases,
        compare=compare_traffic(_SOFTMAX, "each element of x read twice, each element of out written once"),
        hint="the online softmax reads the row twice and writes it once: the first walk finds the max and the sum "
        "together, rescaling the sum as the max grows, so no third walk (a separate pass for the max) is needed, and "
        "nothing is stored before the final values. Lanes past n_cols count as traffic too unless masked off. "
        f"Budget: each element of x read twice, each element of out written once ({_ONLINE}).",
        **task_parts(1, REFERENCE, drive_softmax),
    )
)
