"""Pipeline parallelism: the model's layers split into p stages on p devices, the batch into m
micro-batches that flow through them.

GPipe runs every micro-batch's forward through the stages, then every backward in reverse. A
stage idles while the pipeline fills and drains: with equal stage times the idle fraction
(the bubble) is (p - 1) / (m + p - 1), so many micro-batches per batch keep it small.
"""

from __future__ import annotations

from dataclasses import dataclass


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a GPipe schedule with equal stage times: (p - 1) / (m + p - 1)."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be >= 1, got {stages} and {microbatches}")
    return (stages - 1) / (microbatches + stages - 1)


@dataclass(frozen=True)
class Slot:
    """One stage running one micro-batch's forward ("F") or backward ("B") from ``start`` to ``end``."""

    stage: int
    microbatch: int
    kind: str
    start: float
    end: float


def gpipe_schedule(stages: int, microbatches: int, forward_time: float = 1.0, backward_time: float = 2.0) -> list[Slot]:
    """The GPipe timeline: all forwards (stage s runs micro-batch i at step s + i), then all backwards
    in reverse stage order. Returns every slot; the makespan is ``max(slot.end)``."""
    bubble_fraction(stages, microbatches)  # validates
    slots = []
    for i in range(microbatches):
        for s in range(stages):
            start = (s + i) * forward_time
            slots.append(Slot(s, i, "F", start, start + forward_time))
    forward_end = (stages + microbatches - 1) * forward_time
    for i in range(microbatches):
        for s in reversed(range(stages)):
            start = forward_end + ((stages - 1 - s) + i) * backward_time
            slots.append(Slot(s, i, "B", start, start + backward_time))
    return slots


def schedule_bubble(slots: list[Slot]) -> float:
    """Measured idle fraction of a schedule: 1 - busy time / (stages x makespan)."""
    stages = 1 + max(s.stage for s in slots)
    makespan = max(s.end for s in slots) - min(s.start for s in slots)
    busy = sum(s.end - s.start for s in slots)
    return 1 - busy / (stages * makespan)
