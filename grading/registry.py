"""The registry of checks: seeded inputs, a driver, and a comparison against the reference.

A lab's check module (``grading.checks.labNN``, a package split by task where it is long) registers
each check with one module-level statement, keyword arguments only::

    register(Check(check_id="lab01.gemm_flops", task="lab01 task 1: gemm_flops",
                   reference=reference("infra_lib.hardware.flops", "gemm_flops"),
                   make_inputs=_shapes, drive=_drive, compare=_compare, hint="..."))

Fields that several checks share may come from a small public helper that returns a dict, passed as
``**parts``. No check is registered in a loop, through a local wrapper or by a module ``__getattr__``:
reading a check module shows every check it registers, each in one place. The reference objects a
lab's answers must not call are named once per lab with :func:`register_shortcuts`.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Modules under grading.checks that register checks; a lab adds its module here.
CHECK_MODULES = (
    "grading.checks.lab01",
    "grading.checks.lab02",
    "grading.checks.lab03",
    "grading.checks.lab04",
    "grading.checks.lab05",
    "grading.checks.lab06",
    "grading.checks.lab07",
    "grading.checks.lab08",
    "grading.checks.lab09",
    "grading.checks.lab10",
    "grading.checks.lab12",
    "grading.checks.lab13",
    "grading.checks.lab15",
    "grading.checks.lab16",
    "grading.checks.lab17",
    "grading.checks.lab18",
)


@dataclass(frozen=True)
class Mismatch:
    """Why a learner's data differs from the reference's.

    ``what`` never contains inputs or expected values (it is shown for hidden checks);
    ``detail`` does (shown only for visible checks and interactively). ``hint``, when given,
    replaces the check's own hint: the comparison knows which mistake it found (a load past
    the edge of one argument, excess traffic, values to fix first) and names that idea.
    ``reason`` replaces "wrong result" as the failure's label where the output was right but
    something else was not (``TRAFFIC``).
    """

    what: str
    detail: str = ""
    hint: str = ""
    reason: str = ""


class ReferenceFailed(RuntimeError):
    """Raised by a comparison when the reference's own data is wrong: a fault of the course, never reported as
    the learner's (``judge`` lets it through, where any other error in a comparison is the learner's malformed
    data)."""


@dataclass(frozen=True)
class Check:
    """One registered check.

    Attributes:
        check_id: "labNN.behaviour", unique.
        task: the lab task it exercises, as the stub names it ("lab01 task 1: gemm_flops").
        reference: returns the infra_lib implementation (imported lazily).
        make_inputs: seeded ``random.Random`` -> inputs as plain data.
        drive: (implementation, inputs) -> plain data (numbers, strings, lists, dicts).
        compare: (learner data, reference data, inputs) -> Mismatch or None when equal.
        hint: what to look at when the check fails.
    """

    check_id: str
    task: str
    reference: Callable[[], Any]
    make_inputs: Callable[[random.Random], Any]
    drive: Callable[[Any, Any], Any]
    compare: Callable[[Any, Any, Any], Mismatch | None]
    hint: str
    # (learner data, reference data) -> {name: number}: what the grading reports besides pass/fail
    # (the capstone's throughput ratio), for scores.csv and the learner's progress history.
    measure: Callable[[Any, Any], dict[str, float]] | None = None
    # Checks that name the same inputs_group draw the same inputs for a seed (tiers of one measurement,
    # such as the capstone's throughput bars); by default each check draws its own.
    inputs_group: str | None = None

    def inputs(self, seed: int) -> Any:
        return self.make_inputs(random.Random(seed_for(seed, self.inputs_group or self.check_id)))


_REGISTRY: dict[str, Check] = {}
_SHORTCUTS: dict[str, tuple[str, ...]] = {}


def register_shortcuts(lab: str, targets: list[str]) -> None:
    """Name the reference objects a lab's answers must not call. A target is "module:function",
    "module:Class" (every method the class defines) or "module:Class.method" (that method alone, where
    the class's other methods are the stack the learner's piece runs in). Nothing is imported here:
    a target is resolved when it is used, so registering a check module loads no torch."""
    for target in targets:
        module, colon, name = target.partition(":")
        parts = name.split(".")
        if not colon or not module or len(parts) > 2 or not all(part.isidentifier() for part in parts):
            raise ValueError(
                f"shortcut target {target!r} must look like 'package.module:function' or 'package.module:Class.method'"
            )
    _SHORTCUTS[lab_key(lab)] = tuple(targets)


def shortcut_targets(lab: str) -> tuple[str, ...]:
    """The targets ``register_shortcuts`` named for a lab (any form of its id), as registered."""
    _load()
    return _SHORTCUTS.get(lab_key(lab), ())


def resolve_target(target: str) -> Any:
    """The object a shortcut target names, imported: a module's function or class, or a class's own
    method as a function (the function inside a static or class method)."""
    module, _, name = target.partition(":")
    owner_name, _, method = name.rpartition(".")
    obj = importlib.import_module(module)
    if not owner_name:
        return getattr(obj, name)
    owner = getattr(obj, owner_name)
    value = inspect.getattr_static(owner, method)
    value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    if not inspect.isfunction(value):
        raise TypeError(f"shortcut target {target!r} names a {type(value).__name__}, not a method")
    return value


_ANSWER_LABS: dict[str, dict[str, str]] = {}


def register_answer_labs(lab: str, answers: dict[str, str]) -> None:
    """Scan some of a lab's answer cells with another lab's shortcut rules: ``{answer grade_id: lab}``.
    The capstone's answer cells are labs 06-09's answers, each under the rules it was written for."""
    _ANSWER_LABS[lab_key(lab)] = dict(answers)


def answer_lab(lab: str, answer: str) -> str:
    """The lab whose shortcut rules the static scan applies to ``answer`` of ``lab``."""
    _load()
    return _ANSWER_LABS.get(lab_key(lab), {}).get(answer, lab)


def lab_key(lab: str) -> str:
    """The short lab id that shortcuts and check ids use: "lab03_triton" and "lab03" both mean "lab03"."""
    return lab.split("_")[0]


def _methods(cls: type) -> list[Any]:
    """The functions a class defines itself (plain, static and class methods, property accessors)."""
    found = []
    for value in vars(cls).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            found.extend(f for f in (value.fget, value.fset, value.fdel) if f is not None)
        elif callable(value) and hasattr(value, "__code__"):
            found.append(value)
    return found


def _is_method(target: str) -> bool:
    return "." in target.partition(":")[2]


def shortcut_functions(lab: str) -> list[Any]:
    """The reference functions of a lab, imported: calling one from an answer is a shortcut.
    A registered class stands for every method it defines; a registered method for itself."""
    functions = []
    for target in shortcut_targets(lab):
        obj = resolve_target(target)
        functions.extend(_methods(obj) if isinstance(obj, type) else [obj])
    return functions


def shortcut_modules(lab: str) -> tuple[set[str], set[str]]:
    """(modules that define or re-export a lab's reference functions or classes, the names an answer
    must not use). A method target adds its name only: the module and the class stay importable, for
    the class's other methods are the learner's to call."""
    import pkgutil
    import sys

    targets = shortcut_targets(lab)
    objects = {target: resolve_target(target) for target in targets}
    for target in targets:
        package = target.split(".")[0]
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
            if info.ispkg:
                importlib.import_module(info.name)
    top_level = [obj for target, obj in objects.items() if not _is_method(target)]
    modules = {target.split(":")[0] for target in targets if not _is_method(target)}
    for name, module in list(sys.modules.items()):
        if module is not None and any(getattr(module, obj.__name__, None) is obj for obj in top_level):
            modules.add(name)
    return modules, {obj.__name__ for obj in objects.values()}


def register(check: Check) -> Check:
    """Add one check, as one module-level ``register(Check(...))`` statement (see the module's docstring).

    Raises:
        ValueError: a check with this id is already registered.
    """
    if check.check_id in _REGISTRY:
        raise ValueError(f"check {check.check_id!r} is registered twice")
    _REGISTRY[check.check_id] = check
    return check


def _load() -> None:
    for module in CHECK_MODULES:
        importlib.import_module(module)


def get_check(check_id: str) -> Check:
    """The registered check with this id.

    Raises:
        KeyError: no check has that id (the message lists the ids of the same lab).
    """
    _load()
    if check_id not in _REGISTRY:
        lab = check_id.split(".")[0]
        known = sorted(c for c in _REGISTRY if c.startswith(lab + "."))
        raise KeyError(f"no check named {check_id!r}; checks of {lab}: {', '.join(known) or 'none'}")
    return _REGISTRY[check_id]


def all_checks() -> dict[str, Check]:
    _load()
    return dict(_REGISTRY)


def seed_for(seed: int, check_id: str) -> int:
    """The seed one check uses, derived from a run's seed so checks do not share inputs."""
    digest = hashlib.sha256(f"{seed}:{check_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little")
