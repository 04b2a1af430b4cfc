"""Checks for lab 15 (serving kernels): the online softmax, FlashAttention forward and paged decode
attention kernels, and the bonus fused 4-bit GEMV.

Each driver launches the learner's ``@triton.jit`` kernel itself, with the grid and block sizes the
task states, on seeded shapes that are not multiples of the blocks; the reference kernel is launched
the same way. Every launch goes through ``check_bounds`` (guard bands around each tensor), and in the
interpreter ``count_traffic`` counts the bytes it moved. When values differ, the comparison names
the mistake the data shows: the driver also computes in torch what the usual mistakes would give
(an accumulator never rescaled, a mask on the wrong diagonal, heads mapped the wrong way...), and
the comparison reads those from the reference's side only, so the learner's process never decides
its own verdict.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Callable

from grading.checks import lab03
from grading.checks.common import array_mismatch, reference, token_difference
from grading.registry import Check, Mismatch, register, register_shortcuts

register_shortcuts("lab15", [
    "infra_lib.kernels.softmax:softmax",
    "infra_lib.kernels.flash_attention:flash_attention",
    "infra_lib.kernels.flash_attention:naive_attention",
    "infra_lib.kernels.flash_attention:attention_reference",
    "infra_lib.kernels.flash_attention:flash_cached_attention",
    "infra_lib.kernels.paged_decode:paged_decode_attention",
    "infra_lib.kernels.paged_decode:decode_launches",
    "infra_lib.kernels.paged_decode:gather_then_attend",
    "infra_lib.kernels.paged_decode:paged_decode_cached_attention",
    "infra_lib.kernels.gemv_q4:q4_matmul",
    "infra_lib.kernels.gemv_q4:q4_matmul_launch",
    "infra_lib.kernels.gemv_q4:q4_1_matmul",
    "infra_lib.kernels.gemv_q4:fused_forward",
])

SIGNATURES = {  # the parameters each kernel takes, in order (those of the course's reference kernels)
    "online_softmax_kernel": "out_ptr in_ptr n_cols in_row_stride out_row_stride BLOCK".split(),
    "flash_attention_kernel": (
        "q_ptr k_ptr v_ptr out_ptr lse_ptr n_heads group t s head_dim scale stride_qb stride_qh stride_qt stride_qd "
        "stride_kb stride_kh stride_ks stride_kd stride_vb stride_vh stride_vs stride_vd stride_ob stride_oh "
        "stride_ot stride_od CAUSAL BLOCK_M BLOCK_N BLOCK_D").split(),
    "paged_decode_kernel": (
        "out_ptr q_ptr k_cache_ptr v_cache_ptr tables_ptr seq_lens_ptr group head_dim scale stride_qb stride_qh "
        "stride_ob stride_oh stride_kb stride_kt stride_kh stride_vb stride_vt stride_vh stride_table BLOCK_SIZE "
        "BLOCK_ROWS BLOCK_G BLOCK_D").split(),
    "q4_gemv_kernel": "x_ptr packed_ptr scales_ptr y_ptr M N K stride_xm stride_pn stride_sn stride_ym GROUP BLOCK_M "
                      "BLOCK_N".split(),
}
UNWRITTEN = -7.0  # what every output holds before the launch: an element still -7 was never stored
_TASKS = {1: "lab15 task 1: online_softmax_kernel", 2: "lab15 task 2: flash_attention_kernel",
          3: "lab15 task 3: paged_decode_kernel", 4: "lab15 task 4: q4_gemv_kernel"}
_LESSON = "chapter 15, section"


_SOFTMAX_REFERENCE = reference("infra_lib.kernels.softmax", "online_softmax_kernel")
_FLASH_REFERENCE = reference("infra_lib.kernels.flash_attention", "flash_attention_kernel")
_PAGED_REFERENCE = reference("infra_lib.kernels.paged_decode", "paged_decode_kernel")
_GEMV_REFERENCE = reference("infra_lib.kernels.gemv_q4", "q4_gemv_kernel")


# --- launching a learner's kernel -----------------------------------------------------------------------

def _kernel_types() -> tuple[type, ...]:
    from infra_lib.kernels.triton_env import load_triton

    load_triton()
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return InterpretedFunction, JITFunction


def require_kernel(kernel, name: str) -> None:
    """A kernel exactly as ``@triton.jit`` makes it, with the task's parameters: the check launches it
    itself, so a Python function or object standing in for the kernel is refused."""
    if type(kernel) not in _kernel_types():
        raise TypeError(f"{name} must be a Triton kernel, exactly as @triton.jit returns it: put @triton.jit on the "
                        f"line above `def {name}(...)` (got a {type(kernel).__name__}); the check launches it itself")
    names = list(kernel.arg_names)
    if names != SIGNATURES[name]:
        raise TypeError(f"{name} must take the parameters ({', '.join(SIGNATURES[name])}) in that order, "
                        f"got ({', '.join(names)})")


def _plain_error(exc: BaseException) -> BaseException:
    """The error a learner should read (lab 03's unwrapping, and this lab's stubs compiled on a GPU)."""
    exc = lab03._plain_error(exc)
    stub = re.search(r"NotImplementedError\((['\"])(lab15 task \d+: \w+)\1\)", str(exc))
    return NotImplementedError(stub.group(2)) if stub else exc


def _bits(tensor):
    """A copy of the tensor's bytes (NaN compares equal to itself, bit for bit)."""
    import torch

    return tensor.detach().contiguous().view(-1).view(torch.uint8).clone()


def launch(kernel, grid, args: tuple, meta: dict, inputs: dict | None = None) -> dict:
    """One launch through ``check_bounds`` (bytes counted in the interpreter).

    Returns {"interpreted", "violations", "written_inputs" (the names of ``inputs`` the kernel
    changed), and in the interpreter "bytes_loaded", "bytes_stored"}.
    """
    import contextlib

    import torch

    from infra_lib.kernels.oob import check_bounds
    from infra_lib.kernels.traffic import count_traffic
    from infra_lib.kernels.triton_env import interpreter_active

    before = {name: _bits(t) for name, t in (inputs or {}).items()}
    interpreted = interpreter_active()
    try:
        with (count_traffic() if interpreted else contextlib.nullcontext()) as traffic:
            report = check_bounds(kernel, grid, *args, raise_on_error=False, **meta)
    except Exception as exc:  # the learner's kernel may raise anything
        raise _plain_error(exc) from None
    result = {"interpreted": interpreted, "violations": [v.as_dict() for v in report.violations],
              "written_inputs": [name for name, bits in before.items()
                                 if not torch.equal(bits, _bits(inputs[name]))]}
    if traffic is not None:
        result.update(bytes_loaded=traffic.bytes_loaded, bytes_stored=traffic.bytes_stored)
    return result


def _launch_in_a_model(kernel, name: str, grid, args: tuple, meta: dict) -> None:
    """``launch`` inside a model's forward pass: an access outside a tensor stops the model, named."""
    violations = launch(kernel, grid, args, meta)["violations"]
    if violations:
        raise IndexError(f"{name} {lab03._outside(violations[0])} inside the model")


def _values(tensor) -> list:
    return tensor.detach().cpu().double().tolist()


# --- comparing ----------------------------------------------------------------------------------------

RTOL = 1e-4  # the relative part of every value comparison


@dataclass(frozen=True)
class Tolerance:
    """``numpy.isclose``'s test, element by element: |yours - reference| <= atol + rtol * |reference|.

    ``atol`` applies when both sides ran in Triton's interpreter, ``gpu_atol`` when either ran
    compiled (a float32 ``tl.dot`` rounds its inputs to TF32 on a GPU). The relative part keeps
    large values fair: near 1e4, float32's rounding step is about 1e-3.
    """

    atol: float
    gpu_atol: float
    rtol: float = RTOL

    def for_sides(self, g: dict, e: dict) -> float:
        """The absolute tolerance for a learner's result ``g`` against the reference's ``e``."""
        return self.atol if g.get("interpreted") is True and e.get("interpreted") is True else self.gpu_atol


# What the lab's text states for each kernel's outputs (tests/test_lab15.py reads it back from the text).
TOLERANCES = {"online_softmax_kernel": Tolerance(1e-6, 1e-5), "flash_attention_kernel": Tolerance(2e-5, 2e-2),
              "paged_decode_kernel": Tolerance(2e-5, 1e-3), "q4_gemv_kernel": Tolerance(1e-4, 3e-2)}
MODEL_LOGITS = Tolerance(1e-3, 2e-2)  # SmolLM2's logits after a prompt attended through the learner's kernel


@dataclass(frozen=True)
class _Kernel:
    """What the comparisons need to know about one task's kernel.

    Attributes:
        name: the kernel's name.
        outputs: (result key, argument name) of each output, in the order they are compared.
        describe: case -> the input in words (shown for visible checks only).
        access_hint: a violation (as ``Violation.as_dict()``) -> the hint for that out-of-range access.
        diagnose: a ``Failure`` -> the hint naming the mistake the values show, or "".
    """

    name: str
    outputs: tuple[tuple[str, str], ...]
    describe: Callable[[dict], str]
    access_hint: Callable[[dict], str]
    diagnose: Callable[["Failure"], str]

    @property
    def tolerances(self) -> Tolerance:
        return TOLERANCES[self.name]

    def tolerance(self, g: dict, e: dict) -> float:
        return self.tolerances.for_sides(g, e)


@dataclass(frozen=True)
class Failure:
    """What a diagnosis reads: the first case whose outputs differ (``got`` the learner's data,
    ``expected`` the reference's), every case of the check, and the indices of those that differ."""

    case: dict
    got: dict
    expected: dict
    atol: float
    cases: list
    failing: list[int]

    def matches(self, *names: str, key: str = "out") -> bool:
        """The learner's ``key`` equals one of the mistakes (by name) that the reference's side computed."""
        alternatives = self.expected.get("alternatives", {})
        return any(name in alternatives and close(self.got[key], alternatives[name], max(self.atol, 1e-4))
                   for name in names)

    def non_finite(self, key: str = "out") -> bool:
        """NaN or inf in the learner's ``key`` where the reference's is finite."""
        import numpy as np

        got, expected = np.asarray(self.got[key], dtype=np.float64), np.asarray(self.expected[key], dtype=np.float64)
        return bool((np.isfinite(expected) & ~np.isfinite(got)).any())

    def only_where(self, feature: Callable[[dict], bool]) -> bool:
        """Every failing case has ``feature``, and some case without it passed."""
        return all(feature(self.cases[i]) for i in self.failing) and any(
            not feature(c) for i, c in enumerate(self.cases) if i not in self.failing)


def close(got, expected, atol: float) -> bool:
    """Every element within ``atol`` (plus ``RTOL`` relative), NaN never close: lists from the drivers."""
    import numpy as np

    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return got.shape == expected.shape and bool(np.isclose(got, expected, atol=atol, rtol=RTOL).all())


def gaps_hint(argument: str, section: str) -> str:
    """The hint for an access in the gaps of a tensor whose rows are padded: a mask or a stride."""
    return (f"an access landed in the gaps between the rows of `{argument}`, whose rows are padded here: each tensor "
            "is walked with its own strides, passed in as arguments, never with another tensor's or with an assumed "
            f"row length, and lanes past the end of a row (past head_dim, N or n_cols) are switched off ({section}).")


def _access_problem(spec: _Kernel, g: dict, where: str) -> Mismatch | None:
    if g["violations"]:
        first = g["violations"][0]
        what = f"{spec.name} {lab03._outside(first)}" + (" (and the values reached its outputs)"
                                                         if first["kind"] == "load" else "")
        details = "; ".join(f"{lab03._outside(v)}: {v['elements']} element(s)" for v in g["violations"])
        return Mismatch(what, f"on {where}: {details}", hint=spec.access_hint(first))
    if g["written_inputs"]:
        names = ", ".join(f"`{name}`" for name in g["written_inputs"])
        return Mismatch(f"{spec.name} wrote into {names}, which it must only read", f"on {where}",
                        hint="a kernel's inputs are shared memory (in a server, the KV cache holds every sequence's "
                        "keys and values): it reads them and stores only into its outputs.")
    return None


def _output_problem(spec: _Kernel, g: dict, e: dict, where: str) -> Mismatch | None:
    import numpy as np

    atol = spec.tolerance(g, e)
    for key, argument in spec.outputs:
        got, expected = np.asarray(g[key], dtype=np.float64), np.asarray(e[key], dtype=np.float64)
        if got.shape == expected.shape:
            unwritten = (got == UNWRITTEN) & (expected != UNWRITTEN)
            if unwritten.any():
                return Mismatch(f"{spec.name} left elements of `{argument}` unwritten",
                                f"on {where}: {int(unwritten.sum())} of {got.size} elements still hold the "
                                f"{UNWRITTEN:g} they held before the launch")
            bad = np.isfinite(expected) & ~np.isfinite(got)
            if bad.any():
                return Mismatch(f"{spec.name} stored NaN or inf into `{argument}` where the result is finite",
                                f"on {where}: {int(bad.sum())} of {got.size} elements")
        problem = array_mismatch(g[key], e[key], f"{spec.name}'s `{argument}` differs from the reference", where,
                                 atol=atol, rtol=spec.tolerances.rtol)
        if problem:
            return problem
    return None


def compare_values(spec: _Kernel):
    """Out-of-range accesses and written inputs first (case by case), then the outputs; the hint of a
    value difference comes from ``spec.diagnose``, else the check's own."""

    def compare(got, expected, cases):
        if type(got) is not list or len(got) != len(cases):
            return Mismatch(f"{spec.name}: expected {len(cases)} results, got {str(got)[:80]}")
        problems = []
        for case, g, e in zip(cases, got, expected):
            where = spec.describe(case)
            access = _access_problem(spec, g, where)
            if access:
                return access
            problems.append(_output_problem(spec, g, e, where))
        failing = [i for i, problem in enumerate(problems) if problem]
        if not failing:
            return None
        first, g, e = failing[0], got[failing[0]], expected[failing[0]]
        hint = spec.diagnose(Failure(cases[first], g, e, spec.tolerance(g, e), cases, failing))
        return Mismatch(problems[first].what, problems[first].detail, hint=hint)

    return compare


def compare_traffic(spec: _Kernel, budget: str):
    """Values first (a value difference keeps its diagnosed hint, else: fix the values first), then
    lab 03's count of the bytes loaded and stored against the reference kernel's on the same launch."""
    values = compare_values(spec)
    stated = spec.tolerances  # lab 03 compares the values again: with the tolerances this lab states
    bytes_moved = lab03._compare_traffic(spec.name, spec.describe, budget,
                                         lab03.Tolerance(stated.atol, stated.rtol, stated.gpu_atol, stated.rtol))

    def compare(got, expected, cases):
        problem = values(got, expected, cases)
        if problem:
            return problem if problem.hint else Mismatch(problem.what, problem.detail, hint=lab03._VALUES_FIRST)
        return bytes_moved(got, expected, cases)

    return compare


def _seed(rng: random.Random) -> int:
    return rng.randrange(10**6)


def _generator(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


def _to_device(*tensors):
    from infra_lib.kernels.triton_env import kernel_device

    return tuple(t.to(kernel_device()) for t in tensors)


def _register(task: int, reference_kernel, drive, checks: list[tuple], shared_hint: str = "") -> None:
    """Register one task's checks, each (check_id, make_inputs, compare, hint), all driven by ``drive``;
    each check's hint is ``shared_hint`` followed by its own."""
    for check_id, make_inputs, compare, hint in checks:
        register(Check(check_id=check_id, task=_TASKS[task], reference=reference_kernel, make_inputs=make_inputs,
                       drive=drive, compare=compare, hint=(shared_hint + " " + hint).strip()))


# --- task 1: online_softmax_kernel ------------------------------------------------------------------------

def _softmax_case(rng: random.Random, rows: int, cols: int, block: int, *, pad: int = 0, out_pad: int = 0,
                  special: str = "") -> dict:
    return {"seed": _seed(rng), "rows": rows, "cols": cols, "block": block, "pad": pad, "out_pad": out_pad,
            "special": special}


def _softmax_long_rows(rng):
    return [_softmax_case(rng, 1, 1, 16), _softmax_case(rng, 3, rng.randint(100, 300), 32, special="rising"),
            _softmax_case(rng, rng.randint(5, 12), rng.randint(40, 63), 16, pad=rng.randint(1, 40),
                          out_pad=rng.randint(1, 9)),
            _softmax_case(rng, 4, 64, 16), _softmax_case(rng, 2, rng.randint(5, 15), 16),
            _softmax_case(rng, rng.randint(2, 6), rng.randint(70, 120), 16)]


def _softmax_extremes(rng):
    return [_softmax_case(rng, 4, rng.randint(40, 120), 16, special="scale 1e4"),
            _softmax_case(rng, 3, rng.randint(33, 63), 16, special="huge"),
            _softmax_case(rng, 3, rng.randint(33, 63), 16, special="negative"),
            _softmax_case(rng, 4, rng.randint(50, 90), 16, special="-inf blocks"),
            _softmax_case(rng, 3, rng.randint(20, 60), 16, special="one finite")]


def _softmax_traffic_cases(rng):
    return [_softmax_case(rng, rng.randint(8, 20), rng.randint(100, 300), 32), _softmax_case(rng, 3, 1, 16),
            _softmax_case(rng, 2, 64, 16)]


def _logits(case):
    """The case's float32 logits [rows, cols] (before any row padding)."""
    import torch

    rows, cols, special = case["rows"], case["cols"], case["special"]
    generator = _generator(case["seed"])
    x = torch.randn(rows, cols, generator=generator) * 3
    if special == "rising":  # the row's max grows block after block
        x = x + torch.arange(cols) * 0.2
    elif special == "scale 1e4":
        x = x * 3e3
    elif special in ("huge", "negative"):  # every logit near +1e4 (or -1e4)
        x = x * 0.2 + (1e4 if special == "huge" else -1e4)
    elif special == "-inf blocks":  # each row starts with one to three whole blocks of -inf
        for r in range(rows):
            x[r, :case["block"] * (1 + r % 3)] = float("-inf")
        x = x.masked_fill(torch.rand(rows, cols, generator=generator) < 0.3, float("-inf"))
        x[:, -1] = 1.0  # at least one finite logit per row
    elif special == "one finite":
        keep = torch.randint(0, cols, (rows,), generator=generator)
        hidden = torch.ones(rows, cols, dtype=torch.bool)
        hidden[torch.arange(rows), keep] = False
        x = (x * 30).masked_fill(hidden, float("-inf"))
    return x


def _sum_not_rescaled(x, block: int):
    """What a softmax gives whose running sum is never rescaled when the max grows (float64)."""
    import torch

    x = x.double()
    block_max = torch.stack([x[:, i:i + block].amax(1) for i in range(0, x.shape[1], block)], 1)
    running = torch.cummax(block_max, 1).values.repeat_interleave(block, 1)[:, :x.shape[1]]
    weights = torch.where(x == float("-inf"), 0.0, torch.exp(x - running))
    return torch.exp(x - running[:, -1:]) / weights.sum(1, keepdim=True)


def _drive_softmax(kernel, cases):
    import torch

    from grading.checks.lab03 import _empty_rows, _with_row_gaps

    require_kernel(kernel, "online_softmax_kernel")
    results = []
    for case in cases:
        logits = _logits(case)
        (x,) = _to_device(_with_row_gaps(logits, case["pad"]))
        out = _empty_rows(x, case["cols"], case["out_pad"])
        out.fill_(UNWRITTEN)
        result = launch(kernel, (case["rows"],), (out, x, case["cols"], x.stride(0), out.stride(0)),
                        {"BLOCK": case["block"]}, {"in_ptr": x})
        result["out"] = _values(out)
        alternative = _sum_not_rescaled(logits, case["block"])
        if not torch.allclose(alternative, torch.softmax(logits.double(), 1), atol=1e-4):
            result["alternatives"] = {"sum_not_rescaled": alternative.tolist()}
        results.append(result)
    return results


def _describe_softmax(case) -> str:
    extra = {"rising": ", logits that grow along the row", "scale 1e4": ", logits of scale 1e4",
             "huge": ", every logit near +1e4", "negative": ", every logit near -1e4",
             "-inf blocks": ", rows that begin with whole blocks of -inf", "one finite":
             ", all but one logit per row -inf"}.get(case["special"], "")
    return (f"x of shape [{case['rows']}, {case['cols']}] (in_row_stride {case['cols'] + case['pad']}, out_row_stride "
            f"{case['cols'] + case['out_pad']}){extra}, grid ({case['rows']},), BLOCK={case['block']}")


_ONLINE = f"{_LESSON} “2 · Online softmax”"
SOFTMAX_RESCALE_HINT = ("the running sum was added to under an old maximum: when a block raises the running max, "
                        "every exp already summed was taken against the smaller max and must shrink by "
                        f"exp(old max - new max) before the block's own terms join it ({_ONLINE}).")
SOFTMAX_MASK_HINT = ("a lane past n_cols took part in the maximum: with every logit near -1e4, a padded lane that "
                     "loads 0 (or is masked only after the max) becomes the row's max, and every real exp then "
                     "underflows to 0. Lanes past the row must be out of the max, the sum and the store alike "
                     f"({_ONLINE}).")
SOFTMAX_SHIFT_HINT = ("exp overflows float32 above about 88: every exponential must be taken against the running "
                      f"maximum, never of a raw logit, so logits near +1e4 stay finite ({_ONLINE}).")
SOFTMAX_EMPTY_BLOCK_HINT = ("a row may begin with whole blocks of -inf: while the running max is still -inf, "
                            "exp(-inf - (-inf)) is NaN. Until a finite logit has been seen there is nothing to "
                            f"rescale and nothing to add, and a -inf logit's probability is exactly 0 ({_ONLINE}).")
SOFTMAX_LAST_BLOCK_HINT = ("only the last block of a row is wrong: it is partial (n_cols is not a multiple of BLOCK), "
                           "and both walks must visit it, with its lanes past n_cols switched off "
                           f"({_ONLINE}).")


def _diagnose_softmax(failure: Failure) -> str:
    import numpy as np

    case = failure.case
    if failure.matches("sum_not_rescaled"):
        return SOFTMAX_RESCALE_HINT
    if failure.non_finite():
        return {"negative": SOFTMAX_MASK_HINT, "-inf blocks": SOFTMAX_EMPTY_BLOCK_HINT,
                "one finite": SOFTMAX_EMPTY_BLOCK_HINT}.get(case["special"], SOFTMAX_SHIFT_HINT)
    wrong = ~np.isclose(np.asarray(failure.got["out"], dtype=np.float64),
                        np.asarray(failure.expected["out"], dtype=np.float64), atol=failure.atol, rtol=RTOL)
    full_blocks = case["cols"] - case["cols"] % case["block"]
    if full_blocks < case["cols"] and wrong.any() and not wrong[:, :full_blocks].any():
        return SOFTMAX_LAST_BLOCK_HINT
    return ""


def _softmax_access_hint(violation: dict) -> str:
    if violation["kind"] == "store":
        return ("a store reached past a row: the last block of a row is partial, and its lanes at n_cols and beyond "
                "lie in the gap before the next row or past the tensor; they must not be written. Rows start one "
                f"row stride apart, the input's and the output's each its own ({_ONLINE}).")
    return ("a load reached past a row, and its value reached the output: the last block of a row is partial, and "
            "its lanes at n_cols and beyond must not be read; the value they get instead must change neither the "
            f"row's max nor its sum ({_ONLINE}).")


_SOFTMAX = _Kernel("online_softmax_kernel", (("out", "out_ptr"),), _describe_softmax, _softmax_access_hint,
                   _diagnose_softmax)

_register(1, _SOFTMAX_REFERENCE, _drive_softmax, [
    ("lab15.softmax_long_rows", _softmax_long_rows, compare_values(_SOFTMAX),
     "each program walks its row block by block (BLOCK columns at a time, the last block partial): a "
     "first walk keeps the running max and the running sum of exp(x - max), rescaling the sum whenever "
     "the max grows; a second walk writes exp(x - max) / sum. Shapes here: one element, rows shorter "
     "and longer than a block, rows whose max grows block after block, strided rows "
     f"({_ONLINE})."),
    ("lab15.softmax_extreme_values", _softmax_extremes, compare_values(_SOFTMAX),
     "extreme logits: every exp must be taken against the running max (logits near ±1e4), padded lanes must stay "
     "out of the max (every logit near -1e4), and a row may start with whole blocks of -inf, where the running max "
     f"is still -inf and nothing may be rescaled yet ({_ONLINE})."),
    ("lab15.softmax_two_passes", _softmax_traffic_cases,
     compare_traffic(_SOFTMAX, "each element of x read twice, each element of out written once"),
     "the online softmax reads the row twice and writes it once: the first walk finds the max and the sum "
     "together, rescaling the sum as the max grows, so no third walk (a separate pass for the max) is needed, and "
     "nothing is stored before the final values. Lanes past n_cols count as traffic too unless masked off. "
     f"Budget: each element of x read twice, each element of out written once ({_ONLINE})."),
])


# --- task 2: flash_attention_kernel --------------------------------------------------------------------

def _flash_case(rng: random.Random, batch: int, heads: int, kv_heads: int, t: int, s: int, head_dim: int, *,
                causal: bool = True, blocks=(16, 16), layout: str = "contiguous", special: str = "") -> dict:
    return {"seed": _seed(rng), "batch": batch, "heads": heads, "kv_heads": kv_heads, "t": t, "s": s,
            "head_dim": head_dim, "causal": causal, "blocks": list(blocks), "layout": layout, "special": special}


def _partial(rng: random.Random, low: int, high: int, block: int = 16) -> int:
    """A length in [low, high] that is not a multiple of ``block``."""
    return rng.choice([n for n in range(low, high + 1) if n % block])


def _flash_odd_shapes(rng):
    chunk = rng.randint(3, 9)
    return [_flash_case(rng, 1, 1, 1, 1, 1, 8),
            _flash_case(rng, 2, 4, 2, *[_partial(rng, 17, 40)] * 2, 16, layout="model"),
            _flash_case(rng, 1, 3, 1, chunk, _partial(rng, 33, 45), 20, special="rising"),
            _flash_case(rng, 1, 2, 2, 1, _partial(rng, 30, 50), 16),
            _flash_case(rng, 2, 2, 1, rng.randint(5, 15), _partial(rng, 17, 40), 8, causal=False)]


def _flash_extremes(rng):
    t = rng.randint(5, 15)
    # "huge" has no masked key (not causal, s a multiple of BLOCK_N): only a missing shift fails it
    return [_flash_case(rng, 1, 2, 1, rng.randint(10, 32), rng.choice([32, 48]), 16, causal=False, special="huge"),
            _flash_case(rng, 1, 2, 2, t, _partial(rng, t + 17, 50), 16, special="negative"),
            _flash_case(rng, 1, 3, 1, rng.randint(5, 15), _partial(rng, 40, 60), 16, causal=False, special="rising")]


def _flash_block_shapes(rng):
    return [_flash_case(rng, 1, 3, 1, *[_partial(rng, 33, 50)] * 2, 64, blocks=(32, 16), layout="model"),
            _flash_case(rng, 1, 2, 1, rng.randint(10, 20), _partial(rng, 40, 70, 32), 24, blocks=(16, 32)),
            _flash_case(rng, 2, 4, 2, rng.randint(5, 20), _partial(rng, 30, 60), 24, blocks=(32, 16),
                        layout="strided")]


def _flash_traffic_cases(rng):
    # The last two make a causal query block's last visible key fall inside a key block that also holds keys
    # past it (a chunk of more than one query block after cached keys; BLOCK_N > BLOCK_M): reading that key
    # block up to s instead of up to the block's end shows in the bytes. With t = s and square tiles it cannot.
    chunk = rng.randint(17, 30)
    return [_flash_case(rng, 1, 2, 1, *[_partial(rng, 33, 50)] * 2, 16),
            _flash_case(rng, 1, 2, 2, rng.randint(5, 15), _partial(rng, 30, 50), 8),
            _flash_case(rng, 1, 1, 1, rng.randint(17, 30), _partial(rng, 31, 45), 16, causal=False),
            _flash_case(rng, 1, 2, 1, chunk, chunk + _partial(rng, 20, 60), 16),
            _flash_case(rng, 1, 2, 1, *[_partial(rng, 33, 50)] * 2, 16, blocks=(16, 32))]


def _flash_tensors(case):
    """q [batch, heads, t, head_dim] and k, v [batch, kv_heads, s, head_dim], float32."""
    import torch

    b, h, kv, t, s, d = (case[key] for key in ("batch", "heads", "kv_heads", "t", "s", "head_dim"))
    generator = _generator(case["seed"])
    if case["layout"] == "model":  # as the model makes them: [batch, positions, heads, head_dim] transposed
        q, k, v = (torch.randn(b, n, heads, d, generator=generator).transpose(1, 2)
                   for n, heads in ((t, h), (s, kv), (s, kv)))
    elif case["layout"] == "strided":  # the head dimension is not the contiguous one: stride_*d is the length
        q, k, v = (torch.randn(b, heads, d, n, generator=generator).transpose(2, 3)
                   for n, heads in ((t, h), (s, kv), (s, kv)))
    else:
        q = torch.randn(b, h, t, d, generator=generator)
        k, v = torch.randn(b, kv, s, d, generator=generator), torch.randn(b, kv, s, d, generator=generator)
    direction = torch.nn.functional.normalize(torch.randn(d, generator=generator), dim=0)
    size = math.sqrt(300 * math.sqrt(d))  # size * size / sqrt(d) = 300
    if case["special"] == "huge":  # scores of the order of 1e4
        q, k = q * 60, k * 60
    elif case["special"] == "negative":  # every score near -300: exp of any of them underflows against 0
        q = q * 0.05 + size * direction
        k = k * 0.05 - size * direction
    elif case["special"] == "rising":  # later keys score higher: the running max grows block after block
        k = k + (torch.arange(s, dtype=torch.float32) / s * 8)[None, None, :, None] * direction
        q = q + 2 * direction
    return q, k, v


def _visible(t: int, s: int, causal: bool, offset: int | None = None):
    """[t, s] keys each query sees; causal: query i sees keys 0 .. offset + i (offset s - t by default)."""
    import torch

    if not causal:
        return torch.ones(t, s, dtype=torch.bool)
    offset = s - t if offset is None else offset
    return torch.arange(s)[None, :] <= torch.arange(t)[:, None] + offset


def _attention64(q, k, v, visible, kv_of_head):
    """Attention in float64 with an explicit mask and head mapping: (scores masked with -inf, out)."""
    import torch

    keys, values = k.double()[:, kv_of_head], v.double()[:, kv_of_head]
    scores = (q.double() @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, float("-inf"))
    return scores, torch.softmax(scores, -1) @ values


def _flash_alternatives(case, q, k, v) -> dict:
    """What the usual mistakes would give, in float64: an accumulator (or accumulator and sum) not
    rescaled when the max grows, the causal mask on another diagonal, query heads mapped to KV heads
    by h % n_kv_heads."""
    import torch

    h, kv, t, s = case["heads"], case["kv_heads"], case["t"], case["s"]
    grouped = [head // (h // kv) for head in range(h)]
    scores, truth = _attention64(q, k, v, _visible(t, s, case["causal"]), grouped)
    values = v.double()[:, grouped]
    block = case["blocks"][1]
    block_max = torch.stack([scores[..., i:i + block].amax(-1) for i in range(0, s, block)], -1)
    running = torch.cummax(block_max, -1).values
    weights = torch.exp(scores - running.repeat_interleave(block, -1)[..., :s])  # each key against its block's max
    found = {"acc_not_rescaled": (weights @ values) / torch.exp(scores - running[..., -1:]).sum(-1, keepdim=True),
             "neither_rescaled": (weights @ values) / weights.sum(-1, keepdim=True)}
    if case["causal"] and t < s:
        found["diagonal_at_i"] = _attention64(q, k, v, _visible(t, s, True, 0), grouped)[1]
    if case["causal"]:
        found["diagonal_one_late"] = _attention64(q, k, v, _visible(t, s, True, s - t + 1), grouped)[1]
    if 1 < kv < h:
        modulo = [head % kv for head in range(h)]
        found["heads_modulo"] = _attention64(q, k, v, _visible(t, s, case["causal"]), modulo)[1]
    return {name: out.tolist() for name, out in found.items() if not torch.allclose(out, truth, atol=1e-4)}


def flash_launch(kernel, q, k, v, out, lse, *, causal: bool, blocks=(16, 16)):
    """(grid, args, meta) of ``kernel`` on these tensors, as task 2 states the launch."""
    from infra_lib.kernels.triton_env import next_power_of_2

    batch, heads, t, head_dim = q.shape
    s = k.shape[2]
    grid = (-(-t // blocks[0]), batch * heads)
    args = (q, k, v, out, lse, heads, heads // k.shape[1], t, s, head_dim, 1 / math.sqrt(head_dim),
            *q.stride(), *k.stride(), *v.stride(), *out.stride())
    meta = {"CAUSAL": bool(causal), "BLOCK_M": blocks[0], "BLOCK_N": blocks[1],
            "BLOCK_D": max(16, next_power_of_2(head_dim))}
    return grid, args, meta


def _flash_output(case, device):
    """``out`` filled with UNWRITTEN: contiguous, or for the "strided" layout a [batch, t, heads, head_dim]
    buffer with padded rows, transposed (out's strides are then neither q's nor contiguous ones)."""
    import torch

    b, h, t, d = case["batch"], case["heads"], case["t"], case["head_dim"]
    if case["layout"] == "strided":
        return torch.full((b, t, h, d + 3), UNWRITTEN, device=device)[..., :d].transpose(1, 2)
    return torch.full((b, h, t, d), UNWRITTEN, device=device)


def _drive_flash(kernel, cases):
    import torch

    require_kernel(kernel, "flash_attention_kernel")
    results = []
    for case in cases:
        q, k, v = _flash_tensors(case)
        alternatives = _flash_alternatives(case, q, k, v)
        q, k, v = _to_device(q, k, v)
        b, h, t = case["batch"], case["heads"], case["t"]
        out = _flash_output(case, q.device)
        lse = torch.full((b, h, t), UNWRITTEN, device=q.device)
        grid, args, meta = flash_launch(kernel, q, k, v, out, lse, causal=case["causal"], blocks=case["blocks"])
        result = launch(kernel, grid, args, meta, {"q_ptr": q, "k_ptr": k, "v_ptr": v})
        result.update(out=_values(out), lse=_values(lse), alternatives=alternatives)
        results.append(result)
    return results


def _describe_flash(case) -> str:
    b, h, kv, t, s, d = (case[key] for key in ("batch", "heads", "kv_heads", "t", "s", "head_dim"))
    extra = {"huge": ", scores of the order of 1e4", "negative": ", every score near -300",
             "rising": ", scores that grow along the keys"}.get(case["special"], "")
    layout = {"model": ", q, k and v transposed views (the model's layout)",
              "strided": ", q, k and v with the head dimension strided (stride_*d = t or s), out a transposed view "
                         "with padded rows"}.get(case["layout"], "")
    bm, bn = case["blocks"]
    return (f"q [{b}, {h}, {t}, {d}], k and v [{b}, {kv}, {s}, {d}] (group {h // kv}), "
            f"{'causal' if case['causal'] else 'not causal'}{layout}{extra}, BLOCK_M={bm}, BLOCK_N={bn}, "
            f"grid ({-(-t // bm)}, {b * h})")


_TILES = f"{_LESSON} “3 · FlashAttention: tiles and a running max”"
_CAUSAL = f"{_LESSON} “4 · Causal tiles and grouped heads”"
FLASH_RESCALE_HINT = ("the output matches attention whose accumulator was never rescaled: when a key block raises "
                      "a row's running max, what the accumulator (and the running sum) already hold was weighted "
                      "against the smaller max and must shrink by exp(old max - new max) before the block's "
                      f"p @ v is added ({_TILES}).")
FLASH_DIAGONAL_HINT = ("the causal mask sits on the wrong diagonal: the t queries are the last t of the s positions, "
                       "so query i sits at position s - t + i and sees keys 0 to s - t + i, itself included; "
                       "with t < s (a chunk on top of a cache, a decode step) the mask is not the square one "
                       f"({_CAUSAL}).")
FLASH_GQA_HINT = ("the query heads are mapped to the wrong key/value heads: with n_heads = group * n_kv_heads, "
                  "consecutive query heads share a KV head, so query head h reads KV head h // group (heads 0 to "
                  f"group - 1 read KV head 0); with one query head per KV head every mapping looks right ({_CAUSAL}).")
FLASH_MASK_HINT = ("a masked score took part in the running max: with every visible score near -300, a lane past s "
                   "(or past the diagonal) that scores 0 becomes the max, and every real exp underflows to 0. The "
                   f"mask must be applied to the scores before their max is taken ({_TILES}).")
FLASH_SHIFT_HINT = ("exp overflows float32 above about 88: every exponential must be taken against the row's running "
                    f"max, so that scores of the order of 1e4 stay finite ({_TILES}).")
FLASH_STRIDES_HINT = ("only the case with an unusual layout differs: there the head dimension is not the contiguous one "
                      "(stride_qd, stride_kd and stride_vd are not 1) and out is a transposed view with padded rows. "
                      "Every address comes from its own tensor's four strides, the dim's included, never from an "
                      f"assumed layout or another tensor's strides ({_TILES}).")
FLASH_V_HINT = ("your log-sum-exp is right, so the scores, the mask, the running max and the running sum are too: "
                "what differs is the output, that is the V rows read (their strides, their KV head), the "
                f"accumulator's rescaling as the max grows, or the final division by the sum ({_TILES}).")


def _diagnose_flash(failure: Failure) -> str:
    for names, hint in ((("acc_not_rescaled", "neither_rescaled"), FLASH_RESCALE_HINT),
                        (("diagonal_at_i", "diagonal_one_late"), FLASH_DIAGONAL_HINT),
                        (("heads_modulo",), FLASH_GQA_HINT)):
        if failure.matches(*names):
            return hint
    if failure.non_finite():  # "negative" fails both mistakes, "huge" (nothing masked) only the missing shift
        huge_passed = any(c["special"] == "huge" and i not in failure.failing for i, c in enumerate(failure.cases))
        return FLASH_MASK_HINT if failure.case["special"] == "negative" and huge_passed else FLASH_SHIFT_HINT
    if failure.only_where(lambda c: c["layout"] == "strided"):
        return FLASH_STRIDES_HINT
    if failure.only_where(lambda c: c["heads"] > c["kv_heads"]):
        return FLASH_GQA_HINT
    if failure.only_where(lambda c: c["causal"] and c["t"] < c["s"]):
        return FLASH_DIAGONAL_HINT
    if close(failure.got["lse"], failure.expected["lse"], 1e-4):
        return FLASH_V_HINT
    return ""


def _flash_access_hint(violation: dict) -> str:
    argument = violation["argument"]
    if violation["side"] == "between":
        return gaps_hint(argument, _TILES)
    if violation["kind"] == "store":
        return (f"a store reached outside `{argument}`: query rows past t and dims past head_dim (BLOCK_D is a power "
                "of two, at least 16) must not be stored; lse holds t float32 per (batch, head), contiguous, "
                f"at lse_ptr + (batch * n_heads + head) * t + row ({_TILES}).")
    if argument in ("k_ptr", "v_ptr"):
        return (f"a load reached outside `{argument}`: the last key block is usually partial, so lanes at s and beyond "
                "(and dims past head_dim) must not be read; with the causal mask, a query block needs no key past "
                f"its last query's position either ({_CAUSAL}).")
    return (f"a load reached outside `{argument}`: the last query block is usually partial and BLOCK_D may exceed "
            "head_dim: rows past t and dims past head_dim must not be read, and the value they get instead must "
            f"add nothing to a dot product ({_TILES}).")


_FLASH = _Kernel("flash_attention_kernel", (("out", "out_ptr"), ("lse", "lse_ptr")), _describe_flash,
                 _flash_access_hint, _diagnose_flash)

_register(2, _FLASH_REFERENCE, _drive_flash, [
    ("lab15.flash_odd_shapes", _flash_odd_shapes, compare_values(_FLASH), ""),
    ("lab15.flash_extreme_scores", _flash_extremes, compare_values(_FLASH), "Here the scores are extreme: of the "
     "order of 1e4, near -300 for every visible key, or growing along the keys so that the running max rises "
     "block after block."),
    ("lab15.flash_block_shapes", _flash_block_shapes, compare_values(_FLASH), "Here BLOCK_M and BLOCK_N differ, "
     "and head_dim is 64 or 24: the query tile's rows go with BLOCK_M and the grid's first axis, the key tile's "
     "with BLOCK_N."),
], shared_hint=(
    "each program owns BLOCK_M queries of one (batch, head) and walks the key blocks once, keeping per query a "
    "running max, a running sum and an accumulator of p @ v, all float32, rescaled whenever the max grows; out = "
    "accumulator / sum and lse = max + log(sum). Query i sits at position s - t + i, query head h reads KV head "
    "h // group, and every tensor is walked with its own strides. Shapes here: one token, a prefill (t = s), a "
    "chunk (t < s), a decode step (t = 1), not causal; MHA, GQA and MQA; q, k and v as transposed views "
    f"({_TILES}; {_CAUSAL})."))
_register(2, _FLASH_REFERENCE, _drive_flash, [
    ("lab15.flash_traffic", _flash_traffic_cases,
     compare_traffic(_FLASH, "Q, out and lse once; each query block reads the K and V rows up to its last visible "
                     "key once, and no row past it"),
     "the score matrix never leaves the program: no score or probability is stored, and each query block reads "
     "every K and V row it needs exactly once. With the causal mask, key blocks past a query block's last visible "
     "key are skipped, and the last key block visited is read only up to that key. Budget: Q, out and lse once; "
     f"each query block reads the K and V rows 0 to its last visible key once ({_CAUSAL})."),
])


# --- task 2 in a model ------------------------------------------------------------------------------------

def flash_cached_attention_with(kernel):
    """The model's attention step (``model.using_attention``) on ``kernel``: append this step's keys and
    values to the cache, then launch the kernel, causal, through ``check_bounds``. The model stays on
    the CPU; with a GPU, each step's tensors go to it and the output comes back."""

    def attend(q, k_new, v_new, cache):
        import torch

        keys, values = cache.append(k_new, v_new)
        device_q, keys, values = _to_device(q, keys, values)
        out = torch.full(q.shape, UNWRITTEN, dtype=q.dtype, device=keys.device)
        lse = torch.full(q.shape[:3], UNWRITTEN, dtype=torch.float32, device=keys.device)
        _launch_in_a_model(kernel, "flash_attention_kernel",
                           *flash_launch(kernel, device_q, keys, values, out, lse, causal=True))
        return out.to(q.device)

    return attend


def _attention(model, attention_fn):
    """``model.using_attention(attention_fn)``, or the model's own attention for None."""
    import contextlib

    return contextlib.nullcontext() if attention_fn is None else model.using_attention(attention_fn)


def _drive_flash_in_model(kernel, case):
    """Greedy tokens of a model whose every layer attends with ``kernel``. The reference side is the
    model's own torch attention (the reference kernel gives the same tokens, tests/test_attention_backends.py),
    which spares the grader the interpreter's time on the reference."""
    import torch

    from infra_lib.kernels.triton_env import interpreter_active
    from infra_lib.model.cache import DenseKVCache

    require_kernel(kernel, "flash_attention_kernel")
    own = kernel is _FLASH_REFERENCE()
    if case["model"] == "tiny":
        from grading.checks.lab06 import tiny_model

        model, prompts = tiny_model(case["seed"]), case["prompts"]
    else:
        from infra_lib.model.loaders import load_default

        loaded = load_default()
        model, prompts = loaded.model, [loaded.tokenizer.encode(p) for p in case["prompts"]]
    results = []
    with torch.inference_mode(), _attention(model, None if own else flash_cached_attention_with(kernel)):
        for prompt in prompts:
            cache = DenseKVCache.for_model(model.config, capacity=len(prompt) + case["new_tokens"])
            logits = model(torch.tensor([prompt]), cache, last_only=True)
            tokens, first_logits = [int(logits[0, -1].argmax())], logits[0, -1, :8].double().tolist()
            while len(tokens) < case["new_tokens"]:
                logits = model(torch.tensor([[tokens[-1]]]), cache, last_only=True)
                tokens.append(int(logits[0, -1].argmax()))
            results.append({"tokens": tokens, "first_logits": first_logits, "interpreted": interpreter_active()})
    return results


def _tiny_model_case(rng: random.Random) -> dict:
    return {"model": "tiny", "seed": _seed(rng), "new_tokens": 4,
            "prompts": [[rng.randrange(96) for _ in range(n)] for n in (1, rng.randint(3, 12))]}


_SHORT_PROMPTS = ["The capital of France is", "Water boils at", "The largest planet is", "One, two, three,"]


def _smollm2_case(rng: random.Random) -> dict:
    # One greedy token (the prompt's prefill through the learner's kernel, its logits compared too): the
    # interpreter runs every program of 30 layers in Python; the small decoder's checks decode several.
    return {"model": "smollm2", "new_tokens": 1, "prompts": [rng.choice(_SHORT_PROMPTS)]}


def _compare_in_model(got, expected, case):
    for i, (g, e) in enumerate(zip(got, expected)):
        prompt = case["prompts"][i]
        if isinstance(prompt, str):
            where = f"SmolLM2, prompt {prompt!r}"
        else:
            where = f"the small random model (seed {case['seed']}), a prompt of {len(prompt)} token(s)"
        if "first_logits" in e:
            problem = array_mismatch(g["first_logits"], e["first_logits"], "the model's logits after the prompt "
                                     "differ", where, atol=MODEL_LOGITS.for_sides(g, e), rtol=MODEL_LOGITS.rtol)
            if problem:
                return problem
        if g["tokens"] != e["tokens"]:
            return Mismatch("greedy decoding through your kernel produced different tokens",
                            f"on {where}: {token_difference(g['tokens'], e['tokens'])}")
    return None


_IN_A_MODEL = ("every layer of the model attends through your kernel: the prompt with t = s (causal), then each new "
               "token with t = 1 over the whole cache, q a transposed view and k, v the cache's contiguous keys. If "
               "the kernel checks above pass and this fails, look at t = 1 and at the query heads of a group "
               f"({_CAUSAL}; {_LESSON} “7 · The real model through the kernels”).")
_register(2, _FLASH_REFERENCE, _drive_flash_in_model, [
    ("lab15.flash_in_tiny_model", _tiny_model_case, _compare_in_model, _IN_A_MODEL),
    ("lab15.flash_in_smollm2", _smollm2_case, _compare_in_model, _IN_A_MODEL + " This one runs "
     "SmolLM2-135M-Instruct itself (9 query heads over 3 KV heads, head_dim 64)."),
])


# --- task 3: paged_decode_kernel -------------------------------------------------------------------------

def _paged_case(rng: random.Random, heads: int, kv_heads: int, head_dim: int, block_size: int, lengths: list[int],
                *, layout: str = "plain", special: str = "") -> dict:
    return {"seed": _seed(rng), "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "block_size": block_size, "lengths": lengths, "layout": layout, "special": special}


def _partial_length(rng: random.Random, low: int, high: int, block_size: int) -> int:
    return rng.choice([n for n in range(low, high + 1) if n % block_size])


def _paged_ragged(rng):
    # in every case the first sequence is the longest, with a partial last block: most mistakes show on it
    return [_paged_case(rng, 4, 2, 16, 4, [_partial_length(rng, 9, 15, 4), 0, 1, 8]),
            _paged_case(rng, 2, 2, 8, 8, [_partial_length(rng, 17, 30, 8), rng.randint(2, 16), rng.randint(1, 16)]),
            _paged_case(rng, 3, 1, 20, 4, [_partial_length(rng, 9, 15, 4), rng.randint(1, 8)])]


def _paged_layouts(rng):
    return [_paged_case(rng, 4, 2, 16, 6, [_partial_length(rng, 13, 20, 6), 6, 0, 3]),
            _paged_case(rng, 9, 3, 64, 16, [_partial_length(rng, 20, 40, 16), rng.randint(1, 15)], layout="padded"),
            _paged_case(rng, 2, 1, 16, 4, [_partial_length(rng, 9, 15, 4), 2], special="huge"),
            _paged_case(rng, 2, 1, 8, 4, [0, 0])]


def _paged_traffic_cases(rng):
    return [_paged_case(rng, 4, 2, 16, 4, [_partial_length(rng, 20, 30, 4), rng.randint(1, 10), 0]),
            _paged_case(rng, 6, 2, 8, 8, [rng.randint(10, 20)])]


def _paged_tensors(case):
    """q [batch, heads, 1, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim] whose slots no
    sequence owns hold NaN; the block tables [batch, width] int32, blocks shuffled over the cache, the
    entries past a sequence's last block naming spare (NaN) blocks; the lengths, int32."""
    import torch

    lengths, size, kv, d = case["lengths"], case["block_size"], case["kv_heads"], case["head_dim"]
    generator = _generator(case["seed"])
    needed = [-(-n // size) for n in lengths]
    num_blocks = sum(needed) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    spare = order[sum(needed):]
    width = max(needed) + 2
    tables = torch.tensor([order[sum(needed[:i]):sum(needed[:i + 1])] + [spare[j % 2] for j in range(width - n)]
                           for i, n in enumerate(needed)], dtype=torch.int32)
    pad = 3 if case["layout"] == "padded" else 0  # padded rows: the head dimension is not the row stride
    caches = []
    for _ in range(2):
        cache = torch.full((num_blocks, size, kv, d + pad), float("nan"))[..., :d]
        for row, n in zip(tables.tolist(), lengths):
            for position in range(n):
                cache[row[position // size], position % size] = torch.randn(kv, d, generator=generator)
        caches.append(cache)
    q = torch.randn(len(lengths), case["heads"], 1, d + pad, generator=generator)[..., :d]
    if case["special"] == "huge":  # scores of the order of 1e4
        q, caches = q * 60, [cache * 60 for cache in caches]
    return q, caches[0], caches[1], tables, torch.tensor(lengths, dtype=torch.int32)


def _paged_alternatives(case, q, k_cache, v_cache, tables) -> dict:
    """Per sequence, in float64: the output with query heads mapped by h % n_kv_heads, and the output
    over the context less its last token."""
    import torch

    h, kv, size = case["heads"], case["kv_heads"], case["block_size"]
    found = {"heads_modulo": [], "one_short": []}
    truth = []
    for b, n in enumerate(case["lengths"]):
        slots = [(tables[b, p // size].item(), p % size) for p in range(n)]
        keys = torch.stack([k_cache[block, slot] for block, slot in slots], 1)[None] if n else None  # [1, kv, n, d]
        values = torch.stack([v_cache[block, slot] for block, slot in slots], 1)[None] if n else None
        query = q[b:b + 1]

        def attend(mapping, length):
            if length == 0:
                return torch.zeros(1, h, 1, q.shape[-1], dtype=torch.float64)
            return _attention64(query, keys[:, :, :length], values[:, :, :length],
                                torch.ones(1, length, dtype=torch.bool), mapping)[1]

        grouped = [head // (h // kv) for head in range(h)]
        truth.append(attend(grouped, n))
        found["heads_modulo"].append(attend([head % kv for head in range(h)], n))
        found["one_short"].append(attend(grouped, max(n - 1, 0)))
    truth = torch.cat(truth)
    found = {name: torch.cat(outs) for name, outs in found.items()}
    return {name: out.tolist() for name, out in found.items() if not torch.allclose(out, truth, atol=1e-4)}


def paged_launch(kernel, out, q, k_cache, v_cache, tables, lengths):
    """(grid, args, meta) of ``kernel`` on these tensors, as task 3 states the launch."""
    from infra_lib.kernels.triton_env import next_power_of_2

    batch, heads, _, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    args = (out, q, k_cache, v_cache, tables, lengths, group, head_dim, 1 / math.sqrt(head_dim),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            tables.stride(0))
    meta = {"BLOCK_SIZE": block_size, "BLOCK_ROWS": next_power_of_2(block_size), "BLOCK_G": next_power_of_2(group),
            "BLOCK_D": next_power_of_2(head_dim)}
    return (batch, kv_heads), args, meta


def _drive_paged(kernel, cases):
    import torch

    require_kernel(kernel, "paged_decode_kernel")
    results = []
    for case in cases:
        q, k_cache, v_cache, tables, lengths = _paged_tensors(case)
        alternatives = _paged_alternatives(case, q, k_cache, v_cache, tables)
        q, k_cache, v_cache, tables, lengths = _to_device(q, k_cache, v_cache, tables, lengths)
        out = torch.full(q.shape, UNWRITTEN, device=q.device)
        if case["layout"] == "padded":  # out's rows padded too, by another amount than q's: its own strides
            out = torch.full((*q.shape[:3], q.shape[3] + 5), UNWRITTEN, device=q.device)[..., :q.shape[3]]
        grid, args, meta = paged_launch(kernel, out, q, k_cache, v_cache, tables, lengths)
        inputs = {"q_ptr": q, "k_cache_ptr": k_cache, "v_cache_ptr": v_cache, "tables_ptr": tables,
                  "seq_lens_ptr": lengths}
        result = launch(kernel, grid, args, meta, inputs)
        result.update(out=_values(out), alternatives=alternatives)
        results.append(result)
    return results


def _describe_paged(case) -> str:
    h, kv, d, size = case["heads"], case["kv_heads"], case["head_dim"], case["block_size"]
    extra = {"huge": ", scores of the order of 1e4"}.get(case["special"], "")
    layout = (", q, out and the caches with rows padded past head_dim (out by another amount than q)"
              if case["layout"] == "padded" else "")
    return (f"{len(case['lengths'])} sequences of {case['lengths']} tokens, {h} query heads over {kv} KV heads, "
            f"head_dim {d}, blocks of {size} slots{layout}{extra}, grid ({len(case['lengths'])}, {kv})")


_PAGED = f"{_LESSON} “5 · Paged decode: reading blocks in place”"
PAGED_TABLE_HINT = ("the first sequence came out right and a later one did not: each sequence has its own row of "
                    "block ids, and row b starts stride_table entries after the table's start (the table is wider "
                    "than most sequences need); within the row, entry i names the block that holds positions "
                    f"i * BLOCK_SIZE onwards ({_PAGED}).")
PAGED_LAST_BLOCK_HINT = ("a slot past the sequence's last token was read: the last block is usually partial, so a "
                         "sequence of n tokens owns slots 0 to n - 1 only, and the table entries past its last block "
                         "name no block of it (in these checks those slots hold NaN, and the output shows it) "
                         f"({_PAGED}).")
PAGED_ONE_SHORT_HINT = ("the output matches attention over every token but the last: a sequence of n tokens covers "
                        "positions 0 to n - 1, the new token's own key and value included, over cdiv(n, BLOCK_SIZE) "
                        f"blocks ({_PAGED}).")
PAGED_GQA_HINT = ("the query heads are mapped to the wrong KV heads: the program of KV head j serves query heads "
                  "j * group to j * group + group - 1 (query head h reads KV head h // group), loading their "
                  f"queries and storing their outputs at those heads' strides ({_CAUSAL}; {_PAGED}).")
PAGED_STRIDES_HINT = ("only the case with padded rows differs: q, out and the caches each have rows longer than "
                      "head_dim there, out's padded by another amount than q's. Every address comes from its own "
                      "tensor's strides (stride_qb, stride_qh for q; stride_ob, stride_oh for out; the caches' own), "
                      f"never from head_dim or another tensor's strides ({_PAGED}).")
PAGED_EMPTY_HINT = ("an empty context (0 tokens) must give a row of zeros: there is nothing to attend to, so the "
                    f"sum stays 0 and the output must not divide by it ({_PAGED}).")


def _diagnose_paged(failure: Failure) -> str:
    if failure.matches("heads_modulo"):
        return PAGED_GQA_HINT
    if failure.matches("one_short"):
        return PAGED_ONE_SHORT_HINT
    lengths, size = failure.case["lengths"], failure.case["block_size"]
    wrong = [b for b in range(len(lengths)) if not close(failure.got["out"][b], failure.expected["out"][b],
                                                         failure.atol)]
    if wrong and all(lengths[b] == 0 for b in wrong):
        return PAGED_EMPTY_HINT
    if lengths[0] % size and 0 not in wrong and any(lengths[b] for b in wrong):
        return PAGED_TABLE_HINT  # the first sequence (the longest, its last block partial) shows most other mistakes
    if failure.non_finite():
        return PAGED_LAST_BLOCK_HINT
    if failure.only_where(lambda c: c["layout"] == "padded"):
        return PAGED_STRIDES_HINT
    if failure.only_where(lambda c: c["heads"] > c["kv_heads"]):
        return PAGED_GQA_HINT
    return ""


def _paged_access_hint(violation: dict) -> str:
    argument = violation["argument"]
    if violation["side"] == "between":
        return gaps_hint(argument, _PAGED)
    if argument in ("k_cache_ptr", "v_cache_ptr"):
        return (f"a load reached outside `{argument}`: a tile of BLOCK_ROWS rows covers a block of BLOCK_SIZE slots "
                "(BLOCK_ROWS is BLOCK_SIZE rounded up to a power of two), dims past head_dim must not be read, and "
                f"only the table entries of the sequence's own blocks name blocks to read ({_PAGED}).")
    return (f"an access reached outside `{argument}`: BLOCK_G lanes cover the group's query heads (group rounded up "
            "to a power of two) and BLOCK_D lanes the head dimension: lanes past the group or past head_dim must be "
            f"neither read nor stored ({_PAGED}).")


_PAGED_KERNEL = _Kernel("paged_decode_kernel", (("out", "out_ptr"),), _describe_paged, _paged_access_hint,
                        _diagnose_paged)

_register(3, _PAGED_REFERENCE, _drive_paged, [
    ("lab15.paged_ragged", _paged_ragged, compare_values(_PAGED_KERNEL), ""),
    ("lab15.paged_layouts", _paged_layouts, compare_values(_PAGED_KERNEL), "Here: blocks of 6 slots (BLOCK_ROWS "
     "8), SmolLM2's 9 query heads over 3 KV heads with head_dim 64 and rows padded past head_dim (use the "
     "strides), scores of the order of 1e4, and a batch of empty contexts."),
], shared_hint=(
    "one program per (sequence, KV head) serves the group's query heads: it loads the sequence's length, then "
    "walks its blocks in table order, loading each block id from the table and that block's live rows of K and V "
    "in place, with a running max, sum and accumulator per query head (float32); an empty context gives zeros. "
    "Shapes here: ragged lengths in one launch (0, 1, a multiple of the block size, a partial last block), "
    f"shuffled blocks, tables wider than needed; MHA, GQA and MQA ({_PAGED})."))
_register(3, _PAGED_REFERENCE, _drive_paged, [
    ("lab15.paged_in_place", _paged_traffic_cases,
     compare_traffic(_PAGED_KERNEL, "per program its length, its group's queries, one block id per block and each "
                     "live K and V row once; its group's outputs stored once"),
     "decode attention reads the blocks where they are: no K or V row is copied anywhere, each live row of the "
     "program's KV head is loaded once for the whole group of query heads (not once per query head), each block "
     "id once, and nothing but the outputs is stored. Budget: per program its length, its group's queries, one "
     f"block id per block and each live K and V row once; its group's outputs stored once ({_PAGED})."),
])


# --- task 3 in a model ------------------------------------------------------------------------------------

def paged_cached_attention_with(kernel):
    """The model's attention step on a ``PagedLayerCache``: write this step's K/V into their slots; a
    decode step (t = 1) launches ``kernel`` through ``check_bounds``, a prefill uses the torch
    ``paged_attention``. The model stays on the CPU; with a GPU, the step's tensors go to it and back."""

    def attend(q, k_new, v_new, cache):
        import torch

        from infra_lib.serving.paged_attention import paged_attention

        cache.write(k_new, v_new)
        if q.shape[2] != 1:
            return paged_attention(q, cache.k_cache, cache.v_cache, [cache.block_table], [cache.length])
        tables = torch.tensor([cache.block_table], dtype=torch.int32)
        lengths = torch.tensor([cache.length], dtype=torch.int32)
        device_q, k_cache, v_cache, tables, lengths = _to_device(q, cache.k_cache, cache.v_cache, tables, lengths)
        out = torch.full(q.shape, UNWRITTEN, dtype=q.dtype, device=k_cache.device)
        _launch_in_a_model(kernel, "paged_decode_kernel",
                           *paged_launch(kernel, out, device_q, k_cache, v_cache, tables, lengths))
        return out.to(q.device)

    return attend


def _drive_paged_in_model(kernel, case):
    """Greedy tokens of the small random model decoding through ``kernel`` (the reference side: the
    model's own paged attention in torch)."""
    import torch

    from grading.checks.lab06 import tiny_model
    from infra_lib.serving import BlockPool, PagedKVStore, paged_greedy_decode

    require_kernel(kernel, "paged_decode_kernel")
    own = kernel is _PAGED_REFERENCE()
    model = tiny_model(case["seed"])
    results = []
    with torch.inference_mode(), _attention(model, None if own else paged_cached_attention_with(kernel)):
        for prompt in case["prompts"]:
            size = case["block_size"]
            pool, store = BlockPool(16, size), PagedKVStore.for_model(model.config, 16, size)
            pool.allocate(case["skip_blocks"])  # the sequence's blocks do not start at block 0
            results.append({"tokens": paged_greedy_decode(model, store, pool, prompt, case["new_tokens"]).token_ids})
    return results


def _paged_model_case(rng: random.Random) -> dict:
    return {"model": "tiny", "seed": _seed(rng), "new_tokens": 4, "block_size": rng.choice([3, 4]),
            "skip_blocks": rng.randint(1, 4), "prompts": [[rng.randrange(96) for _ in range(rng.randint(2, 9))]]}


_register(3, _PAGED_REFERENCE, _drive_paged_in_model, [
    ("lab15.paged_in_tiny_model", _paged_model_case, _compare_in_model,
     "the small random model decodes through your kernel: every decode step attends its one new query over the "
     "blocks the sequence owns in a paged store (6 query heads over 2 KV heads, head_dim 8), the new token's key "
     f"and value already written into their slot ({_PAGED}; {_LESSON} “7 · The real model through the kernels”)."),
])


# --- task 4 (bonus): q4_gemv_kernel ------------------------------------------------------------------

def _gemv_case(rng: random.Random, m: int, n: int, k: int, group: int, block_n: int, *, pad: int = 0,
               y_pad: int = 0, w_pad: int = 0) -> dict:
    """``pad``, ``y_pad``, ``w_pad``: elements past the end of each row of x, of y, and of packed and scales."""
    return {"seed": _seed(rng), "m": m, "n": n, "k": k, "group": group, "block_n": block_n, "pad": pad,
            "y_pad": y_pad, "w_pad": w_pad}


def _gemv_odd_shapes(rng):
    return [_gemv_case(rng, 1, _partial(rng, 20, 50), 64, 32, 16),
            _gemv_case(rng, 3, _partial(rng, 40, 70, 32), 128, 32, 32, pad=rng.randint(1, 9), y_pad=rng.randint(1, 5)),
            _gemv_case(rng, rng.randint(17, 20), 16, 128, 64, 16, y_pad=rng.randint(1, 5), w_pad=rng.randint(1, 7))]


def _gemv_traffic_cases(rng):
    return [_gemv_case(rng, 1, _partial(rng, 33, 64), 256, 32, 16), _gemv_case(rng, 1, 96, 576, 64, 32),
            _gemv_case(rng, 2, _partial(rng, 17, 31), 96, 32, 16)]


def _gemv_tensors(case):
    """x [m, k] (rows padded by ``pad``), packed uint8 [n, k // 2] and scales [n, k // group] as
    ``QuantLinear(bits=4)`` stores a random weight (both with rows padded by ``w_pad``)."""
    import torch

    from infra_lib.model.quant import pack_int4, quantize_symmetric

    generator = _generator(case["seed"])
    m, n, k = case["m"], case["n"], case["k"]
    q, scales = quantize_symmetric(torch.randn(n, k, generator=generator), 4, case["group"])
    x = torch.randn(m, k + case["pad"], generator=generator)[:, :k]
    packed, padded_scales = (torch.nn.functional.pad(t, (0, case["w_pad"]))[:, :t.shape[1]]
                             for t in (pack_int4(q), scales))
    return x, packed, padded_scales, q


def _gemv_alternatives(case, x, q, scales) -> dict:
    """y for the usual misreadings of the storage, in float64: nibbles swapped within each byte, the
    +8 offset never taken off, one scale per row instead of per group."""
    import torch

    group = case["group"]
    stored = q.to(torch.int64) + 8  # the nibbles as stored, 0..15
    swapped = stored.reshape(q.shape[0], -1, 2).flip(-1).reshape(q.shape) - 8
    per_group = scales.double().repeat_interleave(group, 1)
    found = {"nibbles_swapped": swapped.double() * per_group, "no_offset": stored.double() * per_group,
             "first_scale_only": q.double() * scales.double()[:, :1]}
    truth = x.double() @ (q.double() * per_group).T
    return {name: (x.double() @ w.T).tolist() for name, w in found.items()
            if not torch.allclose(x.double() @ w.T, truth, atol=1e-4)}


def _drive_gemv(kernel, cases):
    import torch

    require_kernel(kernel, "q4_gemv_kernel")
    results = []
    for case in cases:
        x, packed, scales, q = _gemv_tensors(case)
        alternatives = _gemv_alternatives(case, x, q, scales)
        x, packed, scales = _to_device(x, packed, scales)
        y = torch.full((case["m"], case["n"] + case["y_pad"]), UNWRITTEN, device=x.device)[:, :case["n"]]
        grid = (-(-case["m"] // 16), -(-case["n"] // case["block_n"]))
        args = (x, packed, scales, y, case["m"], case["n"], case["k"], x.stride(0), packed.stride(0),
                scales.stride(0), y.stride(0))
        meta = {"GROUP": case["group"], "BLOCK_M": 16, "BLOCK_N": case["block_n"]}
        result = launch(kernel, grid, args, meta, {"x_ptr": x, "packed_ptr": packed, "scales_ptr": scales})
        result.update(out=_values(y), alternatives=alternatives)
        results.append(result)
    return results


def _describe_gemv(case) -> str:
    m, n, k = case["m"], case["n"], case["k"]
    strides = (f"row strides: x {k + case['pad']}, y {n + case['y_pad']}, packed {k // 2 + case['w_pad']}, "
               f"scales {k // case['group'] + case['w_pad']}")
    return (f"x [{m}, {k}] @ W.T with W [{n}, {k}] in groups of {case['group']} ({strides}), "
            f"BLOCK_M=16, BLOCK_N={case['block_n']}, grid ({-(-m // 16)}, {-(-n // case['block_n'])})")


_GEMV = f"{_LESSON} “6 · A fused 4-bit GEMV”"
GEMV_NIBBLE_HINT = ("the two weights of a byte are swapped: byte j of a row holds weight 2j in its low four bits "
                    f"(byte & 15) and weight 2j + 1 in its high four bits (byte >> 4) ({_GEMV}).")
GEMV_OFFSET_HINT = ("each nibble stores q + 8, so that q in -8..7 fits 0..15: the weight is (nibble - 8) times its "
                    f"group's scale ({_GEMV}).")
GEMV_SCALE_HINT = ("every weight used the first scale of its row: a row has one scale per group of GROUP weights, "
                   f"and weight k takes the scale of group k // GROUP ({_GEMV}).")


GEMV_STRIDES_HINT = ("only a case with padded rows differs: x, y, the packed bytes and the scales each have a row "
                     "stride of their own (stride_xm, stride_ym, stride_pn, stride_sn), longer than the row there. "
                     f"Every address comes from them, never from K, N, K // 2 or K // GROUP ({_GEMV}).")


def _diagnose_gemv(failure: Failure) -> str:
    for name, hint in (("nibbles_swapped", GEMV_NIBBLE_HINT), ("no_offset", GEMV_OFFSET_HINT),
                       ("first_scale_only", GEMV_SCALE_HINT)):
        if failure.matches(name):
            return hint
    if failure.only_where(lambda c: c["pad"] or c["y_pad"] or c["w_pad"]):
        return GEMV_STRIDES_HINT
    return ""


def _gemv_access_hint(violation: dict) -> str:
    if violation["side"] == "between":
        return gaps_hint(violation["argument"], _GEMV)
    return (f"an access reached outside `{violation['argument']}`: the tiles at the edges hang over, rows of x and "
            f"y past M and columns of y (rows of W, of the packed bytes and of the scales) past N must be neither "
            f"read nor stored ({_GEMV}).")


_GEMV_KERNEL = _Kernel("q4_gemv_kernel", (("out", "y_ptr"),), _describe_gemv, _gemv_access_hint,
                       _diagnose_gemv)

_register(4, _GEMV_REFERENCE, _drive_gemv, [
    ("lab15.gemv_q4_odd_shapes", _gemv_odd_shapes, compare_values(_GEMV_KERNEL),
     "each program owns a BLOCK_M x BLOCK_N tile of y and walks k one group at a time: the group's packed "
     "bytes of its BLOCK_N rows give two tiles of small integers (low and high nibbles, each less 8), each "
     "multiplied by the x columns it pairs with (even and odd k), and the group's scale multiplies the "
     "partial sum; accumulate in float32. Shapes here: a single row of x (a GEMV), N not a multiple of "
     f"BLOCK_N, x with padded rows, groups of 32 and 64 ({_GEMV})."),
    ("lab15.gemv_q4_reads_packed", _gemv_traffic_cases,
     compare_traffic(_GEMV_KERNEL, "per program its BLOCK_N rows of packed bytes and scales once, its rows of x "
                     "once; y stored once"),
     "the point of the fused kernel is that only the stored bytes cross memory: half a byte per weight and its "
     "share of a scale, read once by each program, never a float copy of W. Budget: per program its BLOCK_N rows "
     f"of packed bytes and scales once, its rows of x once, and its tile of y stored once ({_GEMV})."),
])
