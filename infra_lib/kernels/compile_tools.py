"""What ``torch.compile`` does to a function, measured: ops before, kernels after, graph
breaks, recompilations, and the time it saves.

``torch.compile`` has three stages. Dynamo reads the Python bytecode and captures the
tensor operations into an FX graph (a graph break is where it has to stop and hand back
to Python); AOTAutograd lowers that graph to ATen operations; Inductor fuses them and
generates kernels (C++ loops on a CPU, Triton on a GPU). The helpers here look at each
stage. Each one that compiles starts with ``torch._dynamo.reset()``, so earlier
experiments cannot change what it sees (it also drops every other compiled function's cache).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from infra_lib.device import synchronizer
from infra_lib.timing import time_op

__all__ = [
    "CompileCount",
    "GeneratedCode",
    "GraphBreaks",
    "Speedup",
    "aten_ops",
    "compare_speed",
    "count_compiles",
    "generated_code",
    "graph_breaks",
    "show_generated_code",
]


# --- before: the ATen operations eager mode runs --------------------------------------------


def aten_ops(fn: Callable[..., Any], *inputs: Any, include_views: bool = False) -> list[str]:
    """The ATen operations one call of ``fn`` runs, in order ("aten.mm.default", ...).

    Traced with ``make_fx``: each entry is one operator call eager PyTorch dispatches, and
    (except views) one kernel it launches. Views (``permute``, ``view``, ``t``...) only
    relabel memory and launch nothing; they are left out unless ``include_views``.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        graph = make_fx(fn)(*inputs).graph
    return [
        str(node.target)
        for node in graph.nodes
        if node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and (include_views or not node.target.is_view)
    ]


# --- after: the code Inductor generates ------------------------------------------------------

_KERNEL_DEFINITION = re.compile(r"^(\w+) = async_compile\.\w+\(", re.MULTILINE)
_LIBRARY_CALL = re.compile(r"\b((?:extern_kernels|torch\.ops\.aten|aten)\.[\w.]+)\(")
_NOISE = ("assert_size_stride(", "assert_alignment(", "del ")


@dataclass(frozen=True)
class GeneratedCode:
    """What Inductor produced for one function.

    Attributes:
        code: the generated Python module: kernel sources, then a ``call`` function that
            allocates buffers and launches the kernels in order.
        kernels: the kernels it generated, by name, e.g. ``cpp_fused_add_mean_mul_pow_rsqrt_0``
            on a CPU (the name lists the ATen ops fused into it) or ``triton_poi_fused_...``.
        library_calls: operations it hands to a library instead of generating code, e.g.
            ``extern_kernels.mm`` (a matrix multiply goes to oneDNN/MKL or cuBLAS).
    """

    code: str
    kernels: list[str]
    library_calls: list[str]

    @property
    def launches(self) -> int:
        """Kernels launched per call: generated ones plus library calls."""
        return len(self.kernels) + len(self.library_calls)

    def call_function(self) -> str:
        """The ``call`` function(s): the launch sequence, without size asserts and ``del`` lines."""
        lines, keep, indent = [], False, 0
        for line in self.code.splitlines():
            stripped = line.lstrip()
            if stripped.startswith("def call("):
                keep, indent = True, len(line) - len(stripped)
                lines.append(line[indent:])
                continue
            if keep:
                if stripped and len(line) - len(stripped) <= indent:
                    keep = False
                elif stripped and not stripped.startswith(_NOISE):
                    lines.append(line[indent:])
        return "\n".join(lines)

    def kernel_source(self, name: str, max_lines: int | None = None) -> str:
        """The source of one generated kernel, cut to ``max_lines`` lines when given."""
        lines = self.code.splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith(f"{name} = async_compile.")), None)
        if start is None:
            raise KeyError(f"no kernel named {name!r}; generated kernels: {', '.join(self.kernels) or 'none'}")
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("'''")), len(lines) - 1)
        body = lines[start : end + 1]
        if max_lines is not None and len(body) > max_lines:
            body = body[:max_lines] + [f"    ... ({len(body) - max_lines} more lines)"]
        return "\n".join(body)

    def excerpt(self, kernel_lines: int = 30) -> str:
        """A readable summary: the launch sequence, then the start of each kernel."""
        parts = [
            f"# {len(self.kernels)} generated kernel(s): {', '.join(self.kernels) or 'none'}",
            f"# {len(self.library_calls)} library call(s): {', '.join(self.library_calls) or 'none'}",
            "",
            self.call_function(),
        ]
        parts += ["\n" + self.kernel_source(name, kernel_lines) for name in self.kernels]
        return "\n".join(parts)


def generated_code(fn: Callable[..., Any], *inputs: Any, dynamic: bool | None = False) -> GeneratedCode:
    """Compile ``fn`` with Inductor, call it once on ``inputs`` (without autograd), and return
    the code it generated. With graph breaks, the code of every graph is joined in order.

    The first compile in a process takes several seconds on a CPU (a C++ compiler runs);
    Inductor caches kernels on disk, so the same code compiles faster the next time.
    """
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch.no_grad():
        _, sources = run_and_get_code(torch.compile(fn, dynamic=dynamic), *inputs)
    torch._dynamo.reset()
    code = "\n\n".join(sources)
    library_calls = [
        match.group(1)
        for line in code.splitlines()
        if not line.lstrip().startswith("#")
        for match in _LIBRARY_CALL.finditer(line)
    ]
    return GeneratedCode(code, _KERNEL_DEFINITION.findall(code), library_calls)


def show_generated_code(fn: Callable[..., Any], *inputs: Any, kernel_lines: int = 30) -> str:
    """``generated_code(fn, *inputs).excerpt(kernel_lines)``: the launch sequence and each
    kernel's first lines, for printing in a notebook."""
    return generated_code(fn, *inputs).excerpt(kernel_lines)


# --- graph breaks ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GraphBreaks:
    """Where Dynamo had to stop capturing and return to Python.

    Attributes:
        graph_count: graphs captured (one more than the breaks, when each break resumes).
        break_count: graph breaks.
        reasons: one line per break: why, and the line of user code that caused it.
    """

    graph_count: int
    break_count: int
    reasons: list[str]


@contextlib.contextmanager
def _quiet_dynamo():
    """Silence Dynamo's warnings (they repeat the reasons these helpers return)."""
    logger = logging.getLogger("torch._dynamo")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _break_reason(reason: Any) -> str:
    text = str(reason.reason).strip().splitlines()[0]
    if reason.user_stack:
        frame = reason.user_stack[-1]
        text += f" (line {frame.lineno}: {(frame.line or '').strip()})"
    return text


def graph_breaks(fn: Callable[..., Any], *inputs: Any) -> GraphBreaks:
    """Run ``fn`` once under ``torch._dynamo.explain`` and report its graph breaks.

    Nothing is compiled to kernels, so this takes about a second, not the many seconds a
    compile takes. Common causes: ``print``, ``.item()`` / ``.tolist()`` feeding Python
    control flow, calls into code Dynamo cannot trace (C extensions, some libraries).
    """
    torch._dynamo.reset()
    with _quiet_dynamo():
        explained = torch._dynamo.explain(fn)(*inputs)
    torch._dynamo.reset()
    return GraphBreaks(
        explained.graph_count, explained.graph_break_count, [_break_reason(r) for r in explained.break_reasons]
    )


# --- recompilation ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CompileCount:
    """How often Dynamo captured a graph while a function was called with several shapes.

    Attributes:
        compiles: graphs captured in all (each is one compile with a real backend).
        per_call: graphs captured during each call, in call order (0: a cached graph ran).
        dynamic: for each capture, whether its graph has symbolic sizes (works for any size)
            rather than sizes fixed to the example's.
    """

    compiles: int
    per_call: list[int]
    dynamic: list[bool]


def count_compiles(
    fn: Callable[[torch.Tensor], Any],
    input_shapes: Sequence[Sequence[int]],
    *,
    dynamic: bool | None = None,
    mark_dynamic: Sequence[int] = (),
    device: torch.device | str = "cpu",
) -> CompileCount:
    """Compile ``fn`` once, call it on a random tensor of each shape, count the captures.

    A counting backend stands in for Inductor, so this measures Dynamo's decisions in well
    under a second per capture. With ``dynamic=None`` (the default of ``torch.compile``) the
    first call compiles for its exact sizes and a call with new sizes recompiles once with
    the changed dimensions symbolic ("automatic dynamic"); ``dynamic=False`` recompiles for
    every new shape (up to ``torch._dynamo.config.recompile_limit``, then runs eagerly);
    ``dynamic=True`` compiles one symbolic graph at once. ``mark_dynamic`` names dimensions
    to mark symbolic on every input with ``torch._dynamo.mark_dynamic`` (no recompilation
    when they change).
    """
    captures: list[bool] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]):
        symbolic = any(
            isinstance(node.meta.get("example_value"), torch.SymInt)
            or (
                isinstance(node.meta.get("example_value"), torch.Tensor)
                and any(isinstance(size, torch.SymInt) for size in node.meta["example_value"].shape)
            )
            for node in gm.graph.nodes
            if node.op == "placeholder"
        )
        captures.append(symbolic)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=counting_backend, dynamic=dynamic)
    per_call = []
    with _quiet_dynamo():
        for shape in input_shapes:
            x = torch.randn(*shape, device=device)
            for dim in mark_dynamic:
                torch._dynamo.mark_dynamic(x, dim)
            before = len(captures)
            compiled(x)
            per_call.append(len(captures) - before)
    torch._dynamo.reset()
    return CompileCount(len(captures), per_call, captures)


# --- time ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Speedup:
    """Eager against compiled, median seconds per call (``infra_lib.timing.time_op``).

    Attributes:
        eager_s: one eager call.
        compiled_s: one call of the compiled function, after compiling.
        compile_s: the first compiled call, compilation included.
    """

    eager_s: float
    compiled_s: float
    compile_s: float

    @property
    def speedup(self) -> float:
        """How many times faster the compiled call is (below 1: slower)."""
        return self.eager_s / self.compiled_s

    @property
    def break_even_calls(self) -> float:
        """Calls after which the compile time is paid back (inf when compiling is not faster)."""
        saved = self.eager_s - self.compiled_s
        return self.compile_s / saved if saved > 0 else float("inf")


def compare_speed(
    fn: Callable[..., Any], *inputs: Any, warmup: int = 3, iters: int = 20, **compile_options: Any
) -> Speedup:
    """Time ``fn`` eagerly and compiled (``torch.compile(fn, **compile_options)``), without
    autograd, on the device of the first tensor input."""
    device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    sync = synchronizer(device)
    torch._dynamo.reset()
    compiled = torch.compile(fn, **compile_options)
    with torch.no_grad():
        start = time.perf_counter()
        compiled(*inputs)
        if sync is not None:
            sync()
        compile_s = time.perf_counter() - start
        eager_s = time_op(lambda: fn(*inputs), warmup=warmup, iters=iters, sync=sync)
        compiled_s = time_op(lambda: compiled(*inputs), warmup=warmup, iters=iters, sync=sync)
    torch._dynamo.reset()
    return Speedup(eager_s, compiled_s, compile_s)
