"""Checks for lab 09 (speculative decoding and quantisation): the learner writes
``quantize_int8_groupwise``, ``dequantize_int8_groupwise``, ``expected_tokens_per_step`` and the
acceptance rule ``accept_or_resample``.

The quantisation checks compare scales and int8 values on seeded weights (normal values with
outlier channels, all-zero groups, half-precision inputs, invalid arguments); an int8 value may be
one off only where ``w / scale`` sits on a rounding tie. The acceptance rule is checked three ways:
on one-hot (greedy) distributions, where its output is fixed; statistically, by running it thousands
of times on small seeded ``p`` and ``q`` and comparing what it emits with the target's exact
distributions (a chi-square test, and the accepted-length distribution); and plugged into the
course's ``speculative_decode`` on a small random model, whose greedy output must equal plain greedy
decoding. When a statistical check fails, the grader also fits the distributions that the classic
mistakes would produce, and names the mistake that fits.
"""

from __future__ import annotations

import contextlib
import math
import random

from grading.checks.common import is_number, outcome, reference, token_difference, unwrap
from grading.checks.model_cases import TINY, tiny_model
from grading.registry import Check, Mismatch, register, register_shortcuts

_SPEC = "infra_lib.serving.speculative"
_QUANT = "infra_lib.model.quant"

register_shortcuts("lab09", [f"{_SPEC}:{name}" for name in
                             ("accept_or_resample", "expected_tokens_per_step", "predicted_speedup")]
                   + [f"{_QUANT}:{name}" for name in ("quantize_int8_groupwise", "dequantize_int8_groupwise",
                                                      "quantize_symmetric", "dequantize_symmetric", "QuantLinear",
                                                      "quantize_model",
                                                      # the input rules of tasks 1 and 2, which the two above call
                                                      "_check_weight", "_check_group_size")])

_TASKS = {1: "lab09 task 1: quantize_int8_groupwise", 2: "lab09 task 2: dequantize_int8_groupwise",
          3: "lab09 task 3: expected_tokens_per_step", 4: "lab09 task 4: accept_or_resample"}


# --- calling the implementation -------------------------------------------------------------------

def _expect_raise(name: str, got_kind: str, got_value, want_error: str, where: str) -> Mismatch | None:
    error = want_error.split(":")[0]
    if got_kind == "raised" and str(got_value).split(":")[0] == error:
        return None
    got_text = f"it raised {got_value}" if got_kind == "raised" else "it returned a result"
    return Mismatch(f"{name} should raise {error} on an invalid input", f"on {where}: {got_text}")


# --- weights ----------------------------------------------------------------------------------------

def _weight(case: dict):
    """The seeded weight a case describes: normal values, outlier input channels, zeroed groups."""
    import torch

    gen = torch.Generator().manual_seed(case["seed"])
    rows, cols = case["shape"]
    w = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * case["std"]
    for col in case.get("outlier_columns", []):  # an outlier channel: large across every row
        w[:, col] *= case["outlier_factor"]
    for row, group in case.get("zero_groups", []):
        g = case["group"]
        w[row, group * g:(group + 1) * g] = 0.0
    if case.get("non_finite"):  # one weight that is not a number
        row, col = case["non_finite_at"]
        w[row, col] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[case["non_finite"]]
    w = w.to(getattr(torch, case.get("dtype", "float32")))
    if case.get("layout") == "1d":
        return w.flatten()
    if case.get("layout") == "3d":
        return w.reshape(1, rows, cols)
    if case.get("layout") == "int":
        return (w * 100).round().to(torch.int32)
    return w


def _describe_weight(case: dict) -> str:
    rows, cols = case["shape"]
    dtype = case.get("dtype", "float32")
    shape = {"1d": f"[{rows * cols}]", "3d": f"[1, {rows}, {cols}]"}.get(case.get("layout"), f"[{rows}, {cols}]")
    kind = "torch.int32" if case.get("layout") == "int" else f"torch.{dtype}"
    extra = ""
    if case.get("outlier_columns"):
        extra += f", outlier input channels {case['outlier_columns']} (x{case['outlier_factor']:g})"
    if case.get("zero_groups"):
        extra += f", all-zero groups (row, group) {case['zero_groups']}"
    if case.get("non_finite"):
        extra += f", w{case['non_finite_at']} = {case['non_finite']}"
    return f"w of shape {shape} ({kind}, std {case['std']:g}{extra}), group_size={case['group']!r}"


def _weight_case(rng: random.Random, rows: int, cols: int, group: int, **extra) -> dict:
    case = {"seed": rng.randrange(10**6), "shape": [rows, cols], "group": group,
            "std": rng.choice([0.02, 0.05, 0.5, 1.0]), **extra}
    if "outlier_columns" in extra:
        case.setdefault("outlier_factor", float(rng.randint(10, 40)))
    return case


def _groups(rows: int, cols: int, group: int, rng: random.Random, count: int) -> list[list[int]]:
    picked = {(rng.randrange(rows), rng.randrange(cols // group)) for _ in range(count)}
    return [list(p) for p in sorted(picked)]


# --- task 1: quantize_int8_groupwise ---------------------------------------------------------------

def _quantize_cases(rng: random.Random) -> list[dict]:
    return [
        _weight_case(rng, 4, 32, 8),
        _weight_case(rng, 6, 64, 16, zero_groups=_groups(6, 64, 16, rng, 2)),
        _weight_case(rng, 8, 128, 32, outlier_columns=sorted(rng.sample(range(128), 2))),
        _weight_case(rng, 3, 96, 96),  # one group per row
    ]


def _quantize_edge_cases(rng: random.Random) -> list[dict]:
    return [
        _weight_case(rng, 5, 24, 1),  # every weight is its own group's largest: q is -127, 0 or 127
        _weight_case(rng, 4, 48, 12, zero_groups=[[r, g] for r in (0, 2) for g in range(4)]),  # whole rows of zeros
        _weight_case(rng, 6, 64, 32, dtype="float64"),
        _weight_case(rng, 6, 64, 16, dtype="float16"),
        _weight_case(rng, 4, 64, 16, dtype="bfloat16", outlier_columns=[rng.randrange(64)]),
        _weight_case(rng, 4, 64, 48),  # 48 does not divide 64
        _weight_case(rng, 4, 64, 16, layout="1d"),
        _weight_case(rng, 4, 64, 16, layout="3d"),
        _weight_case(rng, 4, 64, 16, layout="int"),
        *(_weight_case(rng, 4, 64, 16, non_finite=kind, non_finite_at=[rng.randrange(4), rng.randrange(64)])
          for kind in ("nan", "inf", "-inf")),
        _weight_case(rng, 4, 64, True),  # a bool is no group size, though Python counts True as 1
        *(_weight_case(rng, 4, 64, group) for group in (0, -16, 16.0)),  # not a positive int
    ]


def _quantize_llm_cases(rng: random.Random) -> list[dict]:
    """Rows shaped like SmolLM2's projections (576 and 1536 inputs), small weights, outlier channels."""
    return [
        _weight_case(rng, 12, 576, 64, outlier_columns=sorted(rng.sample(range(576), 3)), std=0.02),
        _weight_case(rng, 6, 1536, 128, outlier_columns=sorted(rng.sample(range(1536), 4)), std=0.02),
        _weight_case(rng, 16, 576, 32, std=0.05, zero_groups=_groups(16, 576, 32, rng, 3)),
    ]


def _tensor_result(value, name: str, who: str) -> dict:
    import torch

    if not isinstance(value, torch.Tensor):
        return {"problem": f"{who}'s {name} must be a torch.Tensor, got {type(value).__name__}"}
    return {"dtype": str(value.dtype), "values": value.detach().cpu().double().tolist()}


def _drive_quantize(quantize, cases: list[dict]) -> list:
    results = []
    for case in cases:
        item = outcome(quantize, _weight(case), case["group"])
        if item[0] == "value":
            value = item[1]
            if type(value) not in (tuple, list) or len(value) != 2:
                item = ["value", {"problem": f"quantize_int8_groupwise must return (q, scales), got "
                                             f"{type(value).__name__}"}]
            else:
                item = ["value", {"q": _tensor_result(value[0], "q", "quantize_int8_groupwise"),
                                  "scales": _tensor_result(value[1], "scales", "quantize_int8_groupwise")}]
        results.append(item)
    return results


def _shape(values) -> list[int]:
    import numpy as np

    return list(np.asarray(values, dtype=np.float64).shape)


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
    if np.allclose(got, grouped.max(axis=-1) / 127, rtol=1e-5) or np.allclose(got, -grouped.min(axis=-1) / 127,
                                                                              rtol=1e-5):
        return "; take the largest ABSOLUTE value: w.abs().amax(...) (a group's largest weight may be negative)"
    per_row = np.abs(w).max(axis=1, keepdims=True) / 127
    if got.shape == want.shape and np.allclose(got, np.broadcast_to(per_row, want.shape), rtol=1e-5):
        return "; that is one scale per row: each group of group_size consecutive values needs its own"
    strided = np.abs(w.reshape(rows, size, groups)).max(axis=1) / 127
    if np.allclose(got, strided, rtol=1e-5):
        return ("; your groups take every n-th value of the row: a group is group_size CONSECUTIVE values, "
                "w.reshape(out, in // group_size, group_size)")
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
        return (float(np.mean(got_q[clear] == candidate[clear])) > 0.98
                and float(np.mean(want_q[clear] == candidate[clear])) < 0.9)

    if mostly(np.trunc(ratio).clip(-127, 127)):
        return ("; those are w / scale cut toward zero (.to(torch.int8) truncates): round to the nearest integer "
                "first, torch.round(w / scale)")
    if mostly(np.floor(ratio).clip(-127, 127)):
        return "; those are w / scale rounded down (floor): round to the nearest integer, torch.round(w / scale)"
    return ""


def _compare_quantize_one(case: dict, g, e) -> Mismatch | None:
    import numpy as np

    where = _describe_weight(case)
    (got_kind, got), (want_kind, want) = unwrap(g), unwrap(e)
    if want_kind == "raised":
        return _expect_raise("quantize_int8_groupwise", got_kind, got, str(want), where)
    if got_kind == "raised":
        return Mismatch(f"quantize_int8_groupwise raised {str(got).split(':')[0]} on a valid weight",
                        f"on {where}: your code raised {got}")
    if got_kind != "value" or type(got) is not dict:
        return Mismatch("the check recorded a malformed result", f"on {where}: {g!r:.80}")
    if "problem" in got:
        return Mismatch(got["problem"], f"on {where}")
    for part in ("q", "scales"):
        if "problem" in got[part]:
            return Mismatch(got[part]["problem"], f"on {where}")
    if got["q"]["dtype"] != "torch.int8":
        return Mismatch("q must be stored as torch.int8", f"on {where}: got {got['q']['dtype']}; convert with "
                                                          ".to(torch.int8) after rounding and clamping")
    if got["scales"]["dtype"] != "torch.float32":
        return Mismatch("scales must be torch.float32, whatever the weight's dtype",
                        f"on {where}: got {got['scales']['dtype']}; compute from w.float()")
    w = np.asarray(_weight(case).float().tolist(), dtype=np.float64)
    want_scales = np.asarray(want["scales"]["values"], dtype=np.float64)
    want_q = np.asarray(want["q"]["values"], dtype=np.float64)
    if _shape(got["scales"]["values"]) != list(want_scales.shape):
        return Mismatch("scales have the wrong shape: one scale per group, [out, in // group_size]",
                        f"on {where}: expected {list(want_scales.shape)}, got {_shape(got['scales']['values'])}")
    if _shape(got["q"]["values"]) != list(want_q.shape):
        return Mismatch("q has the wrong shape: the same as the weight, [out, in]",
                        f"on {where}: expected {list(want_q.shape)}, got {_shape(got['q']['values'])}")
    got_scales = np.asarray(got["scales"]["values"], dtype=np.float64)
    bad = ~np.isclose(got_scales, want_scales, rtol=1e-6, atol=0.0)
    if bad.any():
        r, k = (int(i) for i in np.argwhere(bad)[0])
        return Mismatch("quantize_int8_groupwise computed the wrong scales",
                        f"on {where}: {int(bad.sum())} of {bad.size} scales differ; scale [{r}, {k}] (row {r}, "
                        f"weights {k * case['group']}..{(k + 1) * case['group'] - 1}) expected "
                        f"{want_scales[r, k]:.6g}, got {got_scales[r, k]:.6g}"
                        + _scale_note(got_scales, want_scales, w))
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
        return Mismatch("quantize_int8_groupwise computed the wrong int8 values",
                        f"on {where}: {int(bad.sum())} of {bad.size} values differ; at [{r}, {c}] w = {w[r, c]:.6g}, "
                        f"scale = {scale_per_weight[r, c]:.6g}, w / scale = {ratio[r, c]:.4f}: expected "
                        f"{want_q[r, c]:g}, got {got_q[r, c]:g}" + _q_note(got_q, want_q, w, want_scales))
    error = np.abs(w - got_q * scale_per_weight)
    bound = scale_per_weight / 2 * (1 + 1e-4) + 1e-30  # a float32 tie can land a few ulps past half a step
    if (error > bound).any():
        r, c = (int(i) for i in np.argwhere(error > bound)[0])
        return Mismatch("a dequantised weight lies further from w than half a step",
                        f"on {where}: at [{r}, {c}] |w - q * scale| = {error[r, c]:.3g}, bound scale / 2 = "
                        f"{scale_per_weight[r, c] / 2:.3g}")
    return None


def _compare_quantize(got, expected, cases):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        problem = _compare_quantize_one(case, g, e)
        if problem:
            return problem
    return None


_QUANTIZE_HINT = ("each run of group_size consecutive weights in a row is a group with its own scale, set by the "
                  "group's largest magnitude (not its largest value, not the row's) so that this weight lands on the "
                  "edge of the symmetric range [-127, 127]; every weight is then rounded to the nearest step, not cut "
                  "toward zero, and kept inside that range (chapter 09, section “5 · Weight-only quantisation”). q is "
                  "int8 with w's shape and scales is float32 with one entry per group, computed in float32 whatever "
                  "w's dtype; an all-zero group has scale 0 and q 0, never nan, and ValueError is raised for a weight "
                  "that is not a 2-D floating-point tensor or holds nan or inf, and for a group_size that is not a "
                  "positive int (a bool is not one) dividing the row.")

_QUANTIZE_REFERENCE = reference(_QUANT, "quantize_int8_groupwise")

for check_id, make, note in (
        ("lab09.quantize_int8", _quantize_cases, ""),
        ("lab09.quantize_int8_edges", _quantize_edge_cases,
         (" Group size 1, whole rows of zeros, float64/float16/bfloat16 weights, and invalid arguments: 1-D, "
          "3-D and integer weights, a weight holding nan, inf or -inf, a group_size that does not divide the row, "
          "and the bool True as group_size.")),
        ("lab09.quantize_int8_llm_rows", _quantize_llm_cases,
         " Rows as long as SmolLM2's projections, small weights with outlier input channels.")):
    register(Check(check_id=check_id, task=_TASKS[1], reference=_QUANTIZE_REFERENCE,
                   make_inputs=make, drive=_drive_quantize, compare=_compare_quantize, hint=_QUANTIZE_HINT + note))


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
        q, scales = _private_quantize(_weight(case), case["group"])
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
        {**_weight_case(rng, 8, 576, 64, outlier_columns=sorted(rng.sample(range(576), 2)), std=0.02),
         "from_weight": True},
        {**_weight_case(rng, 6, 128, 1), "from_weight": True},
        {**_weight_case(rng, 4, 96, 32, zero_groups=[[0, 1], [3, 0]]), "from_weight": True},
        {"seed": rng.randrange(10**6), "shape": [4, 64], "group": 16, "std": 1.0, "bad_scales": True},
        *({"seed": rng.randrange(10**6), "shape": [4, 32], "group": 8, "std": 1.0, "q_dtype": dtype}
          for dtype in ("int32", "float32")),
        {"seed": rng.randrange(10**6), "shape": [4, 64], "group": 48, "std": 1.0},  # 48 does not divide 64
    ]


def _describe_dequantize(case: dict) -> str:
    rows, cols = case["shape"]
    n_scales = cols // case["group"] + (1 if case.get("bad_scales") else 0)
    source = (f"from a quantised weight ({_describe_weight(case)})" if case.get("from_weight")
              else "random int8 values and scales")
    return (f"q of shape [{rows}, {cols}] (torch.{case.get('q_dtype', 'int8')}) with scales of shape [{rows}, "
            f"{n_scales}], group_size={case['group']}, {source}")


def _drive_dequantize(dequantize, cases: list[dict]) -> list:
    results = []
    for case in cases:
        q, scales = _dequantize_inputs(case)
        item = outcome(dequantize, q, scales, case["group"])
        if item[0] == "value":
            item = ["value", _tensor_result(item[1], "result", "dequantize_int8_groupwise")]
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
            problem = _expect_raise("dequantize_int8_groupwise", got_kind, value, str(want), where)
            if problem:
                return problem
            continue
        if got_kind == "raised":
            return Mismatch(f"dequantize_int8_groupwise raised {str(value).split(':')[0]} on valid inputs",
                            f"on {where}: your code raised {value}")
        if got_kind != "value" or type(value) is not dict:
            return Mismatch("the check recorded a malformed result", f"on {where}: {g!r:.80}")
        if "problem" in value:
            return Mismatch(value["problem"], f"on {where}")
        if value["dtype"] != "torch.float32":
            return Mismatch("dequantize_int8_groupwise must return float32",
                            f"on {where}: got {value['dtype']}; q.float() * scale")
        want_w = np.asarray(want["values"], dtype=np.float64)
        if _shape(value["values"]) != list(want_w.shape):
            return Mismatch("dequantize_int8_groupwise returned the wrong shape: [out, in], like q",
                            f"on {where}: expected {list(want_w.shape)}, got {_shape(value['values'])}")
        got_w = np.asarray(value["values"], dtype=np.float64)
        bad = ~np.isclose(got_w, want_w, rtol=1e-6, atol=1e-30)
        if bad.any():
            r, c = (int(i) for i in np.argwhere(bad)[0])
            q, scales = (t.double().numpy() for t in _dequantize_inputs(case))
            note = ""
            if np.allclose(got_w, q * np.tile(scales, (1, case["group"])), rtol=1e-6):
                note = ("; your scales are tiled (scales.repeat): each scale covers group_size CONSECUTIVE values "
                        "of its row, scales.repeat_interleave(group_size, dim=1)")
            elif np.allclose(got_w, q / np.repeat(np.where(scales > 0, scales, 1.0), case["group"], axis=1),
                             rtol=1e-6):
                note = "; you divided by the scale: dequantising multiplies, w' = q * scale"
            return Mismatch("dequantize_int8_groupwise returned wrong values",
                            f"on {where}: {int(bad.sum())} of {bad.size} values differ; at [{r}, {c}] q = {q[r, c]:g}"
                            f" and its group's scale is {scales[r, c // case['group']]:.6g}: expected "
                            f"{want_w[r, c]:.6g}, got {got_w[r, c]:.6g}{note}")
    return None


_DEQUANTIZE_HINT = ("the way back undoes task 1's division: each int8 value goes back through the scale of its own "
                    "group, the group_size consecutive values of its row that the scale covers (not every n-th value "
                    "of the row), so every weight returns within half a step of the original. The result is float32 "
                    "with q's shape; ValueError is raised when q is not int8 or scales does not hold one scale per "
                    "group of each row.")

_DEQUANTIZE_REFERENCE = reference(_QUANT, "dequantize_int8_groupwise")

register(Check(check_id="lab09.dequantize_int8", task=_TASKS[2],
               reference=_DEQUANTIZE_REFERENCE, make_inputs=_dequantize_cases,
               drive=_drive_dequantize, compare=_compare_dequantize, hint=_DEQUANTIZE_HINT))
register(Check(check_id="lab09.dequantize_roundtrip", task=_TASKS[2],
               reference=_DEQUANTIZE_REFERENCE, make_inputs=_dequantize_roundtrip_cases,
               drive=_drive_dequantize, compare=_compare_dequantize,
               hint=_DEQUANTIZE_HINT + " Quantised weights with long rows, group size 1, zero groups, scales of "
                                       "the wrong shape, and a q of dtype int32 or float32."))


# --- task 3: expected_tokens_per_step --------------------------------------------------------------

def _expected_cases(rng: random.Random) -> list[list]:
    return [[round(rng.uniform(0.2, 0.95), 3), rng.randint(1, 8)] for _ in range(6)] + [[0.5, 2], [0.8, 4]]


def _expected_edge_cases(rng: random.Random) -> list[list]:
    return [[0.0, rng.randint(1, 8)], [0, rng.randint(1, 8)], [1.0, rng.randint(1, 8)], [1, 4], [round(rng.uniform(0.1, 0.9), 3), 0],
            [0.999999, rng.randint(2, 6)], [1.5, 3], [-0.1, 2], [round(rng.uniform(0.5, 0.99), 4), 16],
            [round(rng.uniform(0.1, 0.9), 3), -rng.randint(1, 3)], [1.0, -1]]


def _drive_expected(fn, cases: list[list]) -> list:
    return [outcome(fn, a, gamma) for a, gamma in cases]


def _expected_note(a: float, gamma: int, got) -> str:
    def close(x):
        return math.isclose(got, x, rel_tol=1e-6)

    want = float(gamma + 1) if a == 1 else (1 - a ** (gamma + 1)) / (1 - a)
    if close(want - 1) and not close(want):
        return ("; that counts only the accepted draft tokens: every step also emits one token of the target's own "
                "(the replacement at the first rejection, or the bonus)")
    if a < 1:
        if gamma > 0 and close((1 - a ** gamma) / (1 - a)):
            return "; that sums gamma terms: with the bonus token there are gamma + 1, 1 + a + ... + a^gamma"
        if close(a ** (gamma + 1) / (1 - a)) or close((1 - a ** (gamma + 1)) * (1 - a)):
            return ("; that is not the closed form of 1 + a + ... + a^gamma: try yours where the answer is known, "
                    "E = 1 at a = 0 and at gamma = 0")
        if close(1 / (1 - a)):
            return "; that is the limit for an endless draft: gamma drafts give only gamma + 1 terms"
    if close(1 + a * gamma) or close(a * gamma):
        return ("; draft token i counts only when every token before it was accepted too (probability a^i), "
                "not with probability a on its own")
    return ""


def _compare_expected(got, expected, cases):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for (a, gamma), g, e in zip(cases, got, expected):
        where = f"acceptance={a}, gamma={gamma}"
        (got_kind, value), (want_kind, want) = unwrap(g), unwrap(e)
        if want_kind == "raised":
            problem = _expect_raise("expected_tokens_per_step", got_kind, value, str(want), where)
            if problem:
                return problem
            continue
        if got_kind == "raised":
            note = ("; at a = 1 the formula divides by zero: every draft token is accepted, E = gamma + 1"
                    if a == 1 else "")
            return Mismatch(f"expected_tokens_per_step raised {str(value).split(':')[0]} on a valid input",
                            f"on {where}: expected {want!r}, your code raised {value}{note}")
        if is_number(value) and type(value) is not float and math.isclose(value, want, rel_tol=1e-7):
            return Mismatch("expected_tokens_per_step must return a float",
                            f"on {where}: got the {type(value).__name__} {value!r}; the value is right")
        if not is_number(value) or math.isnan(value) or not math.isclose(value, want, rel_tol=1e-7):
            note = _expected_note(a, gamma, value) if is_number(value) else ""
            return Mismatch("expected_tokens_per_step returned the wrong number",
                            f"on {where}: expected {want!r}, got {value!r}{note}")
    return None


_EXPECTED_HINT = ("a step yields its accepted draft tokens plus one token of the target's own, and draft token i "
                  "counts only when every draft token up to it was accepted, so the chances shrink geometrically and "
                  "there is one more term than there are draft tokens (chapter 09, section “2 · The acceptance "
                  "rule”). At acceptance 1 every draft token and the target's token come out, with no division by "
                  "zero; the result is a float, and an acceptance outside [0, 1] or a negative gamma raises ValueError.")

_EXPECTED_REFERENCE = reference(_SPEC, "expected_tokens_per_step")

register(Check(check_id="lab09.expected_tokens", task=_TASKS[3], reference=_EXPECTED_REFERENCE,
               make_inputs=_expected_cases, drive=_drive_expected, compare=_compare_expected, hint=_EXPECTED_HINT))
register(Check(check_id="lab09.expected_tokens_edges", task=_TASKS[3],
               reference=_EXPECTED_REFERENCE, make_inputs=_expected_edge_cases,
               drive=_drive_expected, compare=_compare_expected,
               hint=_EXPECTED_HINT + " a = 0, a = 1 (also the int 1), gamma = 0, a very close to 1, a outside [0, 1], "
                                      "a negative gamma."))


# --- task 4: the acceptance rule, plugged into speculative decoding --------------------------------

@contextlib.contextmanager
def using_acceptance_rule(rule):
    """Run ``infra_lib.serving.speculative.speculative_decode`` with ``rule`` as its acceptance rule
    inside the ``with`` block (the loop looks the rule up as a module global at every step)."""
    from infra_lib.serving import speculative

    previous = speculative.accept_or_resample
    speculative.accept_or_resample = rule
    try:
        yield
    finally:
        speculative.accept_or_resample = previous


def _as_step(result, vocab: int) -> tuple[list[int] | None, int | None, str]:
    """(accepted, next token, problem) from what a rule returned; problem is "" when well formed."""
    if type(result) not in (tuple, list) or len(result) != 2:
        return None, None, f"returned {type(result).__name__} {str(result)[:60]}, not (accepted, next_token)"
    accepted, token = result
    try:
        accepted = [int(t) for t in accepted]
    except (TypeError, ValueError, RuntimeError):
        return None, None, f"returned accepted = {str(accepted)[:60]}: a list of token ids is needed"
    try:
        token = int(token)
    except (TypeError, ValueError, RuntimeError):
        return accepted, None, f"returned next_token = {str(token)[:60]}: one token id (an int) is needed"
    if not 0 <= token < vocab:
        return accepted, token, f"returned next_token = {token}, outside the vocabulary 0..{vocab - 1}"
    return accepted, token, ""


# one-hot (greedy) distributions: the output is fixed

def _greedy_cases(rng: random.Random) -> list[dict]:
    vocab = rng.randint(6, 10)

    def case(gamma: int, first_miss: int | None, label: str, seeded: bool = True) -> dict:
        target = [rng.randrange(vocab) for _ in range(gamma + 1)]
        draft = list(target[:gamma])
        if first_miss is not None:
            draft[first_miss] = (target[first_miss] + rng.randint(1, vocab - 1)) % vocab
            for i in range(first_miss + 1, gamma):  # after a miss the draft guesses anything
                draft[i] = rng.randrange(vocab)
        return {"vocab": vocab, "target": target, "draft": draft, "label": label,
                "seed": rng.randrange(10**6) if seeded else None}

    g = rng.randint(3, 5)
    return [case(g, None, "every draft token is the target's choice"),
            case(g, 0, "the first draft token is wrong"),
            case(g, rng.randint(1, g - 1), "a draft token after the first is wrong"),
            case(g, g - 1, "only the last draft token is wrong"),
            case(1, None, "one draft token, the target's choice", seeded=False),
            case(0, None, "no draft tokens (gamma = 0): only the target's token"),
            case(2, 1, "the second of two draft tokens is wrong (no generator: generator=None)", seeded=False)]


def _one_hot(indices: list[int], vocab: int):
    import torch

    if not indices:
        return torch.zeros(0, vocab)
    return torch.nn.functional.one_hot(torch.tensor(indices), vocab).float()


def _drive_greedy(rule, cases: list[dict]) -> list:
    import torch

    results = []
    for case in cases:
        p, q = _one_hot(case["target"], case["vocab"]), _one_hot(case["draft"], case["vocab"])
        p_given, q_given = p.clone(), q.clone()
        generator = torch.Generator().manual_seed(case["seed"]) if case["seed"] is not None else None
        item = outcome(rule, p, q, list(case["draft"]), generator)
        if item[0] == "value":
            accepted, token, problem = _as_step(item[1], case["vocab"])
            problem = problem or _not_python_ints(item[1])
            item = ["value", {"problem": problem} if problem else {
                "accepted": accepted, "next": token,
                "changed": [name for name, now, given in (("p", p, p_given), ("q", q, q_given))
                            if not torch.equal(now, given)]}]
        results.append(item)
    return results


def _not_python_ints(result) -> str:
    """What is not as the task states in a well-formed step: a list of Python ints and a Python int."""
    accepted, token = result
    if type(accepted) is not list:
        return f"returned accepted as a {type(accepted).__name__}: a list is needed"
    wrong = next((t for t in accepted if type(t) is not int), None)
    if wrong is not None:
        return f"returned an accepted token as a {type(wrong).__name__} ({str(wrong)[:40]}): Python ints are needed"
    if type(token) is not int:
        return f"returned next_token as a {type(token).__name__} ({str(token)[:40]}): a Python int is needed"
    return ""


def _describe_greedy(case: dict) -> str:
    return (f"{case['label']}: gamma={len(case['draft'])}, one-hot p on the target's tokens {case['target']}, "
            f"one-hot q on the draft tokens {case['draft']}")


def _greedy_problem(case: dict, got: dict, want: dict) -> str:
    draft, target = case["draft"], case["target"]
    k = len(want["accepted"])
    if got["accepted"] != draft[:len(got["accepted"])]:
        return ("your accepted tokens are not the draft's first tokens: keep draft tokens in order and stop at the "
                "first rejection")
    if k == len(draft) and got["accepted"] + [got["next"]] == want["accepted"]:
        return ("you returned the last accepted draft token as next_token: when all gamma are accepted, return all of "
                "them as accepted, and a bonus token drawn from p[gamma] as next_token")
    if len(got["accepted"]) > k:
        return (f"you accepted draft token {k} ({draft[k]}), where the target's token is {target[k]}: p(x) = 0 "
                "there, so min(1, p(x) / q(x)) = 0 and it must be rejected")
    if len(got["accepted"]) < k or (len(got["accepted"]) < len(draft) and draft[len(got["accepted"])] ==
                                    target[len(got["accepted"])]):
        i = len(got["accepted"])
        return (f"you rejected draft token {i} ({draft[i]}), which is the target's token: p(x) = q(x) = 1 there, "
                "so it is accepted with probability 1 (accept when u < p(x) / q(x), u from torch.rand)")
    if k == len(draft):
        if draft and got["next"] == draft[-1]:
            return ("after accepting every draft token you returned the last one again: the next token is the bonus "
                    "token, drawn from p[gamma], the target's row after the last draft token")
        earlier = " (the target's token of an earlier position)" if got["next"] in target[:-1] else ""
        return (f"every draft token was accepted, so the next token is the bonus drawn from p[gamma], the row after "
                f"the last draft token (here the target's token {target[-1]}); yours is {got['next']}{earlier}")
    if got["next"] in target[k + 1:] and got["next"] != target[k]:
        return (f"draft token {k} was rejected, so the step ends there with a token from max(0, p[{k}] - q[{k}]) "
                f"(here {target[k]}); your next token is the target's token of a later position: stop at the first "
                "rejection")
    if got["next"] == draft[k]:
        return ("at the rejection you returned the rejected draft token: draw the replacement from "
                "max(0, p - q), normalised (here the target's token)")
    return (f"at the rejection of draft token {k} the replacement comes from max(0, p[{k}] - q[{k}]), normalised: "
            f"here the target's token {target[k]}")


def _compare_greedy(got, expected, cases):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        where = _describe_greedy(case)
        (got_kind, value), (_, want) = unwrap(g), unwrap(e)
        if got_kind == "raised":
            return Mismatch(f"accept_or_resample raised {str(value).split(':')[0]}",
                            f"on {where}: your code raised {value}")
        if got_kind != "value" or type(value) is not dict:
            return Mismatch("the check recorded a malformed result", f"on {where}: {g!r:.80}")
        if value.get("problem"):
            return Mismatch("accept_or_resample must return (accepted, next_token): a list of accepted draft token "
                            "ids and one token id", f"on {where}: your function {value['problem']}")
        if value.get("changed"):
            return Mismatch("accept_or_resample changed its inputs in place",
                            f"on {where}: {' and '.join(value['changed'])} differed after the call; the loop reads "
                            "them again, so the rule must leave them as it got them")
        if value != want:
            return Mismatch("accept_or_resample gave the wrong step on one-hot (greedy) distributions",
                            f"on {where}: expected accepted={want['accepted']}, next_token={want['next']}; got "
                            f"accepted={value['accepted']}, next_token={value['next']}\n  "
                            + _greedy_problem(case, value, want))
    return None


_ACCEPT_HINT = ("draft tokens are checked in order, each kept with probability min(1, p/q) at its own position; the "
                "first rejection ends the step with a replacement drawn from the target's leftover mass (where p "
                "exceeds q), and when every draft token is kept a bonus token comes from the target's row after the "
                "last one (chapter 09, section “2 · The acceptance rule”). Return the kept draft tokens as a list and "
                "the next token, all as Python ints, and take every random draw from the given generator, which may "
                "be None.")

register(Check(check_id="lab09.accept_greedy", task=_TASKS[4], reference=reference(_SPEC, "accept_or_resample"),
               make_inputs=_greedy_cases, drive=_drive_greedy, compare=_compare_greedy,
               hint=_ACCEPT_HINT + " With one-hot p and q, a draft token is kept exactly when it is the target's "
                                   "token, and the replacement or bonus is the target's token."))


# the distribution of what the rule emits

_DRAWS = 6000
_FAIL_P = 1e-6  # a correct rule fails a statistic this rarely
_FITS_P = 1e-3  # a mistake's own distribution "fits" the learner's counts above this


def _normalised(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def _row(rng: random.Random, vocab: int, zeros: int = 0, sharp: bool = False) -> list[float]:
    weights = [rng.uniform(0.2, 1.0) for _ in range(vocab)]
    if sharp:
        weights[rng.randrange(vocab)] += 6.0
    for i in rng.sample(range(vocab), zeros):
        weights[i] = 0.0
    return [round(x, 6) for x in _normalised(weights)]


def _towards(rng: random.Random, p: list[float], closeness: float) -> list[float]:
    """A draft row: a mix of ``p`` and a random row (``closeness`` 1 gives ``p`` itself)."""
    noise = _row(rng, len(p))
    return [round(x, 6) for x in _normalised([closeness * a + (1 - closeness) * b for a, b in zip(p, noise)])]


def _distribution_case(rng: random.Random, label: str, p: list[list[float]], q: list[list[float]]) -> dict:
    return {"label": label, "p": p, "q": q, "draws": _DRAWS, "seed": rng.randrange(10**6)}


def _distribution_cases(rng: random.Random) -> list[dict]:
    vocab = rng.randint(6, 8)
    close_p = [_row(rng, vocab) for _ in range(3)]
    far_p = [_row(rng, vocab, sharp=True) for _ in range(2)]
    far_q = []
    for row in far_p[:1]:  # the draft prefers the tokens the target likes least
        order = sorted(range(vocab), key=lambda i: row[i])
        weights = [0.0] * vocab
        for rank, i in enumerate(order):
            weights[i] = 2.0 ** (-rank)
        far_q.append([round(x, 6) for x in _normalised(weights)])
    zero_p = [_row(rng, vocab, zeros=2) for _ in range(4)]
    cases = [
        _distribution_case(rng, "a draft close to the target, gamma=2", close_p,
                           [_towards(rng, row, 0.7) for row in close_p[:2]]),
        _distribution_case(rng, "a draft that prefers the target's least likely tokens, gamma=1", far_p, far_q),
        _distribution_case(rng, "a draft with mass on tokens the target never picks (p = 0), gamma=3", zero_p,
                           [_row(rng, vocab) for _ in range(3)]),
    ]
    half_q, half_p = [], []
    for _ in range(2):  # the draft proposes half the tokens, each twice as often as the target: p / q = 1/2
        proposed = set(rng.sample(range(vocab), vocab // 2))
        weights = _normalised([rng.uniform(0.5, 1.0) if i in proposed else 0.0 for i in range(vocab)])
        others = _normalised([0.0 if i in proposed else rng.uniform(0.5, 1.0) for i in range(vocab)])
        half_q.append([round(w, 6) for w in weights])
        half_p.append([round(w / 2 + o / 2, 6) for w, o in zip(weights, others)])
    half_p.append(_row(rng, vocab))
    return cases + [_distribution_case(rng, "a draft that proposes half the tokens, each twice as often as the "
                                            "target wants it, gamma=2", half_p, half_q)]


def _distribution_more_cases(rng: random.Random) -> list[dict]:
    vocab = rng.randint(6, 8)
    soft_p = [_row(rng, vocab) for _ in range(4)]
    one_hot_q = []
    for row in soft_p[:3]:  # a deterministic draft (prompt lookup) under a sampling target
        token = rng.randrange(vocab)
        one_hot_q.append([1.0 if i == token else 0.0 for i in range(vocab)])
    same_p = [_row(rng, vocab) for _ in range(3)]
    missing_q = [_row(rng, vocab, zeros=3) for _ in range(2)]  # the target's tokens the draft never proposes
    sharp_p = [_row(rng, vocab, sharp=True) for _ in range(5)]
    return [
        _distribution_case(rng, "a one-hot draft (prompt lookup) under a sampling target, gamma=3", soft_p, one_hot_q),
        _distribution_case(rng, "a draft whose first row equals the target's, gamma=2", same_p,
                           [list(same_p[0]), _towards(rng, same_p[1], 0.5)]),
        _distribution_case(rng, "a draft that never proposes some of the target's tokens (q = 0), gamma=2",
                           [_row(rng, vocab) for _ in range(3)], missing_q),
        _distribution_case(rng, "a sharp target and a draft close to it, gamma=4", sharp_p,
                           [_towards(rng, row, 0.85) for row in sharp_p[:4]]),
    ]


def _drive_distribution(rule, cases: list[dict]) -> list[dict]:
    """Per case: how many tokens each step accepted, the distribution of each emitted position, the
    token drawn at a rejection of the first draft token, and any malformed or non-prefix step."""
    import torch

    results = []
    for case in cases:
        p, q = torch.tensor(case["p"]), torch.tensor(case["q"])
        gamma, vocab, n = q.shape[0], p.shape[1], case["draws"]
        draft_gen = torch.Generator().manual_seed(case["seed"])
        drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=draft_gen)
                              for i in range(gamma)], dim=1).tolist() if gamma else [[] for _ in range(n)]
        generator = torch.Generator().manual_seed(case["seed"] + 1)
        lengths = [0] * (gamma + 1)
        emitted = [[0] * vocab for _ in range(gamma + 1)]
        resampled = [0] * vocab
        record = {"lengths": lengths, "emitted": emitted, "resampled_first": resampled, "raised": None,
                  "malformed": None, "not_prefix": None, "steps": 0}
        for draft in drafts:
            item = outcome(rule, p.clone(), q.clone(), list(draft), generator)
            if item[0] == "raised":
                record["raised"] = item[1]
                break
            accepted, token, problem = _as_step(item[1], vocab)
            if not problem and len(accepted) == gamma and token is None:
                problem = "returned no next token"
            if problem:
                record["malformed"] = {"draft": draft, "problem": problem,
                                       "all_accepted": accepted is not None and accepted == draft}
                break
            if accepted != draft[:len(accepted)]:
                record["not_prefix"] = {"draft": draft, "accepted": accepted, "next": token}
                break
            record["steps"] += 1
            lengths[len(accepted)] += 1
            for position, t in enumerate(accepted + [token]):
                emitted[position][t] += 1
            if not accepted:
                resampled[token] += 1
        results.append(record)
    return results


# the exact distributions the rule (or a classic mistake) produces, in this process

def _residual(p_row, q_row):
    import torch

    residual = torch.clamp(p_row - q_row, min=0)
    return residual / residual.sum() if residual.sum() > 0 else p_row


def _rule_model(p, q, accept: str = "ratio", resample: str = "residual", bonus: str = "p") -> dict:
    """Exact distributions of a rule's statistics on fixed rows p [gamma + 1, V] and q [gamma, V]:
    the acceptance probability of each position, each emitted position, the first resample."""
    import torch

    gamma = q.shape[0]
    p = p / p.sum(-1, keepdim=True)
    q = q / q.sum(-1, keepdim=True) if gamma else q
    betas, emitted, first_resample = [], [], None
    for i in range(gamma):
        ratio = torch.where(q[i] > 0, torch.clamp(p[i] / torch.where(q[i] > 0, q[i], 1.0), max=1.0), 0.0)
        swapped = torch.where(p[i] > 0, torch.clamp(q[i] / torch.where(p[i] > 0, p[i], 1.0), max=1.0), 1.0)
        keep = {"ratio": ratio, "reversed": torch.where(q[i] > 0, 1 - ratio, 0.0), "always": torch.ones_like(ratio),
                "p": p[i], "deterministic": (p[i] >= q[i]).double(), "swapped": swapped}[accept]
        accepted = q[i] * keep
        beta = float(accepted.sum())
        residual = _residual(p[i], q[i])
        replacement = {"residual": residual, "p": p[i], "reversed": _residual(q[i], p[i]),
                       "argmax": torch.nn.functional.one_hot(residual.argmax(), p.shape[1]).double()}[resample]
        betas.append(min(beta, 1.0))
        emitted.append(accepted + (1 - beta) * replacement)
        if i == 0:
            first_resample = replacement
    last = {"p": p[gamma], "argmax": torch.nn.functional.one_hot(p[gamma].argmax(), p.shape[1]).double(),
            "previous": p[gamma - 1] if gamma else p[gamma]}[bonus]
    emitted.append(last)
    lengths = []
    reach = 1.0
    for beta in betas:
        lengths.append(reach * (1 - beta))
        reach *= beta
    lengths.append(reach)
    return {"lengths": torch.tensor(lengths, dtype=torch.float64), "emitted": emitted,
            "resampled_first": first_resample}


def _shared_draw_lengths(p, q):
    """The distribution of accepted draft tokens per step when one uniform u decides every draft token
    of a step: at least k are kept when u is below each of the first k ratios min(1, p/q), drafts
    drawn independently from their rows of q."""
    import itertools

    import torch

    gamma = q.shape[0]
    options = []  # per position: (probability the draft proposes x, x's acceptance ratio)
    for i in range(gamma):
        ratio = torch.clamp(p[i] / torch.where(q[i] > 0, q[i], 1.0), max=1.0)
        options.append([(float(q[i, x]), float(ratio[x])) for x in range(q.shape[1]) if float(q[i, x]) > 0])
    reach = [1.0]  # reach[k]: the chance that at least k draft tokens are kept
    for k in range(1, gamma + 1):
        reach.append(sum(math.prod(chance for chance, _ in combo) * min(ratio for _, ratio in combo)
                         for combo in itertools.product(*options[:k])))
    return torch.tensor([reach[k] - reach[k + 1] for k in range(gamma)] + [reach[gamma]], dtype=torch.float64)


# (the change from the correct rule, what the learner did and what to do instead)
_MISTAKES = (
    ({"resample": "p"}, ("at a rejection you drew the replacement from p: draw it from max(0, p - q), normalised. "
                         "Drawing from p gives the draft's tokens a second chance, so the output leans towards the "
                         "draft's favourite tokens")),
    ({"resample": "reversed"}, ("at a rejection you drew from max(0, q - p): the replacement comes from the "
                                "target's excess over the draft, max(0, p - q), normalised")),
    ({"resample": "argmax"}, ("at a rejection you took the argmax of max(0, p - q): draw the replacement at random "
                              "from it, in proportion to its (normalised) weights")),
    ({"accept": "reversed"}, ("you keep a draft token when u > p(x) / q(x) (or reject it when u < p(x) / q(x)): "
                              "keep it when u < p(x) / q(x), so that a token the target likes at least as much as "
                              "the draft is always kept")),
    ({"accept": "swapped"}, ("you keep a draft token with probability min(1, q(x) / p(x)), the ratio upside down: "
                             "keep it with probability min(1, p(x) / q(x)), so that a token the target wants at least "
                             "as much as the draft is always kept, and one the draft over-proposes is kept only in "
                             "the proportion p(x) / q(x)")),
    ({"accept": "always"}, ("every draft token is accepted, whatever the target thinks: keep draft token x with "
                            "probability min(1, p(x) / q(x))")),
    ({"accept": "p"}, ("you keep a draft token with probability p(x): the acceptance probability is "
                       "min(1, p(x) / q(x))")),
    ({"accept": "deterministic"}, ("you keep a draft token when p(x) >= q(x), without a random draw: keep it with "
                                   "probability min(1, p(x) / q(x)), decided by a uniform random draw of its own")),
    ({"bonus": "argmax"}, ("when every draft token is accepted you took the argmax of p[gamma]: draw the bonus "
                           "token at random from p[gamma], as the target would sample it")),
    ({"bonus": "previous"}, ("when every draft token is accepted you drew the bonus token from p[gamma - 1]: it "
                             "comes from p[gamma], the target's row after the last draft token")),
)


def chi_square_p_value(counts, probs) -> float:
    """P-value of Pearson's chi-square test of ``counts`` against ``probs``; 0 when a cell of
    probability 0 was observed. Cells expecting fewer than 5 are pooled into one."""
    import torch

    counts = torch.as_tensor(counts, dtype=torch.float64)
    probs = torch.as_tensor(probs, dtype=torch.float64)
    total = float(counts.sum())
    if total == 0:
        return 1.0
    if float(counts[probs <= 1e-12].sum()) > 0:
        return 0.0
    expected = probs * total
    small = (expected < 5) & (probs > 1e-12)
    observed = torch.cat([counts[~small & (probs > 1e-12)], counts[small].sum().reshape(1)])
    expected = torch.cat([expected[~small & (probs > 1e-12)], expected[small].sum().reshape(1)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    if observed.numel() < 2:
        return 1.0
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(observed.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def _statistics(record: dict, model: dict) -> list[tuple[str, list, object]]:
    """(name, observed counts, expected probabilities) for every statistic of one case."""
    stats = [("lengths", record["lengths"], model["lengths"])]
    gamma = len(model["emitted"]) - 1
    for position in range(gamma + 1):
        stats.append((f"position {position}", record["emitted"][position], model["emitted"][position]))
    if gamma:
        stats.append(("resampled_first", record["resampled_first"], model["resampled_first"]))
    return stats


def _worst(record: dict, model: dict) -> tuple[float, str, list, object]:
    worst = (1.0, "", [], None)
    for name, counts, probs in _statistics(record, model):
        value = chi_square_p_value(counts, probs)
        if value < worst[0]:
            worst = (value, name, counts, probs)
    return worst


def _fmt_row(values) -> str:
    return " ".join(f"{float(v):5.3f}" for v in values)


def _table(counts: list, probs, rows: dict) -> str:
    total = sum(counts)
    lines = ["    token:        " + " ".join(f"{i:5d}" for i in range(len(counts)))]
    lines += [f"    {name:13s} " + _fmt_row(values) for name, values in rows.items()]
    lines.append(f"    {'yours':13s} " + _fmt_row([c / total for c in counts]) + f"   ({total} draws)")
    return "\n".join(lines)


def _statistic_text(name: str, gamma: int) -> str:
    if name == "lengths":
        return "the number of draft tokens accepted per step"
    if name == "resampled_first":
        return "the token drawn when the first draft token is rejected"
    position = int(name.split()[1])
    if position == gamma:
        return "the bonus token (drawn after every draft token was accepted)"
    return "the first token of a step" if position == 0 else f"token {position + 1} of a step"


def _describe_distribution(case: dict) -> str:
    return f"{case['label']}, vocabulary of {len(case['p'][0])} tokens, {case['draws']} steps"


def _distribution_problem(case: dict, record: dict) -> Mismatch | None:
    import torch

    where = _describe_distribution(case)
    p, q = torch.tensor(case["p"], dtype=torch.float64), torch.tensor(case["q"], dtype=torch.float64)
    gamma = q.shape[0]
    if type(record) is not dict or "lengths" not in record:
        return Mismatch("the check recorded a malformed result", f"on {where}: {record!r:.80}")
    if record["raised"]:
        return Mismatch(f"accept_or_resample raised {str(record['raised']).split(':')[0]}",
                        f"on {where}: your code raised {record['raised']}")
    if record["malformed"]:
        bad = record["malformed"]
        if bad["all_accepted"] and "next" in bad["problem"]:
            return Mismatch("when every draft token is accepted, still return a next token: the bonus token, drawn "
                            "from p[gamma]", f"on {where}: with draft {bad['draft']} your function {bad['problem']}")
        return Mismatch("accept_or_resample must return (accepted, next_token): a list of accepted draft token ids "
                        "and one token id", f"on {where}: with draft {bad['draft']} your function {bad['problem']}")
    if record["not_prefix"]:
        bad = record["not_prefix"]
        return Mismatch("your accepted tokens are not the draft's first tokens: stop at the first rejection (the "
                        "draft tokens after it were guessed after a token that is not in the output)",
                        f"on {where}: draft {bad['draft']}, your accepted {bad['accepted']}, next {bad['next']}")
    model = _rule_model(p, q)
    value, name, counts, probs = _worst(record, model)
    if value >= _FAIL_P:
        return None
    fitting = []
    for change, message in _MISTAKES:
        mistake = _rule_model(p, q, **change)
        if all(float(torch.as_tensor(a).sub(torch.as_tensor(b)).abs().max()) < 1e-12
               for (_, _, a), (_, _, b) in zip(_statistics(record, model), _statistics(record, mistake))):
            continue  # this mistake changes nothing on this case
        if _worst(record, mistake)[0] > _FITS_P:
            fitting.append(message)
    if fitting:
        named = fitting[0] if len(fitting) == 1 else (
            "on this case it fits more than one known mistake: "
            + "; or ".join(f"({i}) {message}" for i, message in enumerate(fitting, start=1)))
        return Mismatch(f"what your rule emits is not distributed as the target's p: {named}",
                        f"on {where}: {_statistic_text(name, gamma)} (chi-square p-value {value:.2g})\n"
                        + _detail_table(name, counts, probs, p, q))
    if (gamma > 1 and chi_square_p_value(record["lengths"], model["lengths"]) < _FAIL_P
            and chi_square_p_value(record["lengths"], _shared_draw_lengths(p, q)) > _FITS_P):
        return Mismatch("what your rule emits is not distributed as the target's p: one uniform draw decided every "
                        "draft token of a step; each judged token needs a uniform draw of its own, independent of the "
                        "others, or the acceptances of one step stop being independent",
                        f"on {where}: the number of draft tokens accepted per step fits a draw shared by the step "
                        f"(chi-square p-value {chi_square_p_value(record['lengths'], model['lengths']):.2g} against "
                        "independent draws)\n" + _detail_table("lengths", record["lengths"], model["lengths"], p, q))
    steps = record["steps"]
    if name == "lengths" and record["lengths"][gamma] == 0 and float(model["lengths"][gamma]) * steps > 30:
        return Mismatch("no step accepted all its draft tokens: when every draft token is accepted, return them all "
                        "as accepted and draw one more, the bonus token, from p[gamma]",
                        f"on {where}: expected about {float(model['lengths'][gamma]) * steps:.0f} of {steps} steps "
                        f"to accept all {gamma}\n" + _detail_table(name, counts, probs, p, q))
    if name == "lengths":
        mean = sum(k * c for k, c in enumerate(counts)) / max(steps, 1)
        want = float(sum(k * x for k, x in enumerate(model["lengths"])))
        more = "too many" if mean > want else "too few"
        return Mismatch(f"your rule accepts {more} draft tokens: keep draft token x with probability "
                        "min(1, p(x) / q(x))",
                        f"on {where}: {mean:.3f} accepted per step, expected {want:.3f} (sum over positions of the "
                        f"chance that all tokens up to it are kept, each kept with probability sum_x min(p, q))\n"
                        + _detail_table(name, counts, probs, p, q))
    zero = [i for i, c in enumerate(counts) if c and float(probs[i]) <= 1e-12]
    if zero:
        if name == "resampled_first":
            why = ("the replacement is drawn from max(0, p - q), normalised, which is 0 wherever q >= p: a token the "
                   "draft already proposes at least as often as the target wants can never be the replacement")
        elif name == f"position {gamma}":
            why = f"the bonus token is drawn from p[{gamma}], the target's row after the last draft token"
        else:
            why = ("a draft token with p(x) = 0 must always be rejected, and the replacement from max(0, p - q) "
                   "never picks it either")
        return Mismatch(f"{_statistic_text(name, gamma)} came out as a token it can never be",
                        f"on {where}: token {zero[0]} has probability 0 there, yet your rule emitted it "
                        f"{counts[zero[0]]} times; {why}\n" + _detail_table(name, counts, probs, p, q))
    return Mismatch(f"{_statistic_text(name, gamma)} is not distributed as it should be",
                    f"on {where}: chi-square p-value {value:.2g} (a correct rule stays above {_FAIL_P:g})\n"
                    + _detail_table(name, counts, probs, p, q))


def _detail_table(name: str, counts: list, probs, p, q) -> str:
    total = max(sum(counts), 1)
    probs = probs.tolist()
    noise = sum(math.sqrt(x * (1 - x) / total) for x in probs) * math.sqrt(2 / math.pi) / 2
    distance = sum(abs(c / total - x) for c, x in zip(counts, probs)) / 2
    head = (f"  total variation distance {distance:.3f} (sampling noise at {total} draws: about {noise:.3f})\n")
    if name == "lengths":
        return head + _table(counts, probs, {"expected": probs}).replace("token:", "accepted:")
    rows = {}
    if name == "resampled_first":
        rows = {"p[0]": p[0].tolist(), "q[0]": q[0].tolist(), "max(0,p-q) n.": probs}
    else:
        position = int(name.split()[1])
        rows = {f"p[{position}]": probs}
        if position < q.shape[0]:
            rows[f"q[{position}]"] = q[position].tolist()
    return head + _table(counts, probs, rows)


def _compare_distribution(got, expected, cases):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        if g == e:  # the same random draws as the reference: the same output
            continue
        problem = _distribution_problem(case, g)
        if problem:
            return problem
    return None


_DISTRIBUTION_HINT = (_ACCEPT_HINT + " This check runs your rule thousands of times, and each emitted position must "
                      "follow the target's distribution there: resampling a rejection from p itself gives the draft's "
                      "favourite tokens a second chance, and keeping or rejecting without a random draw skews how "
                      "many draft tokens are kept.")

register(Check(check_id="lab09.accept_distribution", task=_TASKS[4], reference=reference(_SPEC, "accept_or_resample"),
               make_inputs=_distribution_cases, drive=_drive_distribution, compare=_compare_distribution,
               hint=_DISTRIBUTION_HINT))
register(Check(check_id="lab09.accept_distribution_more", task=_TASKS[4],
               reference=reference(_SPEC, "accept_or_resample"), make_inputs=_distribution_more_cases,
               drive=_drive_distribution, compare=_compare_distribution,
               hint=_DISTRIBUTION_HINT + " One-hot drafts under a sampling target, a draft row equal to the "
                                         "target's, tokens the draft never proposes, gamma = 4."))


# every draw from the generator: the same seed gives the same steps, whatever the global generator holds

_REPEATS = 200  # steps per run: a rule that draws anything from elsewhere changes some of them


def _generator_cases(rng: random.Random) -> list[dict]:
    vocab = rng.randint(6, 8)
    cases = []
    for gamma in (1, 3):
        p = [_row(rng, vocab) for _ in range(gamma + 1)]
        cases.append({"label": f"a draft close to the target, gamma={gamma}, vocabulary of {vocab} tokens",
                      "p": p, "q": [_towards(rng, row, 0.6) for row in p[:gamma]], "seed": rng.randrange(10**6),
                      "global_seeds": rng.sample(range(10**6), 2)})
    return cases


def _drive_generator(rule, cases: list[dict]) -> list[dict]:
    """Per case, two runs of the same steps with a generator seeded alike, torch's global generator
    seeded differently before each: what each run returned, and whether it left the global state as it
    found it. The kernel's own global state is restored afterwards."""
    import torch

    results = []
    for case in cases:
        p, q = torch.tensor(case["p"]), torch.tensor(case["q"])
        gamma, vocab = q.shape[0], p.shape[1]
        draft_gen = torch.Generator().manual_seed(case["seed"])
        drafts = torch.stack([torch.multinomial(q[i], _REPEATS, replacement=True, generator=draft_gen)
                              for i in range(gamma)], dim=1).tolist()
        runs = []
        with torch.random.fork_rng(devices=[]):
            for global_seed in case["global_seeds"]:
                torch.manual_seed(global_seed)
                before = torch.get_rng_state()
                generator = torch.Generator().manual_seed(case["seed"] + 1)
                steps, problem = [], ""
                for draft in drafts:
                    item = outcome(rule, p.clone(), q.clone(), list(draft), generator)
                    if item[0] == "raised":
                        problem = f"raised {item[1]}"
                        break
                    accepted, token, problem = _as_step(item[1], vocab)
                    if problem:
                        break
                    steps.append([accepted, token])
                runs.append({"steps": steps, "problem": problem,
                             "global_untouched": bool(torch.equal(before, torch.get_rng_state()))})
        results.append({"runs": runs})
    return results


def _compare_generator(got, expected, cases):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g in zip(cases, got):
        where = (f"{case['label']}, {_REPEATS} steps with a generator seeded alike, torch's global generator "
                 f"seeded {case['global_seeds'][0]} before the first run and {case['global_seeds'][1]} before "
                 "the second")
        if type(g) is not dict or len(g.get("runs", [])) != 2:
            return Mismatch("the check recorded a malformed result", f"on {where}: {g!r:.80}")
        first, second = g["runs"]
        for run in (first, second):
            if run["problem"]:
                return Mismatch(f"accept_or_resample {run['problem'].split(':')[0]}",
                                f"on {where}: your function {run['problem']}")
        if not (first["global_untouched"] and second["global_untouched"]):
            return Mismatch("your rule drew from torch's global random generator although it was given a generator",
                            f"on {where}: torch's global generator state changed while your rule ran; a speculative "
                            "run seeded through its generator is then not reproducible")
        if first["steps"] != second["steps"]:
            step = next(i for i, (a, b) in enumerate(zip(first["steps"], second["steps"])) if a != b)
            return Mismatch("the same generator seed gave different steps in two runs",
                            f"on {where}: step {step} returned {first['steps'][step]} in the first run and "
                            f"{second['steps'][step]} in the second; every random draw must come from the generator "
                            "passed in")
    return None


register(Check(check_id="lab09.accept_own_generator", task=_TASKS[4],
               reference=reference(_SPEC, "accept_or_resample"), make_inputs=_generator_cases,
               drive=_drive_generator, compare=_compare_generator,
               hint=("a seeded run must be reproducible: every random draw of the rule, the uniform test of each "
                     "draft token, the replacement and the bonus, comes from the generator passed in, so that the "
                     "same generator seed gives the same steps whatever state torch's global generator (or any "
                     "other source of randomness) is in, and the global generator is left as it was.")))


# the rule inside speculative_decode, greedy on a small random model

def _decoder_case(rng: random.Random) -> dict:
    vocab = TINY["vocab_size"]
    loop = [rng.randrange(vocab) for _ in range(rng.randint(3, 5))]
    return {"seed": rng.randrange(10**6), "runs": [
        {"draft": "layer_skip", "gamma": 3, "new_tokens": 16, "prompt": [rng.randrange(vocab) for _ in range(5)]},
        {"draft": "ngram", "gamma": 4, "new_tokens": 16, "prompt": loop * 3},
    ]}


def _decoder_more_case(rng: random.Random) -> dict:
    vocab = TINY["vocab_size"]
    return {"seed": rng.randrange(10**6), "runs": [
        {"draft": "layer_skip", "gamma": 1, "new_tokens": 12, "prompt": [rng.randrange(vocab)]},
        {"draft": "layer_skip", "gamma": 6, "new_tokens": 9, "prompt": [rng.randrange(vocab) for _ in range(7)]},
        {"draft": "ngram", "gamma": 8, "new_tokens": 20, "prompt": [rng.randrange(vocab) for _ in range(4)] * 4},
    ]}


def _drive_decoder(rule, case: dict) -> list[dict]:
    from infra_lib.model.generation import greedy_decode
    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving.speculative import (
        LayerSkipDraft,
        NgramDraft,
        speculative_decode,
    )

    if not callable(rule):
        raise TypeError(f"check(...) needs your accept_or_resample function, got a {type(rule).__name__}")
    model = tiny_model(case["seed"])
    results = []
    for run in case["runs"]:
        draft = (LayerSkipDraft(model, 1) if run["draft"] == "layer_skip"
                 else NgramDraft(model.config.vocab_size))
        with using_acceptance_rule(rule):
            out = speculative_decode(model, run["prompt"], draft, run["gamma"],
                                     SamplingParams(max_new_tokens=run["new_tokens"]))
        results.append({"tokens": [int(t) for t in out.token_ids], "accepted": out.accepted,
                        "proposed": out.proposed, "passes": out.target_passes,
                        "greedy": greedy_decode(model, run["prompt"], run["new_tokens"])})
    return results


def _compare_decoder(got, expected, case):
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} runs, got {got!r:.80}")
    for run, g, e in zip(case["runs"], got, expected):
        draft = "a draft of the model's first layer" if run["draft"] == "layer_skip" else "a prompt-lookup draft"
        where = (f"the small random model, {draft}, gamma={run['gamma']}, a prompt of {len(run['prompt'])} tokens, "
                 f"{run['new_tokens']} new tokens")
        if g["tokens"] != e["greedy"]:
            note = ""
            if g["accepted"] > e["accepted"]:
                note = ("\n  your rule kept more draft tokens than greedy decoding allows: a draft token that is not "
                        "the target's argmax has p(x) = 0 and must be rejected")
            return Mismatch("greedy speculative decoding with your rule differs from plain greedy decoding",
                            f"on {where}: {token_difference(g['tokens'], e['greedy'])}{note}")
        if g["accepted"] != e["accepted"] or g["passes"] != e["passes"]:
            note = ""
            if g["accepted"] < e["accepted"]:
                note = ("; a draft token equal to the target's greedy token has p(x) / q(x) = 1 and must be kept: "
                        "rejecting it costs a target pass per token")
            return Mismatch("your rule keeps a different number of draft tokens than greedy speculative decoding does",
                            f"on {where}: the same tokens, but {g['accepted']} of {g['proposed']} draft tokens "
                            f"accepted in {g['passes']} target passes, expected {e['accepted']} of {e['proposed']} in "
                            f"{e['passes']}{note}")
    return None


_DECODER_HINT = ("with temperature 0 the loop passes one-hot p and q, and speculative decoding must then reproduce "
                 "plain greedy decoding token for token: a draft token is kept exactly when it is the target's argmax, "
                 "and the step ends with the target's argmax where the agreement stops, or after the last draft token "
                 "(chapter 09, section “2 · The acceptance rule”). The loop may call your rule with fewer draft tokens "
                 "than gamma, even none.")

register(Check(check_id="lab09.speculative_greedy", task=_TASKS[4], reference=reference(_SPEC, "accept_or_resample"),
               make_inputs=_decoder_case, drive=_drive_decoder, compare=_compare_decoder, hint=_DECODER_HINT))
register(Check(check_id="lab09.speculative_greedy_more", task=_TASKS[4],
               reference=reference(_SPEC, "accept_or_resample"), make_inputs=_decoder_more_case,
               drive=_drive_decoder, compare=_compare_decoder,
               hint=_DECODER_HINT + " gamma from 1 to 8, a one-token prompt, and steps cut short by max_new_tokens."))
