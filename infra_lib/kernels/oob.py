"""Catch a kernel reading or writing outside its tensors, with guard bands around every argument.

A missing mask does not crash a Triton kernel: the interpreter reads and writes raw
addresses, and a GPU faults only when an access leaves the whole allocation. So
``check_bounds`` launches the kernel on copies of its tensor arguments, each placed in the
middle of a larger buffer whose other elements (the guards, and the gaps of a strided
tensor) hold a canary:

- a store outside a tensor changes that tensor's canary: the guard no longer matches;
- a load outside a float tensor reads NaN, and the NaN spreads into what the kernel stores.
  The launch is repeated with zeros in the guards: elements that are NaN only with the NaN
  canary came from out-of-range memory. Further launches, each with NaN around one
  argument only, find which argument and which side was read.

It uses nothing of Triton's internals, so it runs the same on the interpreter and on a GPU.
It cannot see an out-of-range load whose value never reaches a stored float (e.g. one
discarded by tl.where), nor loads from integer tensors; kernels must be deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# A quiet NaN with a payload per argument, so that a NaN copied from one tensor's guard into
# another's still changes the second canary. (exponent and quiet bit, payload base, payload bits)
_NAN_BITS = {
    torch.float32: (0x7FC00000, 0x155500, 0xFF),
    torch.float64: (0x7FF8000000000000, 0x5555500, 0xFF),
    torch.float16: (0x7E00, 0x100, 0xFF),
    torch.bfloat16: (0x7FC0, 0x20, 0x1F),
}
_INT_CANARY = {1: 0xA5, 2: 0x5A5A, 4: 0x5A5A5A5A, 8: 0x5A5A5A5A5A5A5A5A}
SIDES = {"before": "before the start of", "after": "after the end of", "between": "in the gaps between the rows of"}


@dataclass(frozen=True)
class Violation:
    """One out-of-range access pattern found by ``check_bounds``.

    Attributes:
        kind: "store" or "load".
        argument: the kernel parameter whose tensor was overrun ("" when no single one explains a load).
        side: "before", "after", "between" (the gaps of a tensor with padded strides), or "unknown".
        elements: for a store, the guard elements overwritten; for a load, the elements of
            the kernel's outputs that came out NaN because of it.
        poisoned: for a load, the arguments holding those NaN elements.
    """

    kind: str
    argument: str
    side: str
    elements: int
    poisoned: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = f"{SIDES[self.side]} `{self.argument}`" if self.side in SIDES else "outside its tensors"
        if self.kind == "store":
            return f"out-of-range store: {self.elements} element(s) written {where}; mask the tl.store"
        into = ", ".join(f"`{name}`" for name in self.poisoned) or "the outputs"
        return (
            f"out-of-range load: the kernel read {where} ({self.elements} element(s) of {into} depend on it); "
            "mask the tl.load and give `other=` a neutral value"
        )

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "argument": self.argument,
            "side": self.side,
            "elements": self.elements,
            "poisoned": list(self.poisoned),
        }


@dataclass(frozen=True)
class BoundsReport:
    """What ``check_bounds`` found: no violations means every access stayed inside its tensor."""

    violations: tuple[Violation, ...]
    launches: int

    @property
    def clean(self) -> bool:
        return not self.violations

    def __str__(self) -> str:
        if self.clean:
            return f"in bounds: no out-of-range load or store ({self.launches} launch(es))"
        return "\n".join(str(v) for v in self.violations)


class OutOfBoundsError(AssertionError):
    """A kernel read or wrote outside a tensor argument; ``.report`` has the details."""

    def __init__(self, report: BoundsReport):
        super().__init__(str(report))
        self.report = report


class _Slot:
    """One distinct tensor argument, and the padded buffer layout that holds a copy of it."""

    def __init__(self, name: str, tensor: torch.Tensor, code: int, guard: int | None):
        if tensor.is_complex():
            raise TypeError(f"check_bounds does not support complex tensors (`{name}`)")
        if any(st == 0 and sz > 1 for st, sz in zip(tensor.stride(), tensor.shape)):
            raise ValueError(
                f"`{name}` is broadcast (a stride of 0, strides {list(tensor.stride())}); "
                f"pass {name}.contiguous() to check_bounds"
            )
        self.name, self.tensor, self.code = name, tensor, code
        self.span = 0 if tensor.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
        self.guard = max(4096, 2 * self.span) if guard is None else guard
        total = 2 * self.guard + self.span
        owned = torch.zeros(total, dtype=torch.bool, device=tensor.device)
        torch.as_strided(owned, tensor.shape, tensor.stride(), self.guard).fill_(True)
        position = torch.arange(total, device=tensor.device)
        self.regions = {
            "before": position < self.guard,
            "after": position >= self.guard + self.span,
            "between": ~owned & (position >= self.guard) & (position < self.guard + self.span),
        }
        self.floating = tensor.is_floating_point()
        self.bits_dtype = _BITS[tensor.element_size()]
        if self.floating:
            base, payload, width = _NAN_BITS.get(tensor.dtype, (None, 0, 0))
            if base is None:
                raise TypeError(f"check_bounds does not support {tensor.dtype} (`{name}`)")
            self.canary = base | (payload + (code & width))
        else:
            self.canary = _INT_CANARY[tensor.element_size()] ^ (code & 0x0F)
        if self.canary >= 1 << (8 * tensor.element_size() - 1) and self.bits_dtype != torch.uint8:
            self.canary -= 1 << (8 * tensor.element_size())  # the same bits, as a signed integer
        self.flat: torch.Tensor | None = None
        self.view: torch.Tensor | None = None

    def fill(self, nan_regions: tuple[str, ...] | None) -> torch.Tensor:
        """A fresh padded copy; guards hold the canary (None) or zeros, except NaN canary in ``nan_regions``."""
        self.flat = torch.empty(2 * self.guard + self.span, dtype=self.tensor.dtype, device=self.tensor.device)
        bits = self.flat.view(self.bits_dtype)
        if nan_regions is None:
            bits.fill_(self.canary)
        else:
            bits.zero_()
            for region in nan_regions:
                bits[self.regions[region]] = self.canary
        self.view = torch.as_strided(self.flat, self.tensor.shape, self.tensor.stride(), self.guard)
        self.view.copy_(self.tensor)
        return self.view

    def overwritten(self) -> dict[str, int]:
        """Guard elements whose canary changed, per region (after a launch with canaries)."""
        changed = self.flat.view(self.bits_dtype) != self.canary
        return {region: int((changed & mask).sum()) for region, mask in self.regions.items()}

    def nan(self) -> torch.Tensor:
        return (
            torch.isnan(self.view)
            if self.floating
            else torch.zeros(self.view.shape, dtype=torch.bool, device=self.view.device)
        )


def _arg_names(kernel, count: int) -> list[str]:
    names = list(getattr(kernel, "arg_names", None) or [])
    return names[:count] + [f"argument {i}" for i in range(len(names), count)]


def _slots(kernel, args, meta, guard):
    """Distinct tensor arguments (the same tensor passed twice shares one slot), by position or keyword."""
    names = _arg_names(kernel, len(args))
    slots, where = {}, {}
    for key, value in [(i, a) for i, a in enumerate(args)] + list(meta.items()):
        if not isinstance(value, torch.Tensor):
            continue
        ident = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
        if ident not in slots:
            name = names[key] if isinstance(key, int) else key
            slots[ident] = _Slot(name, value, len(slots) + 1, guard)
        where[key] = slots[ident]
    distinct = list(slots.values())
    for i, one in enumerate(distinct):
        for other in distinct[i + 1 :]:
            a0, b0 = one.tensor.data_ptr(), other.tensor.data_ptr()
            a1, b1 = a0 + one.span * one.tensor.element_size(), b0 + other.span * other.tensor.element_size()
            if one.span and other.span and a0 < b1 and b0 < a1:
                raise ValueError(
                    f"`{one.name}` and `{other.name}` overlap in memory; check_bounds needs separate "
                    "tensors (or the very same tensor passed twice)"
                )
    return distinct, where


def _leaked(slots, values: dict, baseline: dict) -> dict[str, int]:
    """Per argument, the elements that are NaN in ``values`` but not in the zero-guard ``baseline``."""
    counts = {s.name: int((torch.isnan(values[id(s)]) & ~baseline[id(s)]).sum()) for s in slots if s.floating}
    return {name: n for name, n in counts.items() if n}


def check_bounds(
    kernel, grid, *args, guard_elements: int | None = None, raise_on_error: bool = True, **meta
) -> BoundsReport:
    """Launch ``kernel[grid](*args, **meta)`` with every tensor argument guarded; report what went outside.

    The caller's tensors receive the results, as after a plain launch.

    Args:
        kernel: a @triton.jit function (or an autotuned one).
        grid: as for ``kernel[grid]``.
        guard_elements: elements of guard on each side of every tensor; default
            max(4096, twice the tensor's extent in memory).
        raise_on_error: raise ``OutOfBoundsError`` when something went out of range
            (else only return the report).

    Returns:
        A ``BoundsReport``: ``.clean``, and ``.violations`` naming argument, side and elements.
    """
    slots, where = _slots(kernel, args, meta, guard_elements)

    def launch(fills: dict) -> None:
        views = {id(slot): slot.fill(fills.get(id(slot), ())) for slot in slots}
        new_args = [views[id(where[i])] if i in where else a for i, a in enumerate(args)]
        new_meta = {k: views[id(where[k])] if k in where else v for k, v in meta.items()}
        kernel[grid](*new_args, **new_meta)

    launch({id(slot): None for slot in slots})  # canaries everywhere
    launches, violations = 1, []
    results = {id(slot): slot.view.clone() for slot in slots}
    for slot in slots:
        for region, count in slot.overwritten().items():
            if count:
                violations.append(Violation("store", slot.name, region, count))
    fresh_nan = any(bool((torch.isnan(results[id(s)]) & ~torch.isnan(s.tensor)).any()) for s in slots if s.floating)
    if fresh_nan:
        launch({})  # zeros in every guard: a NaN that stays is the kernel's own
        launches += 1
        baseline = {id(s): s.nan() for s in slots}
        leaked = _leaked(slots, results, baseline)
        if leaked:
            found = []
            for suspect in (s for s in slots if s.floating):
                for region, mask in suspect.regions.items():
                    if bool(mask.any()):
                        launch({id(suspect): (region,)})  # NaN on one side of one argument only
                        launches += 1
                        if hit := _leaked(slots, {id(s): s.view for s in slots}, baseline):
                            found.append(Violation("load", suspect.name, region, sum(hit.values()), tuple(hit)))
            unattributed = Violation("load", "", "unknown", sum(leaked.values()), tuple(leaked))
            violations += found or [unattributed]
    with torch.no_grad():
        for slot in slots:  # hand back what the kernel wrote (inputs it only read stay untouched)
            if not torch.equal(results[id(slot)].view(slot.bits_dtype), slot.tensor.view(slot.bits_dtype)):
                slot.tensor.copy_(results[id(slot)])
            slot.flat = slot.view = None
    report = BoundsReport(tuple(violations), launches)
    if raise_on_error and not report.clean:
        raise OutOfBoundsError(report)
    return report
