"""Lab 09 task 2: dequantize_int8_groupwise, on quantised weights and round trips."""

from __future__ import annotations

import random

from grading.checks.common import outcome, reference, unwrap
from grading.checks.lab09.tasks import QUANT, TASKS, expect_raise
from grading.checks.lab09.weights import describe_weight, shape, tensor_result, weight, weight_case
from grading.registry import Check, Mismatch, register

# --- task 2: dequantize_int8_groupwise -------------------------------------------------------------


def _private_quantize(w, group: int):
    """The checks' own group-wise int8 quantiser (not a lab answer), for the round-trip check."""
    import torch

    groups = w.float().reshape(w.shape[0], -1, group)
    scales = groups.abs().amax(-1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.clamp(torch.round(groups / safe[..., None]), -127, 127).to(torch.int8).reshape(w.shape), scales


def _dequantize_inputs(case: dict):
    import torch

    gen = torch.Generator().manual_seed(case["seed"])
    rows, cols = case["shape"]
    if case.get("from_weight"):
        q, scales = _private_quantize(weight(case), case["group"])
    else:
        q = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8)
        scales = torch.rand(rows, cols // case["group"], generator=gen) * case["std"] / 127
        for row, group in case.get("zero_groups", []):
            scales[row, group] = 0.0
    if case.get("bad_scales"):
        scales = torch.cat([scales, scales[:, :1]], dim=1)
    if case.get("q_dtype"):
        q = q.to(getattr(torch, case["q_dtype"]))
    return q, scales


def _dequantize_cases(rng: random.Random) -> list[dict]:
    return [
        {"seed": rng.randrange(10**6), "shape": [3, 16], "group": 4, "std": 1.0},
        {"seed": rng.randrange(10**6), "shape": [5, 64], "group": 16, "std": 0.1, "zero_groups": [[1, 2]]},
        {"seed": rng.randrange(10**6), "shape": [4, 96], "group": 32, "std": 2.0},
        {"seed": rng.randrange(10**6), "shape": [2, 40], "group": 40, "std": 0.5},
    ]


def _dequantize_roundtrip_cases(rng: random.Random) -> list[dict]:
    return [
        {
            **weight_case(rng, 8, 576, 64, outlier_columns=sorted(rng.sample(range(576), 2)), std=0.02),
            "from_weight": True,
        },
        {**weight_case(rng, 6, 128, 1), "from_weight": True},
        {**weight_case(rng, 4, 96, 32, zero_groups=[[0, 1], [3, 0]]), "from_weight": True},
        {"seed": rng.randrange(10**6), "shape": [4, 64], "group": 16, "std": 1.0, "bad_scales": True},
        *(
            {"seed": rng.randrange(10**6), "shape": [4, 32], "group": 8, "std": 1.0, "q_dtype": dtype}
            for dtype in ("int32", "float32")
        ),
        {"seed": rng.randrange(10**6), "shape": [4, 64], "group": 48, "std": 1.0},  # 48 does not divide 64
    ]


def _describe_dequantize(case: dict) -> str:
    rows, cols = case["shape"]
    n_scales = cols // case["group"] + (1 if case.get("bad_scales") else 0)
    source = (
        f"from a quantised weight ({describe_weight(case)})"
        if case.get("from_weight")
        else "random int8 values and scales"
    )
    return (
        f"q of shape [{rows}, {cols}] (torch.{case.get('q_dtype', 'int8')}) with scales of shape [{rows}, "
        f"{n_scales}], group_size={case['group']}, {source}"
    )


def _drive_dequantize(dequantize, cases: list[dict]) -> list:
    results = []
    for case in cases:
        q, scales = _dequantize_inputs(case)
        item = outcome(dequantize, q, scales, case["group"])
        if item[0] == "value":
            item = ["value", tensor_result(item[1], "result", "dequantize_int8_groupwise")]
        results.append(item)
    return results


def _compare_dequantize(got, expected, cases):
    import numpy as np

    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        where = _describe_dequantize(case)
        (got_kind, value), (want_kind, want) = unwrap(g), unwrap(e)
        if want_kind == "raised":
            problem = expect_raise("dequantize_int8_groupwise", got_kind, value, str(want), where)
            if problem:
                return problem
            continue
        if got_kind == "raised":
            return Mismatch(
                f"dequantize_int8_groupwise raised {str(value).split(':')[0]} on valid inputs",
                f"on {where}: your code raised {value}",
            )
        if got_kind != "value" or type(value) is not dict:
            return Mismatch("the check recorded a malformed result", f"on {where}: {g!r:.80}")
        if "problem" in value:
            return Mismatch(value["problem"], f"on {where}")
        if value["dtype"] != "torch.float32":
            return Mismatch(
                "dequantize_int8_groupwise must return float32", f"on {where}: got {value['dtype']}; q.float() * scale"
            )
        want_w = np.asarray(want["values"], dtype=np.float64)
        if shape(value["values"]) != list(want_w.shape):
            return Mismatch(
                "dequantize_int8_groupwise returned the wrong shape: [out, in], like q",
                f"on {where}: expected {list(want_w.shape)}, got {shape(value['values'])}",
            )
        got_w = np.asarray(value["values"], dtype=np.float64)
        bad = ~np.isclose(got_w, want_w, rtol=1e-6, atol=1e-30)
        if bad.any():
            r, c = (int(i) for i in np.argwhere(bad)[0])
            q, scales = (t.double().numpy() for t in _dequantize_inputs(case))
            note = ""
            if np.allclose(got_w, q * np.tile(scales, (1, case["group"])), rtol=1e-6):
                note = (
                    "; your scales are tiled (scales.repeat): each scale covers group_size CONSECUTIVE values "
                    "of its row, scales.repeat_interleave(group_size, dim=1)"
                )
            elif np.allclose(got_w, q / np.repeat(np.where(scales > 0, scales, 1.0), case["group"], axis=1), rtol=1e-6):
                note = "; you divided by the scale: dequantising multiplies, w' = q * scale"
            return Mismatch(
                "dequantize_int8_groupwise returned wrong values",
                f"on {where}: {int(bad.sum())} of {bad.size} values differ; at [{r}, {c}] q = {q[r, c]:g}"
                f" and its group's scale is {scales[r, c // case['group']]:.6g}: expected "
                f"{want_w[r, c]:.6g}, got {got_w[r, c]:.6g}{note}",
            )
    return None


_DEQUANTIZE_HINT = (
    "the way back undoes task 1's division: each int8 value goes back through the scale of its own "
    "group, the group_size consecutive values of its row that the scale covers (not every n-th value "
    "of the row), so every weight returns within half a step of the original. The result is float32 "
    "with q's shape; ValueError is raised when q is not int8 or scales does not hold one scale per "
    "group of each row."
)


_DEQUANTIZE_REFERENCE = reference(QUANT, "dequantize_int8_groupwise")


register(
    Check(
        check_id="lab09.dequantize_int8",
        task=TASKS[2],
        reference=_DEQUANTIZE_REFERENCE,
        make_inputs=_dequantize_cases,
        drive=_drive_dequantize,
        compare=_compare_dequantize,
        hint=_DEQUANTIZE_HINT,
    )
)


register(
    Check(
        check_id="lab09.dequantize_roundtrip",
        task=TASKS[2],
        reference=_DEQUANTIZE_REFERENCE,
        make_inputs=_dequantize_roundtrip_cases,
        drive=_drive_dequantize,
        compare=_compare_dequantize,
        hint=_DEQUANTIZE_HINT + " Quantised weights with long rows, group size 1, zero groups, scales of "
        "the wrong shape, and a q of dtype int32 or float32.",
    )
)
