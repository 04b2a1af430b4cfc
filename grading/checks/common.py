"""Pieces several labs' checks share: calling an implementation on a list of cases and
comparing numbers with a message that names the case."""

from __future__ import annotations

import contextlib
import math
from typing import Callable

from grading.registry import Mismatch


def reference(module: str, name: str) -> Callable[[], object]:
    """A loader for ``module.name``, imported only when a check needs the reference."""

    def load():
        import importlib

        return getattr(importlib.import_module(module), name)

    load.target = f"{module}:{name}"  # what grading.hidden_reference hides from a sandboxed kernel
    return load


def outcome(fn, *args, **kwargs) -> list:
    """``["value", result]`` or ``["raised", "Type: message"]``; the stub's NotImplementedError and
    a MemoryError propagate (the check machinery reports them as such)."""
    try:
        return ["value", fn(*args, **kwargs)]
    except (NotImplementedError, MemoryError):
        raise
    except Exception as exc:  # the learner's code may raise anything
        return ["raised", f"{type(exc).__name__}: {exc}"[:300]]


def unwrap(item) -> tuple[str, object]:
    """The kind ("value", "raised", "skipped" or "malformed") and payload of a recorded ``outcome``."""
    if type(item) is list and len(item) == 2 and item[0] in ("value", "raised", "skipped"):
        return item[0], item[1]
    return "malformed", item


def is_number(value) -> bool:
    """A plain int or float (not a bool, not a tensor or numpy scalar)."""
    return type(value) in (int, float)


def first_difference(got: list, expected: list) -> int:
    """The index of the first item where two lists differ (the shorter length if one is a prefix)."""
    return next((i for i, (g, e) in enumerate(zip(got, expected)) if g != e), min(len(got), len(expected)))


def call_each(fn, cases: list[list]) -> list:
    return [fn(*case) for case in cases]


def number_mismatch(
    got, expected: list, cases: list, what: str, describe: Callable[[list], str], rel: float, integral: bool = False
) -> Mismatch | None:
    """The first case where ``got`` differs from ``expected`` (relative tolerance ``rel``)."""
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"{what}: expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        if type(g) not in (int, float) or not math.isclose(g, e, rel_tol=rel, abs_tol=0.0):
            return Mismatch(what, f"on {describe(case)}: expected {e!r}, got {g!r}")
        if integral and g != int(g):
            return Mismatch(what + " (a whole number is expected)", f"on {describe(case)}: got {g!r}")
    return None


def array_mismatch(got, expected, what: str, where: str, atol: float, rtol: float = 0.0) -> Mismatch | None:
    """Compare nested lists of numbers (tensors turned into lists): shape first, then values.

    The message names the first differing element, its expected and actual value.
    """
    import numpy as np

    try:
        got_array = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        return Mismatch(what, f"on {where}: the result is not a rectangular array of numbers")
    expected_array = np.asarray(expected, dtype=np.float64)
    if got_array.shape != expected_array.shape:
        return Mismatch(
            what + " (wrong shape)",
            f"on {where}: expected shape {list(expected_array.shape)}, got {list(got_array.shape)}",
        )
    bad = ~np.isclose(got_array, expected_array, atol=atol, rtol=rtol, equal_nan=False)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        worst = float(np.nanmax(np.abs(got_array - expected_array))) if not np.isnan(got_array).all() else float("nan")
        return Mismatch(
            what,
            f"on {where}: {int(bad.sum())} of {bad.size} elements differ; at index {list(index)} "
            f"expected {expected_array[index]:.6g}, got {got_array[index]:.6g} "
            f"(largest difference {worst:.3g}, tolerance {atol:g})",
        )
    return None


def token_difference(got: list[int], expected: list[int]) -> str:
    """Where two token sequences part: "the first 3 tokens agree, then token 4 is 17 instead of 9"."""
    step = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    if step < min(len(got), len(expected)):
        then = f"token {step + 1} is {got[step]} instead of {expected[step]}"
    else:
        then = f"{len(got)} tokens came out instead of {len(expected)}"
    return f"the first {step} tokens agree, then {then} (expected {expected}, got {got})"


def type_mismatch(
    got, cases: list, want: type, what: str, describe: Callable[[list], str], hint: str = ""
) -> Mismatch | None:
    """The first case whose result is not exactly of type ``want`` (a bool is no int, a float no int)."""
    if type(got) is not list:
        return None  # the shape of the results is number_mismatch's to report
    for case, g in zip(cases, got):
        if type(g) is not want:
            return Mismatch(what, f"on {describe(case)}: got {g!r:.40} of type {type(g).__name__}", hint=hint)
    return None


@contextlib.contextmanager
def one_thread():
    """Torch on one thread inside the block. A served model runs many small operations; with two threads on a
    busy machine each of them waits for the slower thread, and a check takes ten times as long (measured)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
