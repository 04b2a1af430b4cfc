"""Pieces several labs' checks share: calling an implementation on a list of cases and
comparing numbers with a message that names the case."""

from __future__ import annotations

import math
from typing import Callable

from grading.registry import Mismatch


def reference(module: str, name: str) -> Callable[[], object]:
    """A loader for ``module.name``, imported only when a check needs the reference."""

    def load():
        import importlib

        return getattr(importlib.import_module(module), name)

    return load


def call_each(fn, cases: list[list]) -> list:
    return [fn(*case) for case in cases]


def number_mismatch(got, expected: list, cases: list, what: str, describe: Callable[[list], str],
                    rel: float, integral: bool = False) -> Mismatch | None:
    """The first case where ``got`` differs from ``expected`` (relative tolerance ``rel``)."""
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"{what}: expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        if type(g) not in (int, float) or not math.isclose(g, e, rel_tol=rel, abs_tol=0.0):
            return Mismatch(what, f"on {describe(case)}: expected {e!r}, got {g!r}")
        if integral and g != int(g):
            return Mismatch(what + " (a whole number is expected)", f"on {describe(case)}: got {g!r}")
    return None
