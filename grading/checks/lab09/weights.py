"""The seeded weights lab 09's quantisation checks run on, and how a tensor result is recorded."""

from __future__ import annotations

import math
import random

# --- weights ----------------------------------------------------------------------------------------


def weight(case: dict):
    """The seeded weight a case describes: normal values, outlier input channels, zeroed groups."""
    import torch

    gen = torch.Generator().manual_seed(case["seed"])
    rows, cols = case["shape"]
    w = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * case["std"]
    for col in case.get("outlier_columns", []):  # an outlier channel: large across every row
        w[:, col] *= case["outlier_factor"]
    for row, group in case.get("zero_groups", []):
        g = case["group"]
        w[row, group * g : (group + 1) * g] = 0.0
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


def describe_weight(case: dict) -> str:
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


def weight_case(rng: random.Random, rows: int, cols: int, group: int, **extra) -> dict:
    case = {
        "seed": rng.randrange(10**6),
        "shape": [rows, cols],
        "group": group,
        "std": rng.choice([0.02, 0.05, 0.5, 1.0]),
        **extra,
    }
    if "outlier_columns" in extra:
        case.setdefault("outlier_factor", float(rng.randint(10, 40)))
    return case


def groups(rows: int, cols: int, group: int, rng: random.Random, count: int) -> list[list[int]]:
    picked = {(rng.randrange(rows), rng.randrange(cols // group)) for _ in range(count)}
    return [list(p) for p in sorted(picked)]


def tensor_result(value, name: str, who: str) -> dict:
    import torch

    if not isinstance(value, torch.Tensor):
        return {"problem": f"{who}'s {name} must be a torch.Tensor, got {type(value).__name__}"}
    return {"dtype": str(value.dtype), "values": value.detach().cpu().double().tolist()}


def shape(values) -> list[int]:
    import numpy as np

    return list(np.asarray(values, dtype=np.float64).shape)
