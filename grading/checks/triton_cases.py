"""What the Triton labs' checks (lab 03, lab 15) share: the value tolerances, the learner's error
unwrapped from Triton's, out-of-range accesses in words, the comparison of values, bounds and bytes
moved against the reference kernel's, and the tensors the drivers lay out (strided rows, outputs
filled with a value no kernel writes)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from grading.check import TRAFFIC
from grading.checks.common import array_mismatch
from grading.registry import Mismatch

UNWRITTEN = -7.0  # what every output holds before the launch: an element still -7 was never stored


@dataclass(frozen=True)
class Tolerance:
    """``numpy.isclose``'s test, element by element: |yours - reference| <= atol + rtol × |reference|.

    ``atol`` and ``rtol`` apply when both sides ran in Triton's interpreter, ``gpu_atol`` and
    ``gpu_rtol`` when either ran compiled: GPU maths differs in the last bits, and a float32
    ``tl.dot`` rounds its inputs to TF32 there. The relative part keeps large values fair: near
    1e4, float32's rounding step is about 1e-3.
    """

    atol: float
    rtol: float
    gpu_atol: float
    gpu_rtol: float

    def for_sides(self, g: dict, e: dict) -> tuple[float, float]:
        """(atol, rtol) for a learner's result ``g`` against the reference's ``e``."""
        if g.get("interpreted") is True and e.get("interpreted") is True:
            return self.atol, self.rtol
        return self.gpu_atol, self.gpu_rtol


def plain_error(exc: BaseException, *labs: str) -> BaseException:
    """The error a learner should read: the interpreter wraps the kernel's own exception, and a GPU
    compile of an untouched stub of one of ``labs`` fails on its ``raise`` statement."""
    if type(exc).__name__ == "InterpreterError" and exc.__cause__ is not None:
        exc = exc.__cause__
    for lab in labs:
        stub = re.search(rf"NotImplementedError\((['\"])({lab} task \d+: \w+)\1\)", str(exc))
        if stub:
            exc = NotImplementedError(stub.group(2))
    return exc


# --- out-of-range accesses ----------------------------------------------------------------------------

SIDES = {"before": "before the start of", "after": "past the end of", "between": "in the gaps between the rows of"}


def outside(violation: dict) -> str:
    """A ``Violation.as_dict()`` in words: "loaded past the end of `in_ptr`"."""
    action = "stored" if violation["kind"] == "store" else "loaded"
    if violation["side"] not in SIDES:
        return f"{action} outside its tensors"
    return f"{action} {SIDES[violation['side']]} `{violation['argument']}`"


_MASK_SECTION = "chapter 03, section “6 · Catching a missing mask”"


def mask_hint(violation: dict) -> str:
    """The hint for an access outside a tensor: which argument, and loads and stores told apart."""
    argument = f"`{violation['argument']}`" if violation["side"] in SIDES else "a tensor"
    addresses = (
        "If those lanes are already switched off, look at the addresses instead: each tensor is walked "
        "with its own strides, never with another tensor's or an assumed row length"
    )
    if violation["kind"] == "store":
        return (
            f"a store reached lanes outside {argument}: where a tile or a row hangs over the edge, the store "
            f"must be switched off for the lanes past it. {addresses} ({_MASK_SECTION})."
        )
    return (
        f"a load reached lanes outside {argument} (past an edge, or into the gaps between strided rows): those "
        f"lanes must not be read, and the value they get instead must leave the result unchanged. {addresses} "
        f"({_MASK_SECTION})."
    )


# --- comparing with the reference kernel ----------------------------------------------------------------


def _bounds_problem(name: str, violations: list, where: str) -> Mismatch | None:
    if not violations:
        return None
    what = f"{name} {outside(violations[0])}" + (
        " (and the values reached the output)" if violations[0]["kind"] == "load" else ""
    )
    details = "; ".join(f"{outside(v)}: {v['elements']} element(s)" for v in violations)
    return Mismatch(what, f"on {where}: {details}", hint=mask_hint(violations[0]))


def _values_problem(name: str, g: dict, e: dict, where: str, tolerance: Tolerance, nan_hint: str) -> Mismatch | None:
    import numpy as np

    loads = [v for v in g["violations"] if v["kind"] == "load"]
    if loads:  # out-of-range values reached the output: that is the error to fix first
        return Mismatch(
            f"{name} {outside(loads[0])}, and those values reached its output",
            f"on {where}: " + "; ".join(f"{outside(v)}: {v['elements']} output element(s) affected" for v in loads),
            hint=mask_hint(loads[0]),
        )
    note = f" (it also {outside(g['violations'][0])})" if g["violations"] else ""
    # a store outside a tensor is the mistake to name: its hint, not the NaN hint or the check's own
    stores = [v for v in g["violations"] if v["kind"] == "store"]
    store_hint = mask_hint(stores[0]) if stores else ""
    got, expected = np.asarray(g["out"], dtype=np.float64), np.asarray(e["out"], dtype=np.float64)
    if got.shape == expected.shape and (np.isfinite(expected) & ~np.isfinite(got)).any():
        bad = int((np.isfinite(expected) & ~np.isfinite(got)).sum())
        return Mismatch(
            f"{name} returned NaN or inf where the result is finite{note}",
            f"on {where}: {bad} of {got.size} elements",
            hint=store_hint or nan_hint,
        )
    atol, rtol = tolerance.for_sides(g, e)
    problem = array_mismatch(
        g["out"], e["out"], f"{name}'s output differs from the reference{note}", where, atol=atol, rtol=rtol
    )
    return replace(problem, hint=store_hint) if problem and store_hint else problem


def compare_values(name: str, describe, tolerance: Tolerance, nan_hint: str = ""):
    """Each case's output within ``tolerance`` of the reference's. ``nan_hint`` is the hint for NaN or
    inf where the result is finite (empty: the check's own)."""

    def compare(got, expected, cases):
        for case, g, e in zip(cases, got, expected):
            problem = _values_problem(name, g, e, describe(case), tolerance, nan_hint)
            if problem:
                return problem
        return None

    return compare


def compare_bounds(name: str, describe):
    """No case's launch loaded or stored outside its tensors."""

    def compare(got, expected, cases):
        for case, g in zip(cases, got):
            problem = _bounds_problem(name, g["violations"], describe(case))
            if problem:
                return problem
        return None

    return compare


VALUES_FIRST = (
    "this check counts bytes only once the output is right, and here it is not: fix the values "
    "first (the value checks name the first difference), then come back to the traffic."
)


def _excess(g: dict, e: dict, by_argument: str) -> list[tuple[str, int, int]]:
    """(argument, bytes counted, the reference's bytes) for each argument the kernel moved more of."""
    got, expected = g.get(by_argument, {}), e.get(by_argument, {})
    return [
        (argument, n, expected.get(argument, 0)) for argument, n in sorted(got.items()) if n > expected.get(argument, 0)
    ]


def compare_traffic(
    name: str, describe, budget: str, tolerance: Tolerance, nan_hint: str = "", excess_hints: dict | None = None
):
    """Values, then bounds, then bytes; an excess names the argument(s) read or written more than the reference
    does, with ``excess_hints[argument]`` as the hint (which axis usually overruns; absent: the check's own)."""
    values, bounds = compare_values(name, describe, tolerance, nan_hint), compare_bounds(name, describe)

    def compare(got, expected, cases):
        problem = values(got, expected, cases)
        if problem:  # a mask or a NaN keeps its own hint; any other difference: values before bytes
            return problem if problem.hint else Mismatch(problem.what, problem.detail, hint=VALUES_FIRST)
        problem = bounds(got, expected, cases)
        if problem:
            return problem
        for case, g, e in zip(cases, got, expected):
            if "bytes_loaded" not in g:
                return Mismatch(
                    f"{name}'s traffic was not counted: Triton runs compiled here",
                    "start Jupyter with TRITON_INTERPRET=1 to count bytes in the interpreter",
                )
            if "bytes_loaded" not in e:
                return Mismatch(
                    f"{name}'s bytes were counted but the reference's were not, so there is no budget "
                    "to hold them to: the grader ran the reference compiled (not a fault of your "
                    "kernel; grade with TRITON_INTERPRET=1 set)",
                    f"on {describe(case)}: counted {g['bytes_loaded']:,} bytes loaded and {g['bytes_stored']:,} stored",
                )
            for key, by_argument, verb, way in (
                ("bytes_loaded", "loaded_from", "loads", "from"),
                ("bytes_stored", "stored_to", "stores", "to"),
            ):
                if g[key] <= e[key]:
                    continue
                excess = _excess(g, e, by_argument)
                named = " and ".join(f"`{a}`" if a else "addresses outside its tensors" for a, _, _ in excess)
                per_argument = "; ".join(
                    f"{n:,} bytes {way} `{a}`, the reference {verb} {r:,}" if a else f"{n:,} bytes outside its tensors"
                    for a, n, r in excess
                )
                hint = (excess_hints or {}).get(excess[0][0], "") if excess else ""
                return Mismatch(
                    f"{name} {verb} more bytes than it needs"
                    + (f" {way} {named}" if named else "")
                    + " (its output is right)",
                    f"on {describe(case)}: counted {g[key]:,} bytes, the budget is {e[key]:,} "
                    f"({budget})" + (f": {per_argument}" if per_argument else ""),
                    hint=hint,
                    reason=TRAFFIC,
                )
        return None

    return compare


# --- the tensors a driver lays out ------------------------------------------------------------------------


def seeded_tensor(seed: int, *shape, scale: float = 1.0):
    """Seeded normal float32 values times ``scale``, on the device kernels run on."""
    import torch

    from infra_lib.kernels.triton_env import kernel_device

    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(kernel_device())


def with_row_gaps(x, pad: int):
    """x as a view with row stride cols + pad: pad > 0 leaves gaps between the rows."""
    import torch

    if pad == 0:
        return x
    wide = torch.zeros(x.shape[0], x.shape[1] + pad, dtype=x.dtype, device=x.device)
    wide[:, : x.shape[1]] = x
    return wide[:, : x.shape[1]]


def empty_rows(like, cols: int, pad: int):
    """An output of ``like``'s rows and ``cols`` columns, row stride cols + pad, every element UNWRITTEN."""
    import torch

    return torch.full((like.shape[0], cols + pad), UNWRITTEN, device=like.device)[:, :cols]


def row_block(n: int) -> int:
    """The BLOCK a row of ``n`` elements is launched with: ``n`` rounded up to a power of two."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
