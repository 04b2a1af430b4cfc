"""Count what a Triton kernel moves and computes: bytes loaded and stored, and tl.dot FLOPs.

In the interpreter every ``tl.load``, ``tl.store`` and ``tl.dot`` goes through one Python
object (the interpreter's builder). ``count_traffic()`` wraps its masked load, masked store
and dot methods for the duration of a ``with`` block and counts only the lanes whose mask
is on: the bytes the kernel asks memory for, as a GPU would move them (ignoring caches and
the rounding of accesses up to whole memory transactions). On a GPU, kernels are compiled
and no Python runs per access: measure there with a profiler instead (Nsight Compute's
``dram__bytes_read.sum`` and ``dram__bytes_write.sum``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np

from infra_lib.kernels.triton_env import interpreter_active, load_triton


@dataclass
class Traffic:
    """What the kernels launched inside one ``count_traffic()`` block did.

    Attributes:
        bytes_loaded: bytes read by tl.load, active (unmasked) lanes only.
        bytes_stored: bytes written by tl.store, active lanes only.
        flops: 2 * M * N * K for each tl.dot of an [M, K] by [K, N] tile (masked lanes included:
            a dot always computes the whole tile).
        loads: tl.load calls executed, summed over all programs.
        stores: tl.store calls executed, summed over all programs.
    """

    bytes_loaded: int = 0
    bytes_stored: int = 0
    flops: int = 0
    loads: int = 0
    stores: int = 0

    @property
    def bytes_moved(self) -> int:
        return self.bytes_loaded + self.bytes_stored

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, counted FLOPs per byte moved (0 when nothing moved)."""
        return self.flops / self.bytes_moved if self.bytes_moved else 0.0

    def __str__(self) -> str:
        return (f"loaded {self.bytes_loaded:,} B in {self.loads:,} loads, stored {self.bytes_stored:,} B in "
                f"{self.stores:,} stores, {self.flops:,} dot FLOPs ({self.intensity:.2f} FLOP/B)")


_active: list[Traffic] = []
_saved: dict[str, object] = {}


def _element_bytes(ptrs) -> int:
    return ptrs.get_element_ty().primitive_bitwidth // 8


def _install(builder) -> None:
    load, store, dot = builder.create_masked_load, builder.create_masked_store, builder.create_dot

    def counted_load(ptrs, mask, *rest, **options):
        nbytes = int(np.count_nonzero(mask.data)) * _element_bytes(ptrs)
        for counter in _active:
            counter.bytes_loaded += nbytes
            counter.loads += 1
        return load(ptrs, mask, *rest, **options)

    def counted_store(ptrs, value, mask, *rest, **options):
        nbytes = int(np.count_nonzero(mask.data)) * _element_bytes(ptrs)
        for counter in _active:
            counter.bytes_stored += nbytes
            counter.stores += 1
        return store(ptrs, value, mask, *rest, **options)

    def counted_dot(a, b, *rest, **options):
        *batch, m, k = a.data.shape
        n = b.data.shape[-1]
        flops = 2 * math.prod(batch) * m * n * k
        for counter in _active:
            counter.flops += flops
        return dot(a, b, *rest, **options)

    for name, hook in (("create_masked_load", counted_load), ("create_masked_store", counted_store),
                       ("create_dot", counted_dot)):
        _saved[name] = builder.__dict__.get(name)
        setattr(builder, name, hook)


def _uninstall(builder) -> None:
    for name, previous in _saved.items():
        if previous is None:
            delattr(builder, name)
        else:
            setattr(builder, name, previous)
    _saved.clear()


@contextlib.contextmanager
def count_traffic():
    """Count the loads, stores and dot FLOPs of every kernel launched in the block.

    Usage::

        with count_traffic() as traffic:
            softmax(x)
        print(traffic.bytes_loaded, traffic.intensity)

    Blocks may nest; each counts what ran inside it.

    Raises:
        RuntimeError: Triton is not running in its interpreter (compiled kernels run on the
            GPU, out of Python's sight: use a profiler such as Nsight Compute there).
    """
    if not interpreter_active():
        raise RuntimeError("counting traffic needs Triton's interpreter (TRITON_INTERPRET=1, the default without "
                           "a GPU); compiled GPU kernels are measured with a profiler instead, e.g. "
                           "`ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum python script.py`")
    load_triton()
    from triton.runtime.interpreter import interpreter_builder

    traffic = Traffic()
    if not _active:
        _install(interpreter_builder)
    _active.append(traffic)
    try:
        yield traffic
    finally:
        _active.remove(traffic)
        if not _active:
            _uninstall(interpreter_builder)


def measure_traffic(kernel, grid, *args, **meta) -> Traffic:
    """Launch ``kernel[grid](*args, **meta)`` once and return what it moved and computed."""
    with count_traffic() as traffic:
        kernel[grid](*args, **meta)
    return traffic
