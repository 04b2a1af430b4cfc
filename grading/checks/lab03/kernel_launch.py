"""Launching a learner's lab 03 kernel: each kernel's parameters and stated tolerances, the guarded
launch, and the drive that counts the bytes a launch moves (in a child Python where Triton compiles)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from grading.checks.triton_cases import Tolerance, plain_error

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


def driver(name: str, setup, count_traffic: bool = False):
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


_CHILD = "import sys; from grading.checks.lab03 import kernel_launch; kernel_launch.drive_request(sys.argv[1])"
_CHILD_TIMEOUT_S = 600


def _drive_interpreted(name: str, setup, kernel_path: str, cases) -> list[dict]:
    """The drive of ``kernel_path`` in a fresh Python that sees no GPU, so that Triton interprets it and
    its bytes are counted, as a sandboxed kernel's are.

    Raises:
        RuntimeError: the child failed (the grader then reports the reference's failure, not the learner's).
    """
    from grading.course import REPO_ROOT
    from infra_lib.kernels.triton_env import INTERPRET_ENV

    root = str(REPO_ROOT)
    env = {
        **os.environ,
        INTERPRET_ENV: "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
    }
    with tempfile.TemporaryDirectory(prefix="lab03-traffic-") as folder:
        request = Path(folder) / "request.json"
        request.write_text(
            json.dumps(
                {"name": name, "setup": f"{setup.__module__}:{setup.__name__}", "kernel": kernel_path, "cases": cases}
            )
        )
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


def _imported(path: str):
    """The object that "module:name" names."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def drive_request(path: str) -> None:
    """In the child of ``_drive_interpreted``: drive the request at ``path``, write result.json beside it."""
    from infra_lib.kernels.triton_env import interpreter_active, load_triton

    load_triton()
    if not interpreter_active():
        raise RuntimeError("Triton still compiles in the child: its bytes cannot be counted")
    request = json.loads(Path(path).read_text())
    kernel, setup = (_imported(request[key]) for key in ("kernel", "setup"))
    results = driver(request["name"], setup, count_traffic=True)(kernel, request["cases"])
    Path(path).with_name("result.json").write_text(json.dumps(results))
