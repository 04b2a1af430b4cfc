"""The one way the course imports Triton, and the checks every kernel wrapper runs on its inputs.

Without a GPU, Triton runs kernels through its interpreter: each program of the grid is
executed in Python on NumPy arrays. The interpreter is chosen when a kernel is *defined*,
from the environment variable ``TRITON_INTERPRET=1``, and Triton's own library kernels
(``tl.max``, ``tl.sum``, ...) are defined when ``triton`` is first imported. So the variable
must be set before that import: ``load_triton()`` does it, on machines without CUDA.
"""

from __future__ import annotations

import os
import sys

import torch

INTERPRET_ENV = "TRITON_INTERPRET"
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_INSTALL_HINT = "Triton ships wheels for Linux only: run chapter 03 on Linux or WSL2 (on Linux, run `make .venv` again)"


def _interpreted(triton) -> bool:
    """Whether this imported Triton runs kernels (its own library ones included) in the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return bool(triton.knobs.runtime.interpret) and isinstance(triton.language.standard.max, InterpretedFunction)


def _reimport_interpreted():
    """Import Triton's Python modules again with the interpreter on.

    Something imported Triton before the course could set ``TRITON_INTERPRET`` (importing
    ``torch._dynamo`` or ``torch._inductor`` does). Its compiled extension ``triton._C`` stays
    loaded (it cannot be loaded twice); the Python layer above it is imported afresh.
    Modules that kept a reference to the old ``triton`` keep the compiled-mode one.
    """
    for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
        if not name.startswith("triton._C"):
            del sys.modules[name]
    import triton

    return triton


def load_triton():
    """Import Triton for this machine and return ``(triton, tl)``.

    With CUDA, kernels compile for the GPU (unless ``TRITON_INTERPRET=1`` is already set,
    e.g. to debug). Without it, ``TRITON_INTERPRET=1`` is set before the import so kernels
    run in the interpreter on CPU tensors.

    Raises:
        ImportError: Triton is not installed (no wheels outside Linux).
        RuntimeError: Triton was imported in compiled mode and could not be re-imported for
            the interpreter; restart the Python kernel and call ``load_triton()`` first.
    """
    if not torch.cuda.is_available():
        os.environ[INTERPRET_ENV] = "1"
    already = "triton" in sys.modules
    try:
        import triton
    except ImportError as exc:
        raise ImportError(f"cannot import triton ({exc}). {_INSTALL_HINT}") from exc
    if os.environ.get(INTERPRET_ENV) == "1" and not _interpreted(triton):
        if already:
            triton = _reimport_interpreted()
        if not _interpreted(triton):
            raise RuntimeError(
                "triton was imported before TRITON_INTERPRET=1 was set, so its kernels would need a GPU; "
                "restart the Python kernel (Kernel > Restart) and run "
                "`from infra_lib.kernels.triton_env import load_triton; triton, tl = load_triton()` "
                "before anything imports triton"
            )
    import triton.language as tl

    if _interpreted(triton):
        _skip_discarded_overflow_checks()
        _skip_repatching_inside_a_launch()
    return triton, tl


def _skip_discarded_overflow_checks() -> None:
    """Stop the interpreter computing integer-overflow checks that it then throws away.

    For every integer ``+``, ``-`` and ``*`` in a kernel, Triton builds an overflow check (both
    operands widened to int64, the operation again, two comparisons and an ``and``) and hands it
    to ``device_assert``, which ignores it unless the options ask for debugging, and the
    interpreter's never do. On NumPy arrays that dead work is about a sixth of the flash-attention
    kernel's time. Skipping it changes no result and no error (tests/test_triton_kernels.py runs
    an overflowing kernel both ways); with debugging on, the checks stay.
    """
    from dataclasses import replace

    try:
        from triton.runtime.interpreter import interpreter_builder

        options = interpreter_builder.options
        if not options.debug and options.sanitize_overflow:
            interpreter_builder.options = replace(options, sanitize_overflow=False)
    except (ImportError, AttributeError, TypeError):  # another Triton version: leave it as it is
        pass


def _skip_repatching_inside_a_launch() -> None:
    """Stop the interpreter re-patching ``triton.language`` at every call of a jitted helper.

    The interpreter runs a kernel with the language's builtins swapped for interpreted ones, and
    a launch swaps them once. A call of a ``@triton.jit`` function from inside a kernel swaps
    them again, and ``tl.max``, ``tl.sum`` and ``tl.cdiv`` are such functions: a kernel with two
    reductions per loop iteration re-scans the whole language (``inspect.getmembers`` of four
    modules) a dozen times per program: nearly half the flash-attention kernel's interpreted time
    (a causal call with 9 query heads, 3 KV heads, 128 tokens and d = 64 went from 1.26 s to
    0.68 s of CPU). Inside a launch, a helper whose language modules are already swapped (by
    the launch, or by an earlier helper call, whose swaps the interpreter never undoes) runs
    without swapping them again; every other call goes the interpreter's own way. Results and
    errors are unchanged (tests/test_triton_kernels.py runs kernels both ways).
    """
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter

        executor, function, error = (
            interpreter.GridExecutor,
            interpreter.InterpretedFunction,
            interpreter.InterpreterError,
        )
    except (ImportError, AttributeError):  # another Triton version: leave it as it is
        return
    if getattr(function.__call__, "skips_repatching", False):
        return

    def languages(fn) -> set[int]:
        return {
            id(value)
            for value in getattr(fn, "__globals__", {}).values()
            if inspect.ismodule(value) and (value is tl or value is tl.core)
        }

    launches: list[set[int]] = []  # the language modules each running launch swapped
    swapped_by_helpers: set[int] = set()  # swapped by a helper call, never swapped back
    launch, call = executor.__call__, function.__call__

    def launch_once(self, *args, **kwargs):
        launches.append(languages(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def helper_call(self, *args, **kwargs):
        needed = languages(self.fn)
        if launches and needed and needed <= set().union(swapped_by_helpers, *launches):
            rewritten = self.rewrite()
            try:
                return rewritten(*args, **kwargs)
            except Exception as exc:
                raise error(repr(exc)) from exc
        if launches:
            swapped_by_helpers.update(needed)
        return call(self, *args, **kwargs)

    helper_call.skips_repatching = True
    helper_call.interpreters_own = call
    executor.__call__, function.__call__ = launch_once, helper_call


def interpreter_active() -> bool:
    """True when kernels defined now run in Triton's interpreter (on CPU tensors)."""
    triton = sys.modules.get("triton")
    if triton is None:
        return os.environ.get(INTERPRET_ENV) == "1" or not torch.cuda.is_available()
    return _interpreted(triton)


def kernel_device() -> torch.device:
    """Where the course's kernels run: the GPU when there is one, else the CPU (interpreter)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# --- the checks kernel wrappers run on their inputs ------------------------------------------


def require_tensor(
    name: str, value, *, ndim: int | None = None, dtypes=FLOAT_DTYPES, contiguous_last: bool = False
) -> torch.Tensor:
    """Check one kernel input; return it.

    Args:
        name: the argument's name, for the message.
        value: what the caller passed.
        ndim: the number of dimensions required, or None for any.
        dtypes: the allowed dtypes.
        contiguous_last: require stride 1 along the last dimension (rows read as one block).

    Raises:
        TypeError: not a tensor, a dtype outside ``dtypes``, or bfloat16 in the interpreter.
        ValueError: the wrong number of dimensions, an empty tensor, a device Triton cannot
            run on here, or a strided last dimension.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(
            f"{name} has dtype {str(value.dtype).replace('torch.', '')}; use one of {allowed} (e.g. {name}.float())"
        )
    if ndim is not None and value.dim() != ndim:
        raise ValueError(
            f"{name} must have {ndim} dimension(s), got shape {list(value.shape)}"
            + (f"; reshape it, e.g. {name}.reshape(-1, {name}.shape[-1])" if ndim == 2 else "")
        )
    if value.numel() == 0:
        raise ValueError(f"{name} is empty (shape {list(value.shape)}); the kernel needs at least one element")
    kind = value.device.type
    if kind == "cpu" and not interpreter_active():
        raise ValueError(
            f"{name} is on the CPU but Triton runs compiled here; move it to the GPU "
            f"({name}.cuda()) or set TRITON_INTERPRET=1 before importing triton"
        )
    if value.dtype == torch.bfloat16 and interpreter_active():
        raise TypeError(
            f"{name} is bfloat16, which Triton's interpreter cannot compute with; use {name}.float() "
            f"or {name}.half() (bfloat16 works in kernels compiled for a GPU)"
        )
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {value.device}, where Triton cannot run; use {name}.cpu() or {name}.cuda()")
    if contiguous_last and value.dim() > 0 and value.shape[-1] > 1 and value.stride(-1) != 1:
        raise ValueError(
            f"{name} has stride {value.stride(-1)} along its last dimension; the kernel reads rows as "
            f"contiguous blocks: pass {name}.contiguous()"
        )
    return value


def require_same_device(**tensors: torch.Tensor) -> torch.device:
    """Check that all tensors sit on one device; return it.

    Raises:
        ValueError: naming each tensor's device.
    """
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"the inputs must be on one device, got {listed}; move them with .to(device)")
    return next(iter(devices.values()))


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (a block that covers n elements)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
