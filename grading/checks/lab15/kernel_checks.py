"""Launching a learner's lab 15 kernel and comparing what it gave with the reference kernel's: the
tasks' signatures and stated tolerances, the guarded launch, the diagnosis of a value difference by
the mistake it matches, and the pieces every task's driver uses (seeds, devices, a model's
attention through a kernel)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

from grading.checks import triton_cases
from grading.checks.common import array_mismatch
from grading.checks.model_cases import in_model_comparison
from grading.checks.triton_cases import UNWRITTEN, Tolerance
from grading.registry import Mismatch

SIGNATURES = {  # the parameters each kernel takes, in order (those of the course's reference kernels)
    "online_softmax_kernel": "out_ptr in_ptr n_cols in_row_stride out_row_stride BLOCK".split(),
    "flash_attention_kernel": (
        "q_ptr k_ptr v_ptr out_ptr lse_ptr n_heads group t s head_dim scale stride_qb stride_qh stride_qt stride_qd "
        "stride_kb stride_kh stride_ks stride_kd stride_vb stride_vh stride_vs stride_vd stride_ob stride_oh "
        "stride_ot stride_od CAUSAL BLOCK_M BLOCK_N BLOCK_D"
    ).split(),
    "paged_decode_kernel": (
        "out_ptr q_ptr k_cache_ptr v_cache_ptr tables_ptr seq_lens_ptr group head_dim scale stride_qb stride_qh "
        "stride_ob stride_oh stride_kb stride_kt stride_kh stride_vb stride_vt stride_vh stride_table BLOCK_SIZE "
        "BLOCK_ROWS BLOCK_G BLOCK_D"
    ).split(),
    "q4_gemv_kernel": "x_ptr packed_ptr scales_ptr y_ptr M N K stride_xm stride_pn stride_sn stride_ym GROUP BLOCK_M "
    "BLOCK_N".split(),
}
TASKS = {
    1: "lab15 task 1: online_softmax_kernel",
    2: "lab15 task 2: flash_attention_kernel",
    3: "lab15 task 3: paged_decode_kernel",
    4: "lab15 task 4: q4_gemv_kernel",
}
LESSON = "chapter 15, section"
CAUSAL_SECTION = f"{LESSON} “4 · Causal tiles and grouped heads”"
MODEL_SECTION = f"{LESSON} “7 · The real model through the kernels”"


def task_parts(task: int, reference, drive) -> dict:
    """The fields a task's checks share: the task as its stub names it, the reference kernel, the driver."""
    return {"task": TASKS[task], "reference": reference, "drive": drive}


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
        raise TypeError(
            f"{name} must be a Triton kernel, exactly as @triton.jit returns it: put @triton.jit on the "
            f"line above `def {name}(...)` (got a {type(kernel).__name__}); the check launches it itself"
        )
    names = list(kernel.arg_names)
    if names != SIGNATURES[name]:
        raise TypeError(
            f"{name} must take the parameters ({', '.join(SIGNATURES[name])}) in that order, got ({', '.join(names)})"
        )


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
        with count_traffic() if interpreted else contextlib.nullcontext() as traffic:
            report = check_bounds(kernel, grid, *args, raise_on_error=False, **meta)
    except Exception as exc:  # the learner's kernel may raise anything
        raise triton_cases.plain_error(exc, "lab15") from None
    result = {
        "interpreted": interpreted,
        "violations": [v.as_dict() for v in report.violations],
        "written_inputs": [name for name, bits in before.items() if not torch.equal(bits, _bits(inputs[name]))],
    }
    if traffic is not None:
        result.update(bytes_loaded=traffic.bytes_loaded, bytes_stored=traffic.bytes_stored)
    return result


def as_values(tensor) -> list:
    """A tensor's values as nested lists of floats, as a driver records an output."""
    return tensor.detach().cpu().double().tolist()


# --- comparing ----------------------------------------------------------------------------------------

RTOL = 1e-4  # the relative part of every value comparison


def _stated(atol: float, gpu_atol: float) -> Tolerance:
    """A kernel's tolerance as the lab states it: ``RTOL`` relative, interpreted and compiled alike."""
    return Tolerance(atol, RTOL, gpu_atol, RTOL)


# What the lab's text states for each kernel's outputs (tests/test_lab15.py reads it back from the text).
TOLERANCES = {
    "online_softmax_kernel": _stated(1e-6, 1e-5),
    "flash_attention_kernel": _stated(2e-5, 2e-2),
    "paged_decode_kernel": _stated(2e-5, 1e-3),
    "q4_gemv_kernel": _stated(1e-4, 3e-2),
}
MODEL_LOGITS = _stated(1e-3, 2e-2)  # SmolLM2's logits after a prompt attended through the learner's kernel


@dataclass(frozen=True)
class KernelSpec:
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
        """The absolute tolerance for a learner's result ``g`` against the reference's ``e``."""
        return self.tolerances.for_sides(g, e)[0]


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
        return any(
            name in alternatives and close(self.got[key], alternatives[name], max(self.atol, 1e-4)) for name in names
        )

    def non_finite(self, key: str = "out") -> bool:
        """NaN or inf in the learner's ``key`` where the reference's is finite."""
        import numpy as np

        got, expected = np.asarray(self.got[key], dtype=np.float64), np.asarray(self.expected[key], dtype=np.float64)
        return bool((np.isfinite(expected) & ~np.isfinite(got)).any())

    def only_where(self, feature: Callable[[dict], bool]) -> bool:
        """Every failing case has ``feature``, and some case without it passed."""
        return all(feature(self.cases[i]) for i in self.failing) and any(
            not feature(c) for i, c in enumerate(self.cases) if i not in self.failing
        )


def close(got, expected, atol: float) -> bool:
    """Every element within ``atol`` (plus ``RTOL`` relative), NaN never close: lists from the drivers."""
    import numpy as np

    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return got.shape == expected.shape and bool(np.isclose(got, expected, atol=atol, rtol=RTOL).all())


def gaps_hint(argument: str, section: str) -> str:
    """The hint for an access in the gaps of a tensor whose rows are padded: a mask or a stride."""
    return (
        f"an access landed in the gaps between the rows of `{argument}`, whose rows are padded here: each tensor "
        "is walked with its own strides, passed in as arguments, never with another tensor's or with an assumed "
        f"row length, and lanes past the end of a row (past head_dim, N or n_cols) are switched off ({section})."
    )


def _access_problem(spec: KernelSpec, g: dict, where: str) -> Mismatch | None:
    if g["violations"]:
        first = g["violations"][0]
        what = f"{spec.name} {triton_cases.outside(first)}" + (
            " (and the values reached its outputs)" if first["kind"] == "load" else ""
        )
        details = "; ".join(f"{triton_cases.outside(v)}: {v['elements']} element(s)" for v in g["violations"])
        return Mismatch(what, f"on {where}: {details}", hint=spec.access_hint(first))
    if g["written_inputs"]:
        names = ", ".join(f"`{name}`" for name in g["written_inputs"])
        return Mismatch(
            f"{spec.name} wrote into {names}, which it must only read",
            f"on {where}",
            hint="a kernel's inputs are shared memory (in a server, the KV cache holds every sequence's "
            "keys and values): it reads them and stores only into its outputs.",
        )
    return None


def _output_problem(spec: KernelSpec, g: dict, e: dict, where: str) -> Mismatch | None:
    import numpy as np

    atol, rtol = spec.tolerances.for_sides(g, e)
    for key, argument in spec.outputs:
        got, expected = np.asarray(g[key], dtype=np.float64), np.asarray(e[key], dtype=np.float64)
        if got.shape == expected.shape:
            unwritten = (got == UNWRITTEN) & (expected != UNWRITTEN)
            if unwritten.any():
                return Mismatch(
                    f"{spec.name} left elements of `{argument}` unwritten",
                    f"on {where}: {int(unwritten.sum())} of {got.size} elements still hold the "
                    f"{UNWRITTEN:g} they held before the launch",
                )
            bad = np.isfinite(expected) & ~np.isfinite(got)
            if bad.any():
                return Mismatch(
                    f"{spec.name} stored NaN or inf into `{argument}` where the result is finite",
                    f"on {where}: {int(bad.sum())} of {got.size} elements",
                )
        problem = array_mismatch(
            g[key], e[key], f"{spec.name}'s `{argument}` differs from the reference", where, atol=atol, rtol=rtol
        )
        if problem:
            return problem
    return None


def compare_values(spec: KernelSpec):
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


def compare_traffic(spec: KernelSpec, budget: str):
    """Values first (a value difference keeps its diagnosed hint, else: fix the values first), then
    the count of the bytes loaded and stored against the reference kernel's on the same launch (which
    compares the values again, with the tolerances this lab states)."""
    values = compare_values(spec)
    bytes_moved = triton_cases.compare_traffic(spec.name, spec.describe, budget, spec.tolerances)

    def compare(got, expected, cases):
        problem = values(got, expected, cases)
        if problem:
            return problem if problem.hint else Mismatch(problem.what, problem.detail, hint=triton_cases.VALUES_FIRST)
        return bytes_moved(got, expected, cases)

    return compare


# --- the drivers' pieces ---------------------------------------------------------------------------------


def draw_seed(rng: random.Random) -> int:
    """A case's seed for its tensors."""
    return rng.randrange(10**6)


def generator(seed: int):
    """A torch generator seeded with ``seed``."""
    import torch

    return torch.Generator().manual_seed(seed)


def to_device(*tensors):
    """The tensors on the device the kernels run on."""
    from infra_lib.kernels.triton_env import kernel_device

    return tuple(t.to(kernel_device()) for t in tensors)


def not_a_multiple(rng: random.Random, low: int, high: int, block: int = 16) -> int:
    """A length in [low, high] that is not a multiple of ``block``."""
    return rng.choice([n for n in range(low, high + 1) if n % block])


def attention64(q, k, v, visible, kv_of_head):
    """Attention in float64 with an explicit mask and head mapping: (scores masked with -inf, out)."""
    import torch

    keys, values = k.double()[:, kv_of_head], v.double()[:, kv_of_head]
    scores = (q.double() @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, float("-inf"))
    return scores, torch.softmax(scores, -1) @ values


# --- a model attending through a kernel ---------------------------------------------------------------------


def launch_in_a_model(kernel, name: str, grid, args: tuple, meta: dict) -> None:
    """``launch`` inside a model's forward pass: an access outside a tensor stops the model, named."""
    violations = launch(kernel, grid, args, meta)["violations"]
    if violations:
        raise IndexError(f"{name} {triton_cases.outside(violations[0])} inside the model")


def attending_with(model, attention_fn):
    """``model.using_attention(attention_fn)``, or the model's own attention for None."""
    import contextlib

    return contextlib.nullcontext() if attention_fn is None else model.using_attention(attention_fn)


def _model_input(case: dict, prompt) -> str:
    if isinstance(prompt, str):
        return f"SmolLM2, prompt {prompt!r}"
    return f"the small random model (seed {case['seed']}), a prompt of {len(prompt)} token(s)"


# Greedy decoding through the learner's kernel against the reference's: the logits after the prompt where
# the reference recorded them, within MODEL_LOGITS, then the tokens.
compare_in_model = in_model_comparison(
    _model_input,
    "the model's logits after the prompt differ",
    "greedy decoding through your kernel produced different tokens",
    MODEL_LOGITS.for_sides,
)
