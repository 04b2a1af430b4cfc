"""Which of a lab's reference functions ran while a check drove the learner's code.

For the length of one check, each reference function object gets a stand-in body: its
``__code__`` is swapped for a small one that notes the call and runs the original body (a
clone of the function with the original code, globals, defaults and closure). Every route to
the function object reaches the stand-in: a direct call, an alias bound in an earlier cell, a
bound method, a wrapper or a forwarding class, a call made by another thread.

Only calls of the reference functions pay for this. A profile hook (``sys.setprofile``) would
instead run Python code on every call the learner's code makes, and the Triton interpreter
makes millions: it made the in-model kernel checks three times slower. A hook also matches
code objects, and a ``@torch.no_grad()`` reference shares its wrapper's code object with every
function so decorated, the learner's own included.

In-process and per check: it catches honest mistakes and naive shortcuts. An answer that copies
the reference's code object before the check, or its source, is what the static scan, the
similarity report and the sandbox's hidden reference are for.
"""

from __future__ import annotations

import types
from typing import Any, Callable

_HOOK = "__infra_lab_call_monitor__"
_FILENAME = "<grading call monitor>"


def _stand_in_code(fn: types.FunctionType, index: int) -> types.CodeType:
    """A body that hands (index, args, kwargs) to the hook; it has as many free variables as
    ``fn`` (Python refuses a ``__code__`` whose count differs from the closure's)."""
    cells = [f"_cell{i}" for i in range(len(fn.__code__.co_freevars))]
    lines = ["def _outer():"]
    if cells:
        lines.append(f"    {' = '.join(cells)} = None")
    lines.append("    def _stand_in(*args, **kwargs):")
    if cells:
        lines.append(f"        ({', '.join(cells)},)")
    lines += [f"        return {_HOOK}({index}, args, kwargs)", "    return _stand_in"]
    namespace: dict[str, Any] = {}
    exec(compile("\n".join(lines) + "\n", _FILENAME, "exec"), namespace)
    code = namespace["_outer"]().__code__
    return code.replace(co_name=fn.__code__.co_name, co_qualname=fn.__code__.co_qualname)


def _clone(fn: types.FunctionType) -> types.FunctionType:
    clone = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = fn.__kwdefaults__
    clone.__qualname__ = fn.__qualname__
    clone.__dict__.update(fn.__dict__)
    return clone


class CallMonitor:
    """Install with ``start()``, remove with ``stop()`` (always, in a ``finally``); ``hits``
    names each reference function called in between, ``"module.qualname"``, in call order."""

    def __init__(self, functions: list[Callable]):
        seen: dict[int, types.FunctionType] = {}
        for fn in functions:
            if isinstance(fn, types.FunctionType):
                seen.setdefault(id(fn), fn)
        self.functions = list(seen.values())
        self.names = [f"{fn.__module__}.{fn.__qualname__}" for fn in self.functions]
        self.hits: list[str] = []
        self._originals: list[types.CodeType] = []
        self._stand_ins: list[types.CodeType] = []
        self._clones: list[types.FunctionType] = []
        self._hook = self._called  # one bound method, so that intact() can compare identities

    def _called(self, index: int, args: tuple, kwargs: dict) -> Any:
        self.hits.append(self.names[index])
        return self._clones[index](*args, **kwargs)

    def _namespaces(self) -> list[dict]:
        unique = {id(fn.__globals__): fn.__globals__ for fn in self.functions}
        return list(unique.values())

    def start(self) -> None:
        self._originals = [fn.__code__ for fn in self.functions]
        self._clones = [_clone(fn) for fn in self.functions]
        self._stand_ins = [_stand_in_code(fn, i) for i, fn in enumerate(self.functions)]
        for namespace in self._namespaces():
            namespace[_HOOK] = self._hook
        for fn, code in zip(self.functions, self._stand_ins):
            fn.__code__ = code

    def intact(self) -> bool:
        """Whether every stand-in and the hook are still in place (the learner's code may have
        put the original bodies back, or replaced them)."""
        return all(fn.__code__ is code for fn, code in zip(self.functions, self._stand_ins)) and all(
            namespace.get(_HOOK) is self._hook for namespace in self._namespaces()
        )

    def stop(self) -> None:
        for fn, code in zip(self.functions, self._originals):
            fn.__code__ = code
        for namespace in self._namespaces():
            namespace.pop(_HOOK, None)
