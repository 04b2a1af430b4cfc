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
import subprocess
import sys
import tempfile
from pathlib import Path

from grading.checks.common import reference
from grading.checks.softmax_cases import describe_softmax, softmax_buffers, softmax_case
from grading.checks.triton_cases import (
    Tolerance,
    compare_bounds,
    compare_traffic,
    compare_values,
    empty_rows,
    plain_error,
    row_block,
    seeded_tensor,
    with_row_gaps,
)
from grading.registry import Check, Mismatch, register, register_shortcuts

register_shortcuts(
    "lab03",
    [
        "infra_lib.kernels.softmax:softmax",
        "infra_lib.kernels.softmax:softmax_three_pass",
        "infra_lib.kernels.softmax:online_softmax_kernel",  # lab 15's reference: a softmax in one pass
        "infra_lib.kernels.matmul:matmul",
        "infra_lib.kernels.rmsnorm:rmsnorm",
    ],
)

_SIGNATURES = {
    "softmax_kernel": ["out_ptr", "in_ptr", "n_cols", "in_row_stride", "out_row_stride", "BLOCK"],
    "matmul_kernel": [
        "a_ptr",
        "b_ptr",
        "c_ptr",
        "M",
        "N",
        "K",
        "stride_am",
        "stride_ak",
        "stride_bk",
        "stride_bn",
        "stride_cm",
        "stride_cn",
        "BLOCK_M",
        "BLOCK_N",
        "BLOCK_K",
    ],
    "rmsnorm_kernel": ["out_ptr", "x_ptr", "w_ptr", "n_cols", "x_row_stride", "out_row_stride", "eps", "BLOCK"],
}


# Each kernel's value tolerances: what the lab's text states for each task (tests/test_lab03_rules.py
# reads them back from the text), and what every value comparison of that kernel uses.
TOLERANCES = {
    "softmax_kernel": Tolerance(atol=1e-6, rtol=1e-4, gpu_atol=1e-5, gpu_rtol=1e-4),
    "matmul_kernel": Tolerance(atol=1e-4, rtol=1e-4, gpu_atol=3e-2, gpu_rtol=3e-2),
    "rmsnorm_kernel": Tolerance(atol=1e-5, rtol=1e-4, gpu_atol=1e-4, gpu_rtol=1e-4),
}


# --- launching a learner's kernel -----------------------------------------------------------------


def _require_kernel(kernel, name: str) -> None:
    if not (hasattr(kernel, "run") and hasattr(kernel, "__getitem__")):
        raise TypeError(
            f"{name} must be a Triton kernel: put @triton.jit on the line above `def {name}(...)` "
            f"(got {type(kernel).__name__})"
        )
    names = list(getattr(kernel, "arg_names", []))
    if names != _SIGNATURES[name]:
        raise TypeError(
            f"{name} must take the parameters ({', '.join(_SIGNATURES[name])}) in that order, got ({', '.join(names)})"
        )


def _guarded_launch(kernel, grid, args, meta) -> list[dict]:
    """Launch with guard bands around every tensor; return the out-of-range accesses found."""
    from infra_lib.kernels.oob import check_bounds

    try:
        report = check_bounds(kernel, grid, *args, raise_on_error=False, **meta)
    except Exception as exc:  # the learner's kernel may raise anything
        raise plain_error(exc, "lab03") from None
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
                result.update(
                    bytes_loaded=traffic.bytes_loaded,
                    bytes_stored=traffic.bytes_stored,
                    loaded_from=dict(traffic.loaded_from),
                    stored_to=dict(traffic.stored_to),
                )
            else:
                result["violations"] = _guarded_launch(kernel, grid, args, meta)
            result["out"] = out.cpu().double().tolist()
            results.append(result)
        return results

    return drive


def _import_path(kernel) -> str | None:
    """ "module:name" of a module's kernel; None for one defined elsewhere (a notebook's: a learner's)."""
    function = getattr(kernel, "fn", None)
    module = sys.modules.get(getattr(function, "__module__", None) or "")
    name = getattr(function, "__name__", "")
    if module is None or module.__name__ == "__main__" or getattr(module, name, None) is not kernel:
        return None
    return f"{module.__name__}:{name}"


_CHILD = "import sys; from grading.checks import lab03; lab03.drive_request(sys.argv[1])"
_CHILD_TIMEOUT_S = 600


def _drive_interpreted(name: str, setup, kernel_path: str, cases) -> list[dict]:
    """The drive of ``kernel_path`` in a fresh Python that sees no GPU, so that Triton interprets it and
    its bytes are counted, as a sandboxed kernel's are.

    Raises:
        RuntimeError: the child failed (the grader then reports the reference's failure, not the learner's).
    """
    from infra_lib.kernels.triton_env import INTERPRET_ENV

    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        INTERPRET_ENV: "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
    }
    with tempfile.TemporaryDirectory(prefix="lab03-traffic-") as folder:
        request = Path(folder) / "request.json"
        request.write_text(json.dumps({"name": name, "setup": setup.__name__, "kernel": kernel_path, "cases": cases}))
        try:
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, str(request)],
                env=env,
                cwd=root,
                capture_output=True,
                text=True,
                timeout=_CHILD_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"counting the bytes of {kernel_path} in Triton's interpreter took over {_CHILD_TIMEOUT_S} s"
            ) from exc
        if done.returncode != 0:
            raise RuntimeError(
                f"counting the bytes of {kernel_path} in Triton's interpreter (Triton compiles here, "
                f"so a child Python counts them) failed: {done.stderr.strip()[-800:]}"
            )
        return json.loads((Path(folder) / "result.json").read_text())


def drive_request(path: str) -> None:
    """In the child of ``_drive_interpreted``: drive the request at ``path``, write result.json beside it."""
    from infra_lib.kernels.triton_env import interpreter_active, load_triton

    load_triton()
    if not interpreter_active():
        raise RuntimeError("Triton still compiles in the child: its bytes cannot be counted")
    request = json.loads(Path(path).read_text())
    module, name = request["kernel"].split(":")
    kernel = getattr(importlib.import_module(module), name)
    setup = {f.__name__: f for f in (softmax_setup, matmul_setup, rmsnorm_setup)}[request["setup"]]
    results = _driver(request["name"], setup, count_traffic=True)(kernel, request["cases"])
    Path(path).with_name("result.json").write_text(json.dumps(results))


# --- task 1: softmax_kernel -------------------------------------------------------------------------


def _softmax_case(
    rng: random.Random, rows: int, cols: int, *, pad: int = 0, out_pad: int = 0, scale: float = 3.0, special: str = ""
) -> dict:
    return softmax_case(rng, rows, cols, pad=pad, out_pad=out_pad, scale=scale, special=special)


def _softmax_shapes(rng):
    return [
        _softmax_case(rng, 1, 1),
        _softmax_case(rng, 1, rng.randint(100, 300)),
        _softmax_case(rng, rng.randint(3, 9), 1),
        _softmax_case(rng, rng.randint(20, 40), rng.randint(129, 255)),
        _softmax_case(rng, rng.randint(5, 12), rng.randint(33, 63), pad=rng.randint(1, 40), out_pad=rng.randint(1, 9)),
    ]


def _softmax_extremes(rng):
    return [
        _softmax_case(rng, 8, rng.randint(40, 120), scale=1e4),
        _softmax_case(rng, 6, rng.randint(20, 60), special="huge"),
        _softmax_case(rng, 7, rng.randint(20, 60), special="-inf"),
        _softmax_case(rng, 4, rng.randint(20, 60), scale=100.0, special="one finite"),
    ]


def _softmax_bounds_cases(rng):
    return [
        _softmax_case(rng, rng.randint(3, 8), rng.randint(17, 63), pad=rng.randint(3, 20)),
        _softmax_case(rng, rng.randint(2, 5), rng.randint(129, 200), out_pad=rng.randint(1, 9)),
    ]


def _softmax_traffic_cases(rng):
    return [_softmax_case(rng, rng.randint(16, 40), rng.randint(100, 300)), _softmax_case(rng, 3, 1)]


def softmax_setup(case):
    """(out, grid, args, meta) of task 1's launch on the case."""
    import torch

    rows, cols, special = case["rows"], case["cols"], case["special"]
    x = seeded_tensor(case["seed"], rows, cols, scale=case["scale"])
    if special == "huge":  # every logit near 1e4: exp overflows without the max subtraction
        x = x / case["scale"] * 0.5 + 1e4
    elif special in ("-inf", "one finite"):
        generator = torch.Generator().manual_seed(case["seed"] + 1)
        hide = (
            torch.rand(rows, cols, generator=generator) < 0.6
            if special == "-inf"
            else torch.ones(rows, cols, dtype=torch.bool)
        )
        hide[torch.arange(rows), torch.randint(0, cols, (rows,), generator=generator)] = False  # one finite per row
        x = x.masked_fill(hide.to(x.device), float("-inf"))
    x, out = softmax_buffers(x, case)
    return out, (rows,), (out, x, cols, x.stride(0), out.stride(0)), {"BLOCK": row_block(cols)}


_SPECIALS = {
    "huge": ", every logit near 1e4",
    "-inf": ", many logits -inf",
    "one finite": ", all but one logit per row -inf",
}


def _describe_softmax(case) -> str:
    return describe_softmax(case, _SPECIALS)


_SOFTMAX = reference("infra_lib.kernels.softmax", "softmax_kernel")
_SOFTMAX_HINT = (
    "one program owns one row, and each row starts one row stride after the previous one, with separate "
    "strides for the input and the output that may exceed n_cols; lanes past n_cols must be switched off "
    "and must load a value that changes neither the row's max nor its sum. Shapes here: [1, 1], one row, "
    "one column, widths that are not a power of two, strided rows (chapter 03, section “4 · Fused "
    "softmax: the same maths, half the bytes”)."
)

_SOFTMAX_NAN_HINT = (
    "a NaN or inf where every probability is finite comes from the exponential: without each row "
    "shifted by its own maximum first, exp overflows float32 above about 88 and inf / inf is NaN; "
    "a padded lane that loads a value which changes the row's max or sum spoils the row the same "
    "way (chapter 03, section “4 · Fused softmax: the same maths, half the bytes”)."
)

register(
    Check(
        check_id="lab03.softmax_odd_shapes",
        task="lab03 task 1: softmax_kernel",
        reference=_SOFTMAX,
        make_inputs=_softmax_shapes,
        drive=_driver("softmax_kernel", softmax_setup),
        compare=compare_values("softmax_kernel", _describe_softmax, TOLERANCES["softmax_kernel"], _SOFTMAX_NAN_HINT),
        hint=_SOFTMAX_HINT,
    )
)

_MINUS_INF_HINT = (
    "a -inf logit is a key that must not be attended at all: exp of -inf after the shift is exactly 0, "
    "and that 0 must reach the output unchanged; a floor or a small constant added to the probabilities "
    "gives such a key a weight after all (chapter 03, section “4 · Fused softmax: the same maths, half "
    "the bytes”)."
)


def _compare_softmax_extremes(got, expected, cases) -> Mismatch | None:
    """Values as every softmax check compares them; then, in the rows with -inf logits, a probability of
    exactly 0 for each of them (the reference's zeros there are the -inf positions: the finite logits of
    those cases are too close together to underflow)."""
    import numpy as np

    problem = compare_values("softmax_kernel", _describe_softmax, TOLERANCES["softmax_kernel"], _SOFTMAX_NAN_HINT)(
        got, expected, cases
    )
    if problem:
        return problem
    for case, g, e in zip(cases, got, expected):
        if case["special"] not in ("-inf", "one finite"):
            continue
        mine, want = np.asarray(g["out"], dtype=np.float64), np.asarray(e["out"], dtype=np.float64)
        leaked = (want == 0) & (mine != 0)
        if leaked.any():
            index = tuple(int(i) for i in np.argwhere(leaked)[0])
            return Mismatch(
                "softmax_kernel gave a -inf logit a probability other than exactly 0",
                f"on {_describe_softmax(case)}: {int(leaked.sum())} of {int((want == 0).sum())} -inf "
                f"logits; at index {list(index)} expected 0, got {mine[index]:.3g}",
                hint=_MINUS_INF_HINT,
            )
    return None


register(
    Check(
        check_id="lab03.softmax_extreme_values",
        task="lab03 task 1: softmax_kernel",
        reference=_SOFTMAX,
        make_inputs=_softmax_extremes,
        drive=_driver("softmax_kernel", softmax_setup),
        compare=_compare_softmax_extremes,
        hint="exp overflows float32 for any logit above about 88 (and inf / inf is NaN), so each row must be "
        "shifted by "
        "its own true maximum before the exponential; a padded lane must never become that maximum. -inf logits must "
        "come out as probability 0, even in a row where only one logit is finite. Cases: logits of scale 1e4, every "
        "logit near 1e4, many -inf logits, all but one logit per row -inf.",
    )
)

register(
    Check(
        check_id="lab03.softmax_in_bounds",
        task="lab03 task 1: softmax_kernel",
        reference=_SOFTMAX,
        make_inputs=_softmax_bounds_cases,
        drive=_driver("softmax_kernel", softmax_setup),
        compare=compare_bounds("softmax_kernel", _describe_softmax),
        hint="BLOCK is n_cols rounded up to a power of two, so the last lanes of every row lie past its end, in the "
        "gap "
        "before the next row or past the tensor: the load and the store both need a mask that switches those lanes "
        "off. "
        "Here the rows of x or out are strided, with gaps that the checker watches (chapter 03, section “6 · "
        "Catching a "
        "missing mask”).",
    )
)

register(
    Check(
        check_id="lab03.softmax_reads_once",
        task="lab03 task 1: softmax_kernel",
        reference=_SOFTMAX,
        make_inputs=_softmax_traffic_cases,
        drive=_driver("softmax_kernel", softmax_setup, count_traffic=True),
        compare=compare_traffic(
            "softmax_kernel",
            _describe_softmax,
            "each element of x read once, each element of out written once",
            TOLERANCES["softmax_kernel"],
            nan_hint=_SOFTMAX_NAN_HINT,
        ),
        hint="the fused kernel's promise is one trip to memory per element: once loaded, the row stays in registers "
        "until the result is stored, and nothing in between is written out or read again. Lanes past n_cols count as "
        "traffic too unless masked off. Budget: each element of x read once, each element of out written once "
        "(chapter 03, section “4 · Fused softmax: the same maths, half the bytes”).",
    )
)


# --- task 2: matmul_kernel --------------------------------------------------------------------------


def _matmul_case(rng: random.Random, m: int, n: int, k: int, blocks=(32, 32, 32), layout: str = "contiguous") -> dict:
    return {"seed": rng.randrange(10**6), "m": m, "n": n, "k": k, "blocks": list(blocks), "layout": layout}


def _matmul_shapes(rng):
    return [
        _matmul_case(rng, 1, 1, 1, (16, 16, 16)),
        _matmul_case(rng, rng.randint(40, 70), rng.randint(20, 50), rng.randint(33, 90)),
        _matmul_case(rng, rng.randint(17, 31), rng.randint(9, 15), rng.randint(65, 80), (16, 16, 16)),
        _matmul_case(rng, 64, 32, 64),
    ]


def _matmul_strided(rng):
    return [
        _matmul_case(rng, rng.randint(33, 60), rng.randint(17, 40), rng.randint(20, 70), layout="transposed"),
        _matmul_case(rng, rng.randint(5, 15), rng.randint(40, 70), rng.randint(33, 50), (16, 32, 16), "transposed"),
    ]


def _matmul_block_shapes(rng):
    return [
        _matmul_case(rng, rng.randint(20, 40), rng.randint(50, 90), rng.randint(17, 40), (16, 64, 16)),
        _matmul_case(rng, rng.randint(50, 90), rng.randint(10, 30), rng.randint(20, 60), (64, 16, 32)),
    ]


def _matmul_edge_cases(rng):
    return [
        _matmul_case(rng, rng.randint(33, 50), rng.randint(17, 30), rng.randint(33, 60), layout="transposed"),
        _matmul_case(rng, rng.randint(3, 12), rng.randint(3, 12), rng.randint(3, 12), (16, 16, 16)),
    ]


def matmul_setup(case):
    """(out, grid, args, meta) of task 2's launch on the case."""
    import torch

    m, n, k = case["m"], case["n"], case["k"]
    bm, bn, bk = case["blocks"]
    a, b = seeded_tensor(case["seed"], m, k), seeded_tensor(case["seed"] + 1, k, n)
    if case["layout"] == "transposed":  # column-major A, B and C: strides (1, rows)
        a, b = a.t().contiguous().t(), b.t().contiguous().t()
        c = torch.full((n, m), -7.0, device=a.device).t()
    else:
        c = torch.full((m, n), -7.0, device=a.device)
    grid = (-(-m // bm), -(-n // bn))
    return (
        c,
        grid,
        (a, b, c, m, n, k, *a.stride(), *b.stride(), *c.stride()),
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
    )


def _describe_matmul(case) -> str:
    m, n, k = case["m"], case["n"], case["k"]
    bm, bn, bk = case["blocks"]
    layout = "A, B and C column-major (transposed strides)" if case["layout"] == "transposed" else "contiguous"
    return (
        f"A [{m}, {k}] @ B [{k}, {n}], {layout}, BLOCK_M={bm}, BLOCK_N={bn}, BLOCK_K={bk}, "
        f"grid ({-(-m // bm)}, {-(-n // bn)})"
    )


_MATMUL = reference("infra_lib.kernels.matmul", "matmul_kernel")
_MATMUL_HINT = (
    "each program owns one BLOCK_M × BLOCK_N tile of C, built up over the slices of K in a float32 "
    "accumulator that stays in registers until the one store (chapter 03, section “5 · Tiled matrix "
    "multiplication”)."
)


def matmul_values() -> dict:
    """The fields task 2's value checks share: the task, the reference, the driver and the comparison."""
    return {
        "task": "lab03 task 2: matmul_kernel",
        "reference": _MATMUL,
        "drive": _driver("matmul_kernel", matmul_setup),
        "compare": compare_values("matmul_kernel", _describe_matmul, TOLERANCES["matmul_kernel"]),
    }


register(
    Check(
        check_id="lab03.matmul_odd_shapes",
        make_inputs=_matmul_shapes,
        hint=_MATMUL_HINT
        + " M, N and K are not multiples of the blocks: the edge tiles and the last step along K hang "
        "over A and B, and their outside lanes must contribute nothing to the product, while C's outside lanes must "
        "not "
        "be stored.",
        **matmul_values(),
    )
)

register(
    Check(
        check_id="lab03.matmul_strided",
        make_inputs=_matmul_strided,
        hint=_MATMUL_HINT + " Every address in A, B and C comes from the strides passed in, never from an assumed row "
        "length such as K or N: here A, B and C are transposed views.",
        **matmul_values(),
    )
)

register(
    Check(
        check_id="lab03.matmul_block_shapes",
        make_inputs=_matmul_block_shapes,
        hint=_MATMUL_HINT
        + " BLOCK_M and BLOCK_N differ here: a tile's rows belong with the first grid axis and BLOCK_M, "
        "its columns with the second and BLOCK_N, so a mix-up that square tiles hide shows up.",
        **matmul_values(),
    )
)

_MATMUL_EXCESS_HINTS = {
    argument: f"the loads of {matrix} read more of it than the product needs. {matrix}'s edge tiles reach {axis} "
    f"as well as past K, and those lanes only feed {feeds} of C that the store leaves out, so no value check sees "
    f"them; only the bytes do. Each tile load must stay inside {matrix} along both of its dimensions, and each part "
    "of a tile is read once per step along K (chapter 03, section “5 · Tiled matrix multiplication”)."
    for argument, matrix, axis, feeds in (
        ("a_ptr", "A", "rows past M (its first axis)", "rows"),
        ("b_ptr", "B", "columns past N (its second axis)", "columns"),
    )
}
_MATMUL_EXCESS_HINTS["c_ptr"] = (
    "each program stores its tile of C once, after the last step along K: the partial sums stay in the float32 "
    "accumulator, inside the program, from one step to the next, so C is neither written nor read back between "
    "steps (chapter 03, section “5 · Tiled matrix multiplication”)."
)

register(
    Check(
        check_id="lab03.matmul_in_bounds",
        task="lab03 task 2: matmul_kernel",
        reference=_MATMUL,
        make_inputs=_matmul_edge_cases,
        drive=_driver("matmul_kernel", matmul_setup),
        compare=compare_bounds("matmul_kernel", _describe_matmul),
        hint="the tiles at the bottom and right edges, and the last step along K, hang over the matrices: each tile "
        "load "
        "needs a mask that keeps it inside its matrix along both of its dimensions, with a fill value that adds "
        "nothing "
        "to the product, and the store one that keeps it inside C. Here some matrices are smaller than one block, and "
        "some are transposed views (chapter 03, section “6 · Catching a missing mask”).",
    )
)

register(
    Check(
        check_id="lab03.matmul_traffic",
        task="lab03 task 2: matmul_kernel",
        reference=_MATMUL,
        make_inputs=_matmul_edge_cases,
        drive=_driver("matmul_kernel", matmul_setup, count_traffic=True),
        compare=compare_traffic(
            "matmul_kernel",
            _describe_matmul,
            "each program reads only the parts of its tiles inside A and B",
            TOLERANCES["matmul_kernel"],
            excess_hints=_MATMUL_EXCESS_HINTS,
        ),
        hint="a lane that reads outside A or B costs memory traffic even when its product never reaches C: the tile "
        "loads must stay inside their matrices along every dimension, rows of A past M and columns of B past N "
        "included, not only along K. Budget: each program reads only the parts of its tiles inside A and B.",
    )
)


# --- task 3: rmsnorm_kernel -------------------------------------------------------------------------


def _rmsnorm_case(
    rng: random.Random, rows: int, cols: int, *, pad: int = 0, out_pad: int = 0, eps: float = 1e-5
) -> dict:
    return {
        "seed": rng.randrange(10**6),
        "rows": rows,
        "cols": cols,
        "pad": pad,
        "out_pad": out_pad,
        "eps": eps,
        "scale": rng.choice([0.01, 1.0, 30.0]),
    }


def _rmsnorm_shapes(rng):
    return [
        _rmsnorm_case(rng, 1, 1),
        _rmsnorm_case(rng, rng.randint(2, 6), 576, eps=1e-6),
        # x and out padded differently, so that using one's row stride for the other shows
        _rmsnorm_case(rng, rng.randint(10, 30), rng.randint(33, 200), pad=rng.randint(4, 20), out_pad=3),
        _rmsnorm_case(rng, rng.randint(3, 8), rng.randint(5, 30), eps=0.5),
    ]


def _rmsnorm_bounds_cases(rng):
    return [
        _rmsnorm_case(rng, rng.randint(3, 8), rng.randint(17, 100), pad=rng.randint(3, 20)),
        _rmsnorm_case(rng, 2, rng.randint(129, 200), out_pad=5),
    ]


def rmsnorm_setup(case):
    """(out, grid, args, meta) of task 3's launch on the case."""
    rows, cols = case["rows"], case["cols"]
    x = with_row_gaps(seeded_tensor(case["seed"], rows, cols, scale=case["scale"]), case["pad"])
    w = seeded_tensor(case["seed"] + 1, cols)
    out = empty_rows(x, cols, case["out_pad"])
    return out, (rows,), (out, x, w, cols, x.stride(0), out.stride(0), case["eps"]), {"BLOCK": row_block(cols)}


def _describe_rmsnorm(case) -> str:
    return (
        f"x of shape [{case['rows']}, {case['cols']}] (x_row_stride {case['cols'] + case['pad']}, out_row_stride "
        f"{case['cols'] + case['out_pad']}), values of scale {case['scale']:g}, eps={case['eps']:g}, "
        f"grid ({case['rows']},), BLOCK={row_block(case['cols'])}"
    )


_RMSNORM = reference("infra_lib.kernels.rmsnorm", "rmsnorm_kernel")

register(
    Check(
        check_id="lab03.rmsnorm_odd_shapes",
        task="lab03 task 3: rmsnorm_kernel",
        reference=_RMSNORM,
        make_inputs=_rmsnorm_shapes,
        drive=_driver("rmsnorm_kernel", rmsnorm_setup),
        compare=compare_values("rmsnorm_kernel", _describe_rmsnorm, TOLERANCES["rmsnorm_kernel"]),
        hint="the mean square is over the n_cols real elements only: padded lanes must add nothing to the sum of "
        "squares, and the divisor is n_cols, not BLOCK. eps belongs inside the square root, added to the mean square "
        "(it reaches 0.5 here, so its place shows), and each row of x and of out starts at its own row stride "
        "(chapter 03, section “Lab 03: what you will write”).",
    )
)

_RMSNORM_EXCESS_HINTS = {
    "w_ptr": "the weight vector has n_cols elements, like a row: the lanes of its load past n_cols must be switched "
    "off even though their products are never stored (no value check sees them, only the bytes do), and each "
    "program reads the weights once.",
    "x_ptr": "each program reads its row of x once, with the lanes past n_cols switched off: the row stays in "
    "registers from the mean square to the scaling instead of being loaded again.",
}

register(
    Check(
        check_id="lab03.rmsnorm_in_bounds",
        task="lab03 task 3: rmsnorm_kernel",
        reference=_RMSNORM,
        make_inputs=_rmsnorm_bounds_cases,
        drive=_driver("rmsnorm_kernel", rmsnorm_setup, count_traffic=True),
        compare=compare_traffic(
            "rmsnorm_kernel",
            _describe_rmsnorm,
            "each program reads its row of x and the n_cols weights once",
            TOLERANCES["rmsnorm_kernel"],
            excess_hints=_RMSNORM_EXCESS_HINTS,
        ),
        hint="the weight vector has only n_cols elements, like a row, so its load overruns just as the row's does: the "
        "row of x, the weights and the store all need their lanes past n_cols switched off. A lane past n_cols must "
        "not "
        "be read even when its result is never stored; here rows are strided, with gaps that the checker watches. "
        "Budget: each program reads its row of x and the n_cols weights once.",
    )
)
