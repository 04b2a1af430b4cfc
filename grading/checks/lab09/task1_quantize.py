"""Lab 09 task 1: quantize_int8_groupwise, its scales and int8 values on seeded weights."""

from __future__ import annotations

import random

from grading.checks.common import outcome, reference, unwrap
from grading.checks.lab09.tasks import QUANT, TASKS, expect_raise
from grading.checks.lab09.weights import describe_weight, groups, shape, tensor_result, weight, weight_case
from grading.registry import Check, Mismatch, register

# --- task 1: quantize_int8_groupwise ---------------------------------------------------------------


def _quantize_cases(rng: random.Random) -> list[dict]:
    return [
        weight_case(rng, 4, 32, 8),
        weight_case(rng, 6, 64, 16, zero_groups=groups(6, 64, 16, rng, 2)),
        weight_case(rng, 8, 128, 32, outlier_columns=sorted(rng.sample(range(128), 2))),
        weight_case(rng, 3, 96, 96),  # one group per row
    ]


def _quantize_edge_cases(rng: random.Random) -> list[dict]:
    return [
        weight_case(rng, 5, 24, 1),  # every weight is its own group's largest: q is -127, 0 or 127
        weight_case(rng, 4, 48, 12, zero_groups=[[r, g] for r in (0, 2) for g in range(4)]),  # whole rows of zeros
        weight_case(rng, 6, 64, 32, dtype="float64"),
        weight_case(rng, 6, 64, 16, dtype="float16"),
        weight_case(rng, 4, 64, 16, dtype="bfloat16", outlier_columns=[rng.randrange(64)]),
        weight_case(rng, 4, 64, 48),  # 48 does not divide 64
        weight_case(rng, 4, 64, 16, layout="1d"),
        weight_case(rng, 4, 64, 16, layout="3d"),
        weight_case(rng, 4, 64, 16, layout="int"),
        *(
            weight_case(rng, 4, 64, 16, non_finite=kind, non_finite_at=[rng.randrange(4), rng.randrange(64)])
            for kind in ("nan", "inf", "-inf")
        ),
        weight_case(rng, 4, 64, True),  # a bool is no group size, though Python counts True as 1
        *(weight_case(rng, 4, 64, group) for group in (0, -16, 16.0)),  # not a positive int
    ]


def _quantize_llm_cases(rng: random.Random) -> list[dict]:
    """Rows shaped like SmolLM2's projections (576 and 1536 inputs), small weights, outlier channels."""
    return [
        weight_case(rng, 12, 576, 64, outlier_columns=sorted(rng.sample(range(576), 3)), std=0.02),
        weight_case(rng, 6, 1536, 128, outlier_columns=sorted(rng.sample(range(1536), 4)), std=0.02),
        weight_case(rng, 16, 576, 32, std=0.05, zero_groups=groups(16, 576, 32, rng, 3)),
    ]


def _drive_quantize(quantize, cases: list[dict]) -> list:
    results = []
    for case in cases:
        item = outcome(quantize, weight(case), case["group"])
        if item[0] == "value":
            value = item[1]
            if type(value) not in (tuple, list) or len(value) != 2:
                item = [
                    "value",
                    {"problem": f"quantize_int8_groupwise must return (q, scales), got {type(value).__name__}"},
                ]
            else:
                item = [
                    "value",
                    {
                        "q": tensor_result(value[0], "q", "quantize_int8_groupwise"),
                        "scales": tensor_result(value[1], "scales", "quantize_int8_groupwise"),
                    },
                ]
        results.append(item)
    return results


def _scale_note(got, want, w) -> str:
    """Name the mistake behind wrong scales, when it is a recognisable one."""
    import numpy as np

    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    rows, groups = want.shape
    size = w.shape[1] // groups
    grouped = w.reshape(rows, groups, size)
    if np.allclose(got, want * 127, rtol=1e-5):
        return "; those are the groups' max |w|: divide by 127 for the scale"
    for qmax in (128, 255, 256):
        if np.allclose(got, want * 127 / qmax, rtol=1e-5):
            return f"; you divided by {qmax}: symmetric int8 uses -127..127, so scale = max |w| / 127"
    if np.allclose(got, grouped.max(axis=-1) / 127, rtol=1e-5) or np.allclose(
        got, -grouped.min(axis=-1) / 127, rtol=1e-5
    ):
        return "; take the largest ABSOLUTE value: w.abs().amax(...) (a group's largest weight may be negative)"
    per_row = np.abs(w).max(axis=1, keepdims=True) / 127
    if got.shape == want.shape and np.allclose(got, np.broadcast_to(per_row, want.shape), rtol=1e-5):
        return "; that is one scale per row: each group of group_size consecutive values needs its own"
    strided = np.abs(w.reshape(rows, size, groups)).max(axis=1) / 127
    if np.allclose(got, strided, rtol=1e-5):
        return (
            "; your groups take every n-th value of the row: a group is group_size CONSECUTIVE values, "
            "w.reshape(out, in // group_size, group_size)"
        )
    if np.isnan(got).any() and np.isnan(got).sum() < got.size:
        return "; an all-zero group has scale 0, not nan"
    return ""


def _q_note(got_q, want_q, w, scales) -> str:
    """Name the rounding mistake behind wrong int8 values, when most values fit it."""
    import numpy as np

    rows, groups = scales.shape
    ratio = (w.reshape(rows, groups, -1) / np.where(scales > 0, scales, 1.0)[..., None]).reshape(w.shape)

    clear = np.abs(ratio - np.round(ratio)) > 1e-3  # away from whole numbers, where float rounding may tip it
    if not clear.any():
        return ""

    def mostly(candidate) -> bool:
        return (
            float(np.mean(got_q[clear] == candidate[clear])) > 0.98
            and float(np.mean(want_q[clear] == candidate[clear])) < 0.9
        )

    if mostly(np.trunc(ratio).clip(-127, 127)):
        return (
            "; those are w / scale cut toward zero (.to(torch.int8) truncates): round to the nearest integer "
            "first, torch.round(w / scale)"
        )
    if mostly(np.floor(ratio).clip(-127, 127)):
        return "; those are w / scale rounded down (floor): round to the nearest integer, torch.round(w / scale)"
    return ""


def _compare_quantize_one(case: dict, g, e) -> Mismatch | None:
    import numpy as np

    where = describe_weight(case)
    (got_kind, got), (want_kind, want) = unwrap(g), unwrap(e)
    if want_kind == "raised":
        return expect_raise("quantize_int8_groupwise", got_kind, got, str(want), where)
    if got_kind == "raised":
        return Mismatch(
            f"quantize_int8_groupwise raised {str(got).split(':')[0]} on a valid weight",
            f"on {where}: your code raised {got}",
        )
    if got_kind != "value" or type(got) is not dict:
        return Mismatch("the check recorded a malformed result", f"on {where}: {g!r:.80}")
    if "problem" in got:
        return Mismatch(got["problem"], f"on {where}")
    for part in ("q", "scales"):
        if "problem" in got[part]:
            return Mismatch(got[part]["problem"], f"on {where}")
    if got["q"]["dtype"] != "torch.int8":
        return Mismatch(
            "q must be stored as torch.int8",
            f"on {where}: got {got['q']['dtype']}; convert with .to(torch.int8) after rounding and clamping",
        )
    if got["scales"]["dtype"] != "torch.float32":
        return Mismatch(
            "scales must be torch.float32, whatever the weight's dtype",
            f"on {where}: got {got['scales']['dtype']}; compute from w.float()",
        )
    w = np.asarray(weight(case).float().tolist(), dtype=np.float64)
    want_scales = np.asarray(want["scales"]["values"], dtype=np.float64)
    want_q = np.asarray(want["q"]["values"], dtype=np.float64)
    if shape(got["scales"]["values"]) != list(want_scales.shape):
        return Mismatch(
            "scales have the wrong shape: one scale per group, [out, in // group_size]",
            f"on {where}: expected {list(want_scales.shape)}, got {shape(got['scales']['values'])}",
        )
    if shape(got["q"]["values"]) != list(want_q.shape):
        return Mismatch(
            "q has the wrong shape: the same as the weight, [out, in]",
            f"on {where}: expected {list(want_q.shape)}, got {shape(got['q']['values'])}",
        )
    got_scales = np.asarray(got["scales"]["values"], dtype=np.float64)
    bad = ~np.isclose(got_scales, want_scales, rtol=1e-6, atol=0.0)
    if bad.any():
        r, k = (int(i) for i in np.argwhere(bad)[0])
        return Mismatch(
            "quantize_int8_groupwise computed the wrong scales",
            f"on {where}: {int(bad.sum())} of {bad.size} scales differ; scale [{r}, {k}] (row {r}, "
            f"weights {k * case['group']}..{(k + 1) * case['group'] - 1}) expected "
            f"{want_scales[r, k]:.6g}, got {got_scales[r, k]:.6g}" + _scale_note(got_scales, want_scales, w),
        )
    got_q = np.asarray(got["q"]["values"], dtype=np.float64)
    if np.abs(got_q).max(initial=0) > 127:
        r, c = (int(i) for i in np.argwhere(np.abs(got_q) > 127)[0])
        return Mismatch("q must lie in [-127, 127]", f"on {where}: q[{r}, {c}] = {got_q[r, c]:g}; clamp after rounding")
    scale_per_weight = np.repeat(want_scales, case["group"], axis=1)
    ratio = w / np.where(scale_per_weight > 0, scale_per_weight, 1.0)
    near_tie = np.abs(np.abs(ratio) - np.floor(np.abs(ratio)) - 0.5) < 1e-4  # round-half rules may differ here
    off = got_q != want_q
    bad = off & ~(near_tie & (np.abs(got_q - want_q) <= 1))
    if bad.any():
        r, c = (int(i) for i in np.argwhere(bad)[0])
        return Mismatch(
            "quantize_int8_groupwise computed the wrong int8 values",
            f"on {where}: {int(bad.sum())} of {bad.size} values differ; at [{r}, {c}] w = {w[r, c]:.6g}, "
            f"scale = {scale_per_weight[r, c]:.6g}, w / scale = {ratio[r, c]:.4f}: expected "
            f"{want_q[r, c]:g}, got {got_q[r, c]:g}" + _q_note(got_q, want_q, w, want_scales),
        )
    error = np.abs(w - got_q * scale_per_weight)
    bound = scale_per_weight / 2 * (1 + 1e-4) + 1e-30  # a float32 tie can land a few ulps past half a step
    if (error > bound).any():
        r, c = (int(i) for i in np.argwhere(error > bound)[0])
        return Mismatch(
            "a dequantised weight lies further from w than half a step",
            f"on {where}: at [{r}, {c}] |w - q * scale| = {error[r, c]:.3g}, bound scale / 2 = "
            f"{scale_per_weight[r, c] / 2:.3g}",
        )
    return None


def _compare_quantize(got, expected, cases):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        problem = _compare_quantize_one(case, g, e)
        if problem:
            return problem
    return None


_QUANTIZE_HINT = (
    "each run of group_size consecutive weights in a row is a group with its own scale, set by the "
    "group's largest magnitude (not its largest value, not the row's) so that this weight lands on the "
    "edge of the symmetric range [-127, 127]; every weight is then rounded to the nearest step, not cut "
    "toward zero, and kept inside that range (chapter 09, section “5 · Weight-only quantisation”). q is "
    "int8 with w's shape and scales is float32 with one entry per group, computed in float32 whatever "
    "w's dtype; an all-zero group has scale 0 and q 0, never nan, and ValueError is raised for a weight "
    "that is not a 2-D floating-point tensor or holds nan or inf, and for a group_size that is not a "
    "positive int (a bool is not one) dividing the row."
)


_QUANTIZE_REFERENCE = reference(QUANT, "quantize_int8_groupwise")


register(
    Check(
        check_id="lab09.quantize_int8",
        task=TASKS[1],
        reference=_QUANTIZE_REFERENCE,
        make_inputs=_quantize_cases,
        drive=_drive_quantize,
        compare=_compare_quantize,
        hint=_QUANTIZE_HINT,
    )
)


register(
    Check(
        check_id="lab09.quantize_int8_edges",
        task=TASKS[1],
        reference=_QUANTIZE_REFERENCE,
        make_inputs=_quantize_edge_cases,
        drive=_drive_quantize,
        compare=_compare_quantize,
        hint=_QUANTIZE_HINT
        + (
            " Group size 1, whole rows of zeros, float64/float16/bfloat16 weights, and "
            "invalid arguments: 1-D, 3-D and integer weights, a weight holding nan, inf or "
            "-inf, a group_size that does not divide the row, and the bool True as "
            "group_size."
        ),
    )
)


register(
    Check(
        check_id="lab09.quantize_int8_llm_rows",
        task=TASKS[1],
        reference=_QUANTIZE_REFERENCE,
        make_inputs=_quantize_llm_cases,
        drive=_drive_quantize,
        compare=_compare_quantize,
        hint=_QUANTIZE_HINT + " Rows as long as SmolLM2's projections, small weights with outlier input channels.",
    )
)
