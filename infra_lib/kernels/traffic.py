"""Count what a Triton kernel moves and computes: bytes loaded and stored, and tl.dot FLOPs.

In the interpreter every ``tl.load``, ``tl.store`` and ``tl.dot`` goes through one Python
object (the interpreter's builder). ``count_traffic()`` wraps its masked load, masked store
and dot methods for the duration of a ``with`` block and counts only the lanes whose mask
is on: the bytes the kernel asks memory for, as a GPU would move them (ignoring caches and
the rounding of accesses up to whole memory transactions), per kernel argument too: a lane
counts for the argument whose storage holds its address. On a GPU, kernels are compiled
and no Python runs per access: measure there with a profiler instead (Nsight Compute's
``dram__bytes_read.sum`` and ``dram__bytes_write.sum``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

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
        loaded_from: bytes_loaded per kernel argument, by name ("" for addresses outside every
            tensor argument's storage).
        stored_to: bytes_stored per kernel argument, likewise.
    """

    bytes_loaded: int = 0
    bytes_stored: int = 0
    flops: int = 0
    loads: int = 0
    stores: int = 0
    loaded_from: dict[str, int] = field(default_factory=dict)
    stored_to: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_moved(self) -> int:
        return self.bytes_loaded + self.bytes_stored

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, counted FLOPs per byte moved (0 when nothing moved)."""
        return self.flops / self.bytes_moved if self.bytes_moved else 0.0

    def __str__(self) -> str:
        return (
            f"loaded {self.bytes_loaded:,} B in {self.loads:,} loads, stored {self.bytes_stored:,} B in "
            f"{self.stores:,} stores, {self.flops:,} dot FLOPs ({self.intensity:.2f} FLOP/B)"
        )


_active: list[Traffic] = []
_saved: dict[str, object] = {}
# The launch running now: its tensor arguments' storages as byte ranges (starts sorted), and their names.
_storages: dict[str, object] = {"starts": np.zeros(0, np.uint64), "ends": np.zeros(0, np.uint64), "names": []}


def _element_bytes(ptrs) -> int:
    return ptrs.get_element_ty().primitive_bitwidth // 8


def _note_storages(arg_names, args, kwargs) -> None:
    """Remember where each tensor argument of the launch starting now lives (the interpreter's host copies)."""
    ranges = []
    for name, arg in [*zip(arg_names, args), *kwargs.items()]:
        tensor = getattr(arg, "base", arg)  # a TensorWrapper (e.g. fp8) holds the tensor in .base
        if hasattr(tensor, "untyped_storage"):
            storage = tensor.untyped_storage()
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes(), name))
    ranges.sort()
    _storages.update(
        starts=np.array([r[0] for r in ranges], np.uint64),
        ends=np.array([r[1] for r in ranges], np.uint64),
        names=[r[2] for r in ranges],
    )


def _bytes_by_argument(ptrs, mask) -> dict[str, int]:
    """The active lanes' bytes, per argument whose storage holds the address."""
    addresses = np.broadcast_to(ptrs.data, np.shape(mask.data))[np.asarray(mask.data, dtype=bool)].astype(np.uint64)
    if addresses.size == 0:
        return {}
    starts, ends, names = _storages["starts"], _storages["ends"], _storages["names"]
    slot = np.searchsorted(starts, addresses, side="right").astype(np.int64) - 1
    inside = slot >= 0
    inside[inside] = addresses[inside] < ends[slot[inside]]
    slot[~inside] = len(names)
    counts = np.bincount(slot, minlength=len(names) + 1)
    element = _element_bytes(ptrs)
    return {([*names, ""][i]): int(n) * element for i, n in enumerate(counts) if n}


def _add(per_argument: dict[str, int], counts: dict[str, int]) -> None:
    for name, nbytes in counts.items():
        per_argument[name] = per_argument.get(name, 0) + nbytes


def _install(builder) -> None:
    from triton.runtime.interpreter import GridExecutor

    load, store, dot = builder.create_masked_load, builder.create_masked_store, builder.create_dot
    init_args = GridExecutor._init_args_hst

    def counted_load(ptrs, mask, *rest, **options):
        by_argument = _bytes_by_argument(ptrs, mask)
        for counter in _active:
            counter.bytes_loaded += sum(by_argument.values())
            counter.loads += 1
            _add(counter.loaded_from, by_argument)
        return load(ptrs, mask, *rest, **options)

    def counted_store(ptrs, value, mask, *rest, **options):
        by_argument = _bytes_by_argument(ptrs, mask)
        for counter in _active:
            counter.bytes_stored += sum(by_argument.values())
            counter.stores += 1
            _add(counter.stored_to, by_argument)
        return store(ptrs, value, mask, *rest, **options)

    def noted_init_args(executor, args, kwargs):
        args_hst, kwargs_hst = init_args(executor, args, kwargs)
        _note_storages(executor.arg_names, args_hst, kwargs_hst)
        return args_hst, kwargs_hst

    def counted_dot(a, b, *rest, **options):
        *batch, m, k = a.data.shape
        n = b.data.shape[-1]
        flops = 2 * math.prod(batch) * m * n * k
        for counter in _active:
            counter.flops += flops
        return dot(a, b, *rest, **options)

    for name, hook in (
        ("create_masked_load", counted_load),
        ("create_masked_store", counted_store),
        ("create_dot", counted_dot),
    ):
        _saved[name] = builder.__dict__.get(name)
        setattr(builder, name, hook)
    _saved["GridExecutor"] = init_args
    GridExecutor._init_args_hst = noted_init_args


def _uninstall(builder) -> None:
    from triton.runtime.interpreter import GridExecutor

    GridExecutor._init_args_hst = _saved.pop("GridExecutor")
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
        raise RuntimeError(
            "counting traffic needs Triton's interpreter (TRITON_INTERPRET=1, the default without "
            "a GPU); compiled GPU kernels are measured with a profiler instead, e.g. "
            "`ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum python script.py`"
        )
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
