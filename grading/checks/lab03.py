"""Checks for lab 03 (Triton): the fused softmax, tiled matmul and RMSNorm kernels.

Each driver launches the learner's @triton.jit kernel itself, with the grid and block sizes
the task states, on seeded shapes that are not multiples of the blocks; the reference
kernel is launched the same way. Every launch goes through ``check_bounds``: each tensor
sits between guard bands, so a missing mask is reported by name instead of corrupting the
kernel's memory; in the interpreter ``count_traffic`` also counts the bytes moved, per argument.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from grading.check import TRAFFIC
from grading.checks.common import array_mismatch, reference
from grading.registry import Check, Mismatch, register, register_shortcuts

register_shortcuts("lab03", [
    "infra_lib.kernels.softmax:softmax",
    "infra_lib.kernels.softmax:softmax_three_pass",
    "infra_lib.kernels.softmax:online_softmax_kernel",  # lab 15's reference: a softmax in one pass
    "infra_lib.kernels.matmul:matmul",
    "infra_lib.kernels.rmsnorm:rmsnorm",
])

_SIGNATURES = {
    "softmax_kernel": ["out_ptr", "in_ptr", "n_cols", "in_row_stride", "out_row_stride", "BLOCK"],
    "matmul_kernel": ["a_ptr", "b_ptr", "c_ptr", "M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn",
                      "stride_cm", "stride_cn", "BLOCK_M", "BLOCK_N", "BLOCK_K"],
    "rmsnorm_kernel": ["out_ptr", "x_ptr", "w_ptr", "n_cols", "x_row_stride", "out_row_stride", "eps", "BLOCK"],
}
_SIDES = {"before": "before the start of", "after": "past the end of", "between": "in the gaps between the rows of"}


@dataclass(frozen=True)
class Tolerance:
    """``numpy.isclose``'s test, element by element: |yours - reference| <= atol + rtol × |reference|.

    ``atol`` and ``rtol`` apply when both sides ran in Triton's interpreter, ``gpu_atol`` and
    ``gpu_rtol`` when either ran compiled: GPU maths differs in the last bits, and a float32
    ``tl.dot`` rounds its inputs to TF32 there.
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

    @classmethod
    def from_atols(cls, atol: float, gpu_atol: float) -> "Tolerance":
        """Two absolute tolerances, each with the relative one max(atol, 1e-4) (what lab 15 passes)."""
        return cls(atol, max(atol, 1e-4), gpu_atol, max(gpu_atol, 1e-4))


# Each kernel's value tolerances: what the lab's text states for each task (tests/test_lab03_rules.py
# reads them back from the text), and what every value comparison of that kernel uses.
TOLERANCES = {"softmax_kernel": Tolerance(atol=1e-6, rtol=1e-4, gpu_atol=1e-5, gpu_rtol=1e-4),
              "matmul_kernel": Tolerance(atol=1e-4, rtol=1e-4, gpu_atol=3e-2, gpu_rtol=3e-2),
              "rmsnorm_kernel": Tolerance(atol=1e-5, rtol=1e-4, gpu_atol=1e-4, gpu_rtol=1e-4)}


# --- launching a learner's kernel -----------------------------------------------------------------

def _plain_error(exc: BaseException) -> BaseException:
    """The error a learner should read: the interpreter wraps the kernel's own exception, and a GPU
    compile of the untouched stub fails on its ``raise`` statement."""
    if type(exc).__name__ == "InterpreterError" and exc.__cause__ is not None:
        return exc.__cause__
    stub = re.search(r"NotImplementedError\((['\"])(lab03 task \d+: \w+)\1\)", str(exc))
    return NotImplementedError(stub.group(2)) if stub else exc


def _require_kernel(kernel, name: str) -> None:
    if not (hasattr(kernel, "run") and hasattr(kernel, "__getitem__")):
        raise TypeError(f"{name} must be a Triton kernel: put @triton.jit on the line above `def {name}(...)` "
                        f"(got {type(kernel).__name__})")
    names = list(getattr(kernel, "arg_names", []))
    if names != _SIGNATURES[name]:
        raise TypeError(f"{name} must take the parameters ({', '.join(_SIGNATURES[name])}) in that order, "
                        f"got ({', '.join(names)})")


def _guarded_launch(kernel, grid, args, meta) -> list[dict]:
    """Launch with guard bands around every tensor; return the out-of-range accesses found."""
    from infra_lib.kernels.oob import check_bounds

    try:
        report = check_bounds(kernel, grid, *args, raise_on_error=False, **meta)
    except Exception as exc:  # the learner's kernel may raise anything
        raise _plain_error(exc) from None
    return [v.as_dict() for v in report.violations]


def _driver(name: str, setup, count_traffic: bool = False):
    """A drive: for each case, ``setup(case) -> (out, grid, args, meta)``, one guarded launch, and
    {"out": values, "violations": [...], "interpreted": bool} (+ the traffic, when counted).

    Where Triton compiles, a kernel that a module defines (the reference) is driven in Triton's
    interpreter in a child Python when the bytes are to be counted: a sandboxed learner's kernel
    always runs interpreted, with its bytes counted, and they are judged against the reference's."""

    def drive(kernel, cases):
        from infra_lib.kernels.traffic import count_traffic as counting
        from infra_lib.kernels.triton_env import interpreter_active

        _require_kernel(kernel, name)
        if count_traffic and not interpreter_active() and _import_path(kernel):
            return _drive_interpreted(name, setup, _import_path(kernel), cases)
        results = []
        for case in cases:
            out, grid, args, meta = setup(case)
            result = {"interpreted": interpreter_active()}
            if count_traffic and result["interpreted"]:
                with counting() as traffic:
                    result["violations"] = _guarded_launch(kernel, grid, args, meta)
                result.update(bytes_loaded=traffic.bytes_loaded, bytes_stored=traffic.bytes_stored,
                              loaded_from=dict(traffic.loaded_from), stored_to=dict(traffic.stored_to))
            else:
                result["violations"] = _guarded_launch(kernel, grid, args, meta)
            result["out"] = out.cpu().double().tolist()
            results.append(result)
        return results

    return drive


def _import_path(kernel) -> str | None:
    """"module:name" of a module's kernel; None for one defined elsewhere (a notebook's: a learner's)."""
    function = getattr(kernel, "fn", None)
    module = sys.modules.get(getattr(function, "__module__", None) or "")
    name = getattr(function, "__name__", "")
    if module is None or module.__name__ == "__main__" or getattr(module, name, None) is not kernel:
        return None
    return f"{module.__name__}:{name}"


_CHILD = "import sys; from grading.checks import lab03; lab03._drive_request(sys.argv[1])"
_CHILD_TIMEOUT_S = 600


def _drive_interpreted(name: str, setup, kernel_path: str, cases) -> list[dict]:
    """The drive of ``kernel_path`` in a fresh Python that sees no GPU, so that Triton interprets it and
    its bytes are counted, as a sandboxed kernel's are.

    Raises:
        RuntimeError: the child failed (the grader then reports the reference's failure, not the learner's).
    """
    from infra_lib.kernels.triton_env import INTERPRET_ENV

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, INTERPRET_ENV: "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    with tempfile.TemporaryDirectory(prefix="lab03-traffic-") as folder:
        request = Path(folder) / "request.json"
        request.write_text(json.dumps({"name": name, "setup": setup.__name__, "kernel": kernel_path,
                                       "cases": cases}))
        try:
            done = subprocess.run([sys.executable, "-c", _CHILD, str(request)], env=env, cwd=root,
                                  capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"counting the bytes of {kernel_path} in Triton's interpreter took over "
                               f"{_CHILD_TIMEOUT_S} s") from exc
        if done.returncode != 0:
            raise RuntimeError(f"counting the bytes of {kernel_path} in Triton's interpreter (Triton compiles here, "
                               f"so a child Python counts them) failed: {done.stderr.strip()[-800:]}")
        return json.loads((Path(folder) / "result.json").read_text())


def _drive_request(path: str) -> None:
    """In the child of ``_drive_interpreted``: drive the request at ``path``, write result.json beside it."""
    from infra_lib.kernels.triton_env import interpreter_active, load_triton

    load_triton()
    if not interpreter_active():
        raise RuntimeError("Triton still compiles in the child: its bytes cannot be counted")
    request = json.loads(Path(path).read_text())
    module, name = request["kernel"].split(":")
    kernel = getattr(importlib.import_module(module), name)
    setup = {f.__name__: f for f in (_softmax_setup, _matmul_setup, _rmsnorm_setup)}[request["setup"]]
    results = _driver(request["name"], setup, count_traffic=True)(kernel, request["cases"])
    Path(path).with_name("result.json").write_text(json.dumps(results))


# --- comparing ------------------------------------------------------------------------------------

def _outside(violation: dict) -> str:
    action = "stored" if violation["kind"] == "store" else "loaded"
    if violation["side"] not in _SIDES:
        return f"{action} outside its tensors"
    return f"{action} {_SIDES[violation['side']]} `{violation['argument']}`"


_MASK_SECTION = "chapter 03, section “6 · Catching a missing mask”"


def _mask_hint(violation: dict) -> str:
    """The hint for an access outside a tensor: which argument, and loads and stores told apart."""
    argument = f"`{violation['argument']}`" if violation["side"] in _SIDES else "a tensor"
    addresses = ("If those lanes are already switched off, look at the addresses instead: each tensor is walked "
                 "with its own strides, never with another tensor's or an assumed row length")
    if violation["kind"] == "store":
        return (f"a store reached lanes outside {argument}: where a tile or a row hangs over the edge, the store "
                f"must be switched off for the lanes past it. {addresses} ({_MASK_SECTION}).")
    return (f"a load reached lanes outside {argument} (past an edge, or into the gaps between strided rows): those "
            f"lanes must not be read, and the value they get instead must leave the result unchanged. {addresses} "
            f"({_MASK_SECTION}).")


def _bounds_problem(name: str, violations: list, where: str) -> Mismatch | None:
    if not violations:
        return None
    what = f"{name} {_outside(violations[0])}" + (" (and the values reached the output)"
                                                  if violations[0]["kind"] == "load" else "")
    details = "; ".join(f"{_outside(v)}: {v['elements']} element(s)" for v in violations)
    return Mismatch(what, f"on {where}: {details}", hint=_mask_hint(violations[0]))


def _values_problem(name: str, g: dict, e: dict, where: str, tolerance: Tolerance,
                    nan_hint: str) -> Mismatch | None:
    import numpy as np

    loads = [v for v in g["violations"] if v["kind"] == "load"]
    if loads:  # out-of-range values reached the output: that is the error to fix first
        return Mismatch(f"{name} {_outside(loads[0])}, and those values reached its output",
                        f"on {where}: " + "; ".join(f"{_outside(v)}: {v['elements']} output element(s) affected"
                                                    for v in loads), hint=_mask_hint(loads[0]))
    note = f" (it also {_outside(g['violations'][0])})" if g["violations"] else ""
    # a store outside a tensor is the mistake to name: its hint, not the NaN hint or the check's own
    stores = [v for v in g["violations"] if v["kind"] == "store"]
    store_hint = _mask_hint(stores[0]) if stores else ""
    got, expected = np.asarray(g["out"], dtype=np.float64), np.asarray(e["out"], dtype=np.float64)
    if got.shape == expected.shape and (np.isfinite(expected) & ~np.isfinite(got)).any():
        bad = int((np.isfinite(expected) & ~np.isfinite(got)).sum())
        return Mismatch(f"{name} returned NaN or inf where the result is finite{note}",
                        f"on {where}: {bad} of {got.size} elements", hint=store_hint or nan_hint)
    atol, rtol = tolerance.for_sides(g, e)
    problem = array_mismatch(g["out"], e["out"], f"{name}'s output differs from the reference{note}", where,
                             atol=atol, rtol=rtol)
    return replace(problem, hint=store_hint) if problem and store_hint else problem


def _compare_values(name: str, describe, tolerance: Tolerance, nan_hint: str = ""):
    """Each case's output within ``tolerance`` of the reference's. ``nan_hint`` is the hint for NaN or
    inf where the result is finite (empty: the check's own)."""
    def compare(got, expected, cases):
        for case, g, e in zip(cases, got, expected):
            problem = _values_problem(name, g, e, describe(case), tolerance, nan_hint)
            if problem:
                return problem
        return None

    return compare


def _compare_bounds(name: str, describe):
    def compare(got, expected, cases):
        for case, g in zip(cases, got):
            problem = _bounds_problem(name, g["violations"], describe(case))
            if problem:
                return problem
        return None

    return compare


_VALUES_FIRST = ("this check counts bytes only once the output is right, and here it is not: fix the values "
                 "first (the value checks name the first difference), then come back to the traffic.")


def _excess(g: dict, e: dict, by_argument: str) -> list[tuple[str, int, int]]:
    """(argument, bytes counted, the reference's bytes) for each argument the kernel moved more of."""
    got, expected = g.get(by_argument, {}), e.get(by_argument, {})
    return [(argument, n, expected.get(argument, 0)) for argument, n in sorted(got.items())
            if n > expected.get(argument, 0)]


def _compare_traffic(name: str, describe, budget: str, atol: Tolerance | float, gpu_atol: float | None = None,
                     nan_hint: str = "", excess_hints: dict | None = None):
    """Values, then bounds, then bytes; an excess names the argument(s) read or written more than the reference
    does, with ``excess_hints[argument]`` as the hint (which axis usually overruns; absent: the check's own).
    ``atol`` is the kernel's ``Tolerance``, or its interpreted atol with ``gpu_atol`` the compiled one."""
    tolerance = atol if isinstance(atol, Tolerance) else Tolerance.from_atols(atol, gpu_atol)
    values, bounds = _compare_values(name, describe, tolerance, nan_hint), _compare_bounds(name, describe)

    def compare(got, expected, cases):
        problem = values(got, expected, cases)
        if problem:  # a mask or a NaN keeps its own hint; any other difference: values before bytes
            return problem if problem.hint else Mismatch(problem.what, problem.detail, hint=_VALUES_FIRST)
        problem = bounds(got, expected, cases)
        if problem:
            return problem
        for case, g, e in zip(cases, got, expected):
            if "bytes_loaded" not in g:
                return Mismatch(f"{name}'s traffic was not counted: Triton runs compiled here",
                                "start Jupyter with TRITON_INTERPRET=1 to count bytes in the interpreter")
            if "bytes_loaded" not in e:
                return Mismatch(f"{name}'s bytes were counted but the reference's were not, so there is no budget "
                                "to hold them to: the grader ran the reference compiled (not a fault of your "
                                "kernel; grade with TRITON_INTERPRET=1 set)",
                                f"on {describe(case)}: counted {g['bytes_loaded']:,} bytes loaded and "
                                f"{g['bytes_stored']:,} stored")
            for key, by_argument, verb, way in (("bytes_loaded", "loaded_from", "loads", "from"),
                                                ("bytes_stored", "stored_to", "stores", "to")):
                if g[key] <= e[key]:
                    continue
                excess = _excess(g, e, by_argument)
                named = " and ".join(f"`{a}`" if a else "addresses outside its tensors" for a, _, _ in excess)
                per_argument = "; ".join(f"{n:,} bytes {way} `{a}`, the reference {verb} {r:,}" if a else
                                         f"{n:,} bytes outside its tensors" for a, n, r in excess)
                hint = (excess_hints or {}).get(excess[0][0], "") if excess else ""
                return Mismatch(f"{name} {verb} more bytes than it needs" + (f" {way} {named}" if named else "")
                                + " (its output is right)",
                                f"on {describe(case)}: counted {g[key]:,} bytes, the budget is {e[key]:,} "
                                f"({budget})" + (f": {per_argument}" if per_argument else ""),
                                hint=hint, reason=TRAFFIC)
        return None

    return compare


# --- inputs ---------------------------------------------------------------------------------------

def _tensor(seed: int, *shape, scale: float = 1.0):
    import torch

    from infra_lib.kernels.triton_env import kernel_device

    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(kernel_device())


def _with_row_gaps(x, pad: int):
    """x as a view with row stride cols + pad: pad > 0 leaves gaps between the rows."""
    import torch

    if pad == 0:
        return x
    wide = torch.zeros(x.shape[0], x.shape[1] + pad, dtype=x.dtype, device=x.device)
    wide[:, :x.shape[1]] = x
    return wide[:, :x.shape[1]]


def _empty_rows(like, cols: int, pad: int):
    import torch

    return torch.full((like.shape[0], cols + pad), -7.0, device=like.device)[:, :cols]


def _block(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# --- task 1: softmax_kernel -------------------------------------------------------------------------

def _softmax_case(rng: random.Random, rows: int, cols: int, *, pad: int = 0, out_pad: int = 0,
                  scale: float = 3.0, special: str = "") -> dict:
    return {"seed": rng.randrange(10**6), "rows": rows, "cols": cols, "pad": pad, "out_pad": out_pad,
            "scale": scale, "special": special}


def _softmax_shapes(rng):
    return [_softmax_case(rng, 1, 1), _softmax_case(rng, 1, rng.randint(100, 300)),
            _softmax_case(rng, rng.randint(3, 9), 1),
            _softmax_case(rng, rng.randint(20, 40), rng.randint(129, 255)),
            _softmax_case(rng, rng.randint(5, 12), rng.randint(33, 63), pad=rng.randint(1, 40),
                          out_pad=rng.randint(1, 9))]


def _softmax_extremes(rng):
    return [_softmax_case(rng, 8, rng.randint(40, 120), scale=1e4),
            _softmax_case(rng, 6, rng.randint(20, 60), special="huge"),
            _softmax_case(rng, 7, rng.randint(20, 60), special="-inf"),
            _softmax_case(rng, 4, rng.randint(20, 60), scale=100.0, special="one finite")]


def _softmax_bounds_cases(rng):
    return [_softmax_case(rng, rng.randint(3, 8), rng.randint(17, 63), pad=rng.randint(3, 20)),
            _softmax_case(rng, rng.randint(2, 5), rng.randint(129, 200), out_pad=rng.randint(1, 9))]


def _softmax_traffic_cases(rng):
    return [_softmax_case(rng, rng.randint(16, 40), rng.randint(100, 300)), _softmax_case(rng, 3, 1)]


def _softmax_setup(case):
    import torch

    rows, cols, special = case["rows"], case["cols"], case["special"]
    x = _tensor(case["seed"], rows, cols, scale=case["scale"])
    if special == "huge":  # every logit near 1e4: exp overflows without the max subtraction
        x = x / case["scale"] * 0.5 + 1e4
    elif special in ("-inf", "one finite"):
        generator = torch.Generator().manual_seed(case["seed"] + 1)
        hide = (torch.rand(rows, cols, generator=generator) < 0.6 if special == "-inf"
                else torch.ones(rows, cols, dtype=torch.bool))
        hide[torch.arange(rows), torch.randint(0, cols, (rows,), generator=generator)] = False  # one finite per row
        x = x.masked_fill(hide.to(x.device), float("-inf"))
    x = _with_row_gaps(x, case["pad"])
    out = _empty_rows(x, cols, case["out_pad"])
    return out, (rows,), (out, x, cols, x.stride(0), out.stride(0)), {"BLOCK": _block(cols)}


def _describe_softmax(case) -> str:
    extra = {"huge": ", every logit near 1e4", "-inf": ", many logits -inf",
             "one finite": ", all but one logit per row -inf"}.get(case["special"], "")
    scale = f", logits of scale {case['scale']:g}" if case["scale"] >= 100 and not extra else ""
    return (f"x of shape [{case['rows']}, {case['cols']}] (in_row_stride {case['cols'] + case['pad']}, out_row_stride "
            f"{case['cols'] + case['out_pad']}){extra}{scale}, grid ({case['rows']},), BLOCK={_block(case['cols'])}")


_SOFTMAX = reference("infra_lib.kernels.softmax", "softmax_kernel")
_SOFTMAX_HINT = ("one program owns one row, and each row starts one row stride after the previous one, with separate "
                 "strides for the input and the output that may exceed n_cols; lanes past n_cols must be switched off "
                 "and must load a value that changes neither the row's max nor its sum. Shapes here: [1, 1], one row, "
                 "one column, widths that are not a power of two, strided rows (chapter 03, section “4 · Fused "
                 "softmax: the same maths, half the bytes”).")

_SOFTMAX_NAN_HINT = ("a NaN or inf where every probability is finite comes from the exponential: without each row "
                     "shifted by its own maximum first, exp overflows float32 above about 88 and inf / inf is NaN; "
                     "a padded lane that loads a value which changes the row's max or sum spoils the row the same "
                     "way (chapter 03, section “4 · Fused softmax: the same maths, half the bytes”).")

register(Check(
    check_id="lab03.softmax_odd_shapes", task="lab03 task 1: softmax_kernel", reference=_SOFTMAX,
    make_inputs=_softmax_shapes, drive=_driver("softmax_kernel", _softmax_setup),
    compare=_compare_values("softmax_kernel", _describe_softmax, TOLERANCES["softmax_kernel"], _SOFTMAX_NAN_HINT),
    hint=_SOFTMAX_HINT,
))

_MINUS_INF_HINT = ("a -inf logit is a key that must not be attended at all: exp of -inf after the shift is exactly 0, "
                   "and that 0 must reach the output unchanged; a floor or a small constant added to the probabilities "
                   "gives such a key a weight after all (chapter 03, section “4 · Fused softmax: the same maths, half "
                   "the bytes”).")


def _compare_softmax_extremes(got, expected, cases) -> Mismatch | None:
    """Values as every softmax check compares them; then, in the rows with -inf logits, a probability of
    exactly 0 for each of them (the reference's zeros there are the -inf positions: the finite logits of
    those cases are too close together to underflow)."""
    import numpy as np

    problem = _compare_values("softmax_kernel", _describe_softmax, TOLERANCES["softmax_kernel"],
                              _SOFTMAX_NAN_HINT)(got, expected, cases)
    if problem:
        return problem
    for case, g, e in zip(cases, got, expected):
        if case["special"] not in ("-inf", "one finite"):
            continue
        mine, want = np.asarray(g["out"], dtype=np.float64), np.asarray(e["out"], dtype=np.float64)
        leaked = (want == 0) & (mine != 0)
        if leaked.any():
            index = tuple(int(i) for i in np.argwhere(leaked)[0])
            return Mismatch("softmax_kernel gave a -inf logit a probability other than exactly 0",
                            f"on {_describe_softmax(case)}: {int(leaked.sum())} of {int((want == 0).sum())} -inf "
                            f"logits; at index {list(index)} expected 0, got {mine[index]:.3g}", hint=_MINUS_INF_HINT)
    return None


register(Check(
    check_id="lab03.softmax_extreme_values", task="lab03 task 1: softmax_kernel", reference=_SOFTMAX,
    make_inputs=_softmax_extremes, drive=_driver("softmax_kernel", _softmax_setup),
    compare=_compare_softmax_extremes,
    hint="exp overflows float32 for any logit above about 88 (and inf / inf is NaN), so each row must be shifted by "
    "its own true maximum before the exponential; a padded lane must never become that maximum. -inf logits must "
    "come out as probability 0, even in a row where only one logit is finite. Cases: logits of scale 1e4, every "
    "logit near 1e4, many -inf logits, all but one logit per row -inf.",
))

register(Check(
    check_id="lab03.softmax_in_bounds", task="lab03 task 1: softmax_kernel", reference=_SOFTMAX,
    make_inputs=_softmax_bounds_cases, drive=_driver("softmax_kernel", _softmax_setup),
    compare=_compare_bounds("softmax_kernel", _describe_softmax),
    hint="BLOCK is n_cols rounded up to a power of two, so the last lanes of every row lie past its end, in the gap "
    "before the next row or past the tensor: the load and the store both need a mask that switches those lanes off. "
    "Here the rows of x or out are strided, with gaps that the checker watches (chapter 03, section “6 · Catching a "
    "missing mask”).",
))

register(Check(
    check_id="lab03.softmax_reads_once", task="lab03 task 1: softmax_kernel", reference=_SOFTMAX,
    make_inputs=_softmax_traffic_cases, drive=_driver("softmax_kernel", _softmax_setup, count_traffic=True),
    compare=_compare_traffic("softmax_kernel", _describe_softmax,
                             "each element of x read once, each element of out written once",
                             TOLERANCES["softmax_kernel"], nan_hint=_SOFTMAX_NAN_HINT),
    hint="the fused kernel's promise is one trip to memory per element: once loaded, the row stays in registers "
    "until the result is stored, and nothing in between is written out or read again. Lanes past n_cols count as "
    "traffic too unless masked off. Budget: each element of x read once, each element of out written once "
    "(chapter 03, section “4 · Fused softmax: the same maths, half the bytes”).",
))


# --- task 2: matmul_kernel --------------------------------------------------------------------------

def _matmul_case(rng: random.Random, m: int, n: int, k: int, blocks=(32, 32, 32), layout: str = "contiguous") -> dict:
    return {"seed": rng.randrange(10**6), "m": m, "n": n, "k": k, "blocks": list(blocks), "layout": layout}


def _matmul_shapes(rng):
    return [_matmul_case(rng, 1, 1, 1, (16, 16, 16)),
            _matmul_case(rng, rng.randint(40, 70), rng.randint(20, 50), rng.randint(33, 90)),
            _matmul_case(rng, rng.randint(17, 31), rng.randint(9, 15), rng.randint(65, 80), (16, 16, 16)),
            _matmul_case(rng, 64, 32, 64)]


def _matmul_strided(rng):
    return [_matmul_case(rng, rng.randint(33, 60), rng.randint(17, 40), rng.randint(20, 70), layout="transposed"),
            _matmul_case(rng, rng.randint(5, 15), rng.randint(40, 70), rng.randint(33, 50), (16, 32, 16), "transposed")]


def _matmul_block_shapes(rng):
    return [_matmul_case(rng, rng.randint(20, 40), rng.randint(50, 90), rng.randint(17, 40), (16, 64, 16)),
            _matmul_case(rng, rng.randint(50, 90), rng.randint(10, 30), rng.randint(20, 60), (64, 16, 32))]


def _matmul_edge_cases(rng):
    return [_matmul_case(rng, rng.randint(33, 50), rng.randint(17, 30), rng.randint(33, 60), layout="transposed"),
            _matmul_case(rng, rng.randint(3, 12), rng.randint(3, 12), rng.randint(3, 12), (16, 16, 16))]


def _matmul_setup(case):
    import torch

    m, n, k = case["m"], case["n"], case["k"]
    bm, bn, bk = case["blocks"]
    a, b = _tensor(case["seed"], m, k), _tensor(case["seed"] + 1, k, n)
    if case["layout"] == "transposed":  # column-major A, B and C: strides (1, rows)
        a, b = a.t().contiguous().t(), b.t().contiguous().t()
        c = torch.full((n, m), -7.0, device=a.device).t()
    else:
        c = torch.full((m, n), -7.0, device=a.device)
    grid = (-(-m // bm), -(-n // bn))
    return c, grid, (a, b, c, m, n, k, *a.stride(), *b.stride(), *c.stride()), {"BLOCK_M": bm, "BLOCK_N": bn,
                                                                                "BLOCK_K": bk}


def _describe_matmul(case) -> str:
    m, n, k = case["m"], case["n"], case["k"]
    bm, bn, bk = case["blocks"]
    layout = "A, B and C column-major (transposed strides)" if case["layout"] == "transposed" else "contiguous"
    return (f"A [{m}, {k}] @ B [{k}, {n}], {layout}, BLOCK_M={bm}, BLOCK_N={bn}, BLOCK_K={bk}, "
            f"grid ({-(-m // bm)}, {-(-n // bn)})")


_MATMUL = reference("infra_lib.kernels.matmul", "matmul_kernel")
_MATMUL_HINT = ("each program owns one BLOCK_M × BLOCK_N tile of C, built up over the slices of K in a float32 "
                "accumulator that stays in registers until the one store (chapter 03, section “5 · Tiled matrix "
                "multiplication”).")

for check_id, cases, extra in (
        ("lab03.matmul_odd_shapes", _matmul_shapes, " M, N and K are not multiples of the blocks: the edge tiles and "
         "the last step along K hang over A and B, and their outside lanes must contribute nothing to the product, "
         "while C's outside lanes must not be stored."),
        ("lab03.matmul_strided", _matmul_strided, " Every address in A, B and C comes from the strides passed in, "
         "never from an assumed row length such as K or N: here A, B and C are transposed views."),
        ("lab03.matmul_block_shapes", _matmul_block_shapes, " BLOCK_M and BLOCK_N differ here: a tile's rows belong "
         "with the first grid axis and BLOCK_M, its columns with the second and BLOCK_N, so a mix-up that square "
         "tiles hide shows up.")):
    register(Check(
        check_id=check_id, task="lab03 task 2: matmul_kernel", reference=_MATMUL, make_inputs=cases,
        drive=_driver("matmul_kernel", _matmul_setup),
        compare=_compare_values("matmul_kernel", _describe_matmul, TOLERANCES["matmul_kernel"]),
        hint=_MATMUL_HINT + extra,
    ))

_MATMUL_EXCESS_HINTS = {
    argument: f"the loads of {matrix} read more of it than the product needs. {matrix}'s edge tiles reach {axis} "
    f"as well as past K, and those lanes only feed {feeds} of C that the store leaves out, so no value check sees "
    f"them; only the bytes do. Each tile load must stay inside {matrix} along both of its dimensions, and each part "
    "of a tile is read once per step along K (chapter 03, section “5 · Tiled matrix multiplication”)."
    for argument, matrix, axis, feeds in (("a_ptr", "A", "rows past M (its first axis)", "rows"),
                                          ("b_ptr", "B", "columns past N (its second axis)", "columns"))}
_MATMUL_EXCESS_HINTS["c_ptr"] = (
    "each program stores its tile of C once, after the last step along K: the partial sums stay in the float32 "
    "accumulator, inside the program, from one step to the next, so C is neither written nor read back between "
    "steps (chapter 03, section “5 · Tiled matrix multiplication”).")

register(Check(
    check_id="lab03.matmul_in_bounds", task="lab03 task 2: matmul_kernel", reference=_MATMUL,
    make_inputs=_matmul_edge_cases, drive=_driver("matmul_kernel", _matmul_setup),
    compare=_compare_bounds("matmul_kernel", _describe_matmul),
    hint="the tiles at the bottom and right edges, and the last step along K, hang over the matrices: each tile load "
    "needs a mask that keeps it inside its matrix along both of its dimensions, with a fill value that adds nothing "
    "to the product, and the store one that keeps it inside C. Here some matrices are smaller than one block, and "
    "some are transposed views (chapter 03, section “6 · Catching a missing mask”).",
))

register(Check(
    check_id="lab03.matmul_traffic", task="lab03 task 2: matmul_kernel", reference=_MATMUL,
    make_inputs=_matmul_edge_cases, drive=_driver("matmul_kernel", _matmul_setup, count_traffic=True),
    compare=_compare_traffic("matmul_kernel", _describe_matmul,
                             "each program reads only the parts of its tiles inside A and B",
                             TOLERANCES["matmul_kernel"], excess_hints=_MATMUL_EXCESS_HINTS),
    hint="a lane that reads outside A or B costs memory traffic even when its product never reaches C: the tile "
    "loads must stay inside their matrices along every dimension, rows of A past M and columns of B past N "
    "included, not only along K. Budget: each program reads only the parts of its tiles inside A and B.",
))


# --- task 3: rmsnorm_kernel -------------------------------------------------------------------------

def _rmsnorm_case(rng: random.Random, rows: int, cols: int, *, pad: int = 0, out_pad: int = 0,
                  eps: float = 1e-5) -> dict:
    return {"seed": rng.randrange(10**6), "rows": rows, "cols": cols, "pad": pad, "out_pad": out_pad, "eps": eps,
            "scale": rng.choice([0.01, 1.0, 30.0])}


def _rmsnorm_shapes(rng):
    return [_rmsnorm_case(rng, 1, 1), _rmsnorm_case(rng, rng.randint(2, 6), 576, eps=1e-6),
            # x and out padded differently, so that using one's row stride for the other shows
            _rmsnorm_case(rng, rng.randint(10, 30), rng.randint(33, 200), pad=rng.randint(4, 20), out_pad=3),
            _rmsnorm_case(rng, rng.randint(3, 8), rng.randint(5, 30), eps=0.5)]


def _rmsnorm_bounds_cases(rng):
    return [_rmsnorm_case(rng, rng.randint(3, 8), rng.randint(17, 100), pad=rng.randint(3, 20)),
            _rmsnorm_case(rng, 2, rng.randint(129, 200), out_pad=5)]


def _rmsnorm_setup(case):
    rows, cols = case["rows"], case["cols"]
    x = _with_row_gaps(_tensor(case["seed"], rows, cols, scale=case["scale"]), case["pad"])
    w = _tensor(case["seed"] + 1, cols)
    out = _empty_rows(x, cols, case["out_pad"])
    return out, (rows,), (out, x, w, cols, x.stride(0), out.stride(0), case["eps"]), {"BLOCK": _block(cols)}


def _describe_rmsnorm(case) -> str:
    return (f"x of shape [{case['rows']}, {case['cols']}] (x_row_stride {case['cols'] + case['pad']}, out_row_stride "
            f"{case['cols'] + case['out_pad']}), values of scale {case['scale']:g}, eps={case['eps']:g}, "
            f"grid ({case['rows']},), BLOCK={_block(case['cols'])}")


_RMSNORM = reference("infra_lib.kernels.rmsnorm", "rmsnorm_kernel")

register(Check(
    check_id="lab03.rmsnorm_odd_shapes", task="lab03 task 3: rmsnorm_kernel", reference=_RMSNORM,
    make_inputs=_rmsnorm_shapes, drive=_driver("rmsnorm_kernel", _rmsnorm_setup),
    compare=_compare_values("rmsnorm_kernel", _describe_rmsnorm, TOLERANCES["rmsnorm_kernel"]),
    hint="the mean square is over the n_cols real elements only: padded lanes must add nothing to the sum of "
    "squares, and the divisor is n_cols, not BLOCK. eps belongs inside the square root, added to the mean square "
    "(it reaches 0.5 here, so its place shows), and each row of x and of out starts at its own row stride "
    "(chapter 03, section “Lab 03: what you will write”).",
))

_RMSNORM_EXCESS_HINTS = {
    "w_ptr": "the weight vector has n_cols elements, like a row: the lanes of its load past n_cols must be switched "
    "off even though their products are never stored (no value check sees them, only the bytes do), and each "
    "program reads the weights once.",
    "x_ptr": "each program reads its row of x once, with the lanes past n_cols switched off: the row stays in "
    "registers from the mean square to the scaling instead of being loaded again.",
}

register(Check(
    check_id="lab03.rmsnorm_in_bounds", task="lab03 task 3: rmsnorm_kernel", reference=_RMSNORM,
    make_inputs=_rmsnorm_bounds_cases, drive=_driver("rmsnorm_kernel", _rmsnorm_setup, count_traffic=True),
    compare=_compare_traffic("rmsnorm_kernel", _describe_rmsnorm,
                             "each program reads its row of x and the n_cols weights once",
                             TOLERANCES["rmsnorm_kernel"], excess_hints=_RMSNORM_EXCESS_HINTS),
    hint="the weight vector has only n_cols elements, like a row, so its load overruns just as the row's does: the "
    "row of x, the weights and the store all need their lanes past n_cols switched off. A lane past n_cols must not "
    "be read even when its result is never stored; here rows are strided, with gaps that the checker watches. "
    "Budget: each program reads its row of x and the n_cols weights once.",
))
