"""The course's one timer: warm-up excluded, device synchronised, median reported.

Timed code in the lessons runs inside ``infra_lib.timed_section.timed_section``, which chooses the
torch thread count for how busy the machine is and checks the pattern the measurement should show.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def time_op(
    fn: Callable[[], Any],
    *,
    warmup: int = 3,
    iters: int = 10,
    sync: Callable[[], None] | None = None,
) -> float:
    """Median wall-clock seconds of one call of ``fn``.

    The first ``warmup`` calls are run and thrown away (they pay for allocation, thread
    start-up, autotuning, caches). Each timed call is followed by ``sync()`` so that work a
    device queued asynchronously is counted; the device is also drained once before timing
    starts, so warm-up work cannot leak into the first timed call.

    Args:
        fn: the operation, called with no arguments.
        warmup: untimed calls before measuring (>= 0).
        iters: timed calls (>= 1).
        sync: waits for the device to finish queued work (``torch.cuda.synchronize``),
            or None where work is synchronous (CPU).

    Returns:
        The median of the ``iters`` timed calls, in seconds.
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
