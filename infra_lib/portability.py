"""Which modules would change if the course moved to another accelerator: counted from the code.

Each module of a package is parsed (``ast``, never imported) and searched for **markers** of a
device, in three kinds:

    kernel      imports Triton (directly or through ``triton_env``), ``@triton.jit`` kernels
    collective  imports ``torch.distributed``; names a collective library ("gloo", "nccl", "hccl")
    device      ``torch.cuda`` / ``torch.mps`` / ``torch.npu`` / ``torch.backends``, ``torch_npu``,
                ``.cuda()`` / ``.npu()`` calls, device strings such as "cuda" or "npu:0"

A module with any marker is device-specific: a kernel module if any marker is a kernel, else
a collective or device module, whichever kind has more markers; a module with none is portable. Docstrings
and comments do not count, only code. Imports of the course's own
device layer (``infra_lib.device``) do not count either: going through it is what keeps a
module portable. The census cannot see assumptions that name no device (a tensor created on the
CPU by default, a block size tuned for one GPU): it is a lower bound on the work of a port.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

CATEGORIES = ("kernel", "collective", "device", "portable")

# What moving from NVIDIA GPUs to Ascend NPUs asks of each kind of module.
ASCEND_PORT = {
    "kernel": "rewrite: Triton/CUDA kernels become Ascend C kernels built by CANN (or go through an Ascend "
    "Triton backend and are tuned again); the reference torch code they replace carries over",
    "collective": "adapt: the process group's backend changes from NCCL (gloo here) to HCCL; the algorithms "
    "(ring all-reduce, DDP buckets, ZeRO shards) carry over, their tuning does not",
    "device": "adapt: each branch on 'cuda' gains an 'npu' one, or better, goes through a registered Backend",
    "portable": "carries over unchanged: it speaks only torch operators and Python",
}

_DEVICE_STRING = re.compile(r"^(cuda|mps|npu|xpu|hip)(:\d+)?$")
_COLLECTIVE_STRING = re.compile(r"^(gloo|nccl|hccl|mpi|ucc)$", re.IGNORECASE)
_KERNEL_IMPORTS = ("triton",)
_COLLECTIVE_IMPORTS = ("torch.distributed",)
_DEVICE_IMPORTS = ("torch.cuda", "torch.mps", "torch.npu", "torch.backends", "torch_npu")
_DEVICE_ATTRIBUTES = ("torch.cuda", "torch.mps", "torch.npu", "torch.backends")


@dataclass(frozen=True)
class Marker:
    """One place in a module's code that names a device: where, which kind, and the code it saw."""

    line: int
    kind: str  # "kernel", "collective" or "device"
    what: str


@dataclass(frozen=True)
class ModuleCensus:
    """One module: its path relative to the scanned root, its package, its lines of code, its markers."""

    path: str
    package: str
    lines: int
    markers: tuple[Marker, ...]

    @property
    def category(self) -> str:
        """ "kernel" if any marker is a kernel (the costliest to port), else the more frequent of
        collective and device (a tie: collective), else "portable"."""
        counts = {kind: sum(m.kind == kind for m in self.markers) for kind in CATEGORIES[:3]}
        if counts["kernel"]:
            return "kernel"
        if counts["collective"] or counts["device"]:
            return "collective" if counts["collective"] >= counts["device"] else "device"
        return "portable"

    @property
    def device_specific(self) -> bool:
        return self.category != "portable"


def _matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _dotted(node: ast.AST) -> str | None:
    """``torch.cuda.synchronize`` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings or bare string statements (prose, not code)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def _import_markers(node: ast.AST) -> list[Marker]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:  # a relative import: only its last part is known
        names = [node.module]
    else:
        return []
    for name in names:
        if _matches(name, _KERNEL_IMPORTS) or name.endswith("triton_env"):
            return [Marker(node.lineno, "kernel", f"import {name}")]
        if _matches(name, _COLLECTIVE_IMPORTS):
            return [Marker(node.lineno, "collective", f"import {name}")]
        if _matches(name, _DEVICE_IMPORTS):
            return [Marker(node.lineno, "device", f"import {name}")]
    return []


def scan_source(source: str, filename: str = "<source>") -> list[Marker]:
    """Every device marker in one module's source, in line order.

    Raises:
        ValueError: the source does not parse (the message names the file and line).
    """
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise ValueError(
            f"cannot parse {filename} (line {exc.lineno}): {exc.msg}; the census reads only valid Python"
        ) from None
    prose = _docstring_nodes(tree)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}  # not a chain's end
    markers: list[Marker] = []
    for node in ast.walk(tree):
        markers += _import_markers(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                name = _dotted(target) or ""
                if name.startswith("triton."):
                    markers.append(Marker(decorator.lineno, "kernel", f"@{name} def {node.name}"))
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            name = _dotted(node)
            if name and _matches(name, _DEVICE_ATTRIBUTES):
                markers.append(Marker(node.lineno, "device", name))
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _DEVICE_STRING.match(node.func.attr)
        ):
            markers.append(Marker(node.lineno, "device", f".{node.func.attr}()"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if _DEVICE_STRING.match(node.value):
                markers.append(Marker(node.lineno, "device", repr(node.value)))
            elif _COLLECTIVE_STRING.match(node.value):
                markers.append(Marker(node.lineno, "collective", repr(node.value)))
    return sorted(set(markers), key=lambda m: (m.line, m.kind, m.what))


def count_code_lines(source: str) -> int:
    """Non-blank lines that are not only a comment."""
    return sum(1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#"))


def scan_module(path: str | Path, root: str | Path) -> ModuleCensus:
    """The census of one file; ``root`` is the package directory paths are reported against."""
    path, root = Path(path), Path(root)
    source = path.read_text(encoding="utf-8")
    relative = path.relative_to(root).as_posix()
    package = relative.split("/")[0] if "/" in relative else "(top level)"
    return ModuleCensus(relative, package, count_code_lines(source), tuple(scan_source(source, relative)))


def default_root() -> Path:
    """The ``infra_lib`` package directory."""
    return Path(__file__).resolve().parent


def census(root: str | Path | None = None) -> list[ModuleCensus]:
    """Scan every ``*.py`` file under ``root`` (default: ``infra_lib``), sorted by path.

    Raises:
        FileNotFoundError: ``root`` is not a directory.
        ValueError: a file does not parse.
    """
    root = Path(root) if root is not None else default_root()
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory; pass the package folder to scan")
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    return [scan_module(path, root) for path in files]


def totals(modules: list[ModuleCensus]) -> dict[str, dict[str, int]]:
    """Per category: how many modules and how many lines of code."""
    out = {category: {"modules": 0, "lines": 0} for category in CATEGORIES}
    for module in modules:
        out[module.category]["modules"] += 1
        out[module.category]["lines"] += module.lines
    return out


def lines_by_package(modules: list[ModuleCensus]) -> dict[str, dict[str, int]]:
    """Per package, lines of code per category (every category present, zeros included)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(CATEGORIES, 0))
    for module in modules:
        out[module.package][module.category] += module.lines
    return dict(sorted(out.items()))


def device_specific_fraction(modules: list[ModuleCensus]) -> float:
    """The share of all lines of code that sit in device-specific modules."""
    total = sum(m.lines for m in modules)
    if total == 0:
        raise ValueError("the census is empty: no lines of code to divide")
    return sum(m.lines for m in modules if m.device_specific) / total
