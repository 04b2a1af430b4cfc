"""A timed section: a thread count chosen for how busy the machine is, and a check on what it measured.

PyTorch splits each CPU operation across its intra-op threads and waits for the slowest one at
the end. When other programs keep some cores busy, one of those threads waits for a core, and
every operation waits with it: a GEMM can take ten or more times longer with two threads than with
one. ``timed_section`` measures the machine just before the timed code runs, sets torch's thread
count so that the timed code does not oversubscribe the cores that are left, says what it chose
and why, and restores the old count afterwards.

A lesson's prose expects a pattern (a batch beats batch 1 per token, a first call is slower
than a warm one). ``TimedSection.check`` tests the pattern on the numbers this run measured and
prints one line: a tick when it holds, and otherwise a note that says what was expected, what
was measured, how busy the machine was, and what to do about it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil
import torch

BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq", "steal")  # CPU time that is not idle or waiting on I/O
FREE_CORE_SLACK = 0.25  # a core other programs use for less than this share still counts as free
QUIET_BUSY_CORES = 0.5  # other programs using fewer cores than this: the machine counts as quiet


@dataclass(frozen=True)
class MachineLoad:
    """How busy the cores this process may use were over a short sample.

    Attributes:
        cores: cores this process may run on (its CPU affinity).
        others_busy_cores: cores' worth of CPU time other programs used during the sample
            (0 = idle, ``cores`` = every core fully taken).
        load_average: the 1-minute load average (runnable threads of every program, this one
            included), or None where the OS does not report one.
    """

    cores: int
    others_busy_cores: float
    load_average: float | None

    def describe(self) -> str:
        """One phrase, e.g. 'other programs kept 1.3 of 2 cores busy (load average 2.4)'."""
        load = "" if self.load_average is None else f" (load average {self.load_average:.1f})"
        return f"other programs kept {self.others_busy_cores:.1f} of {self.cores} cores busy{load}"


def usable_cores() -> int:
    """The number of cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _cpu_counters() -> tuple[float, float, float]:
    """Wall clock, busy CPU seconds of the usable cores, CPU seconds of this process and its reaped children."""
    per_cpu = psutil.cpu_times(percpu=True)
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(len(per_cpu))
    busy = sum(getattr(per_cpu[i], name, 0.0) for i in allowed if i < len(per_cpu) for name in BUSY_FIELDS)
    own = psutil.Process().cpu_times()
    own_total = own.user + own.system + getattr(own, "children_user", 0.0) + getattr(own, "children_system", 0.0)
    return time.perf_counter(), busy, own_total


def _others_busy_since(start: tuple[float, float, float]) -> float:
    """Cores' worth of CPU time that other programs used since ``start`` (from ``_cpu_counters``)."""
    now = _cpu_counters()
    wall = now[0] - start[0]
    if wall <= 0:
        return 0.0
    others = (now[1] - start[1]) - (now[2] - start[2])
    return min(float(usable_cores()), max(0.0, others / wall))


def measure_load(sample_s: float = 0.2) -> MachineLoad:
    """Sample how busy the usable cores are while this process sleeps for ``sample_s`` seconds.

    This process's own CPU time is subtracted, so what remains is other programs' use. The
    sample is short and instantaneous, unlike the load average, which trails by a minute and
    counts this process's own earlier work.
    """
    if sample_s <= 0:
        raise ValueError(f"sample_s must be > 0, got {sample_s}")
    start = _cpu_counters()
    time.sleep(sample_s)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return MachineLoad(usable_cores(), _others_busy_since(start), load)


def choose_threads(load: MachineLoad, most: int) -> tuple[int, str]:
    """The torch thread count for a timed section on a machine this busy, and the reason in words.

    One thread per core that other programs leave free (a core they use for less than a quarter
    counts as free), at least one and at most ``most``.

    Args:
        load: the machine's state, from ``measure_load``.
        most: the largest thread count to use (torch's own setting, unless a cell asks for fewer).

    Returns:
        ``(threads, reason)``.
    """
    if most < 1:
        raise ValueError(f"most must be >= 1 thread, got {most}")
    free = int(load.cores - load.others_busy_cores + FREE_CORE_SLACK)
    threads = max(1, min(most, free))
    if free >= most:
        limit = f" ({most} is the most this section uses)" if most < load.cores else ""
        return threads, f"{load.describe()}, so each thread gets a core of its own{limit}"
    return threads, (
        f"{load.describe()}; more threads than free cores would make every operation wait "
        "for a thread that is waiting for a core"
    )


@dataclass
class TimedSection:
    """What ``timed_section`` chose, the load it saw, and the checks of what the section measured.

    Attributes:
        threads: torch threads the section ran with.
        previous_threads: torch threads before it (restored afterwards).
        reason: why ``threads`` was chosen.
        before: the load sampled just before the section.
        others_busy_during: cores' worth of CPU time other programs used while the section ran,
            set when it ends (``others_busy_now()`` gives the figure so far while it runs).
        checks: every ``check`` made, as ``(holds, line printed)``.
    """

    threads: int
    previous_threads: int
    reason: str
    before: MachineLoad
    others_busy_during: float | None = None
    checks: list[tuple[bool, str]] = field(default_factory=list)
    _started: tuple[float, float, float] | None = field(default=None, repr=False)

    def describe(self) -> str:
        """One line: the thread count and why."""
        plural = "" if self.threads == 1 else "s"
        return f"timing with {self.threads} torch thread{plural}: {self.reason}"

    def others_busy_now(self) -> float:
        """Other programs' CPU use (in cores) over the section so far, or in total once it ended."""
        if self.others_busy_during is not None:
            return self.others_busy_during
        if self._started is None:
            return self.before.others_busy_cores
        return _others_busy_since(self._started)

    def note(self, holds: bool, expected: str, measured: str) -> str:
        """The line ``check`` prints: a tick when the pattern holds, else what went wrong and what to do.

        Args:
            holds: whether this run's numbers show the expected pattern.
            expected: the pattern, as a phrase ("batch 32 at least twice batch 1's FLOP rate").
            measured: what this run measured, as a phrase ("2.1 against 19.2 GFLOP/s").
        """
        if holds:
            return f"✓ expected {expected}, and this run measured {measured}."
        busy = max(self.before.others_busy_cores, self.others_busy_now())
        threads = f"this cell used {self.threads} torch thread{'' if self.threads == 1 else 's'}"
        cores = self.before.cores
        load = "" if self.before.load_average is None else f", load average {self.before.load_average:.1f}"
        head = f"⚠ Unexpected result: expected {expected}, but this run measured {measured}."
        if busy >= QUIET_BUSY_CORES:
            return (
                f"{head} The run was disturbed: other programs kept up to {busy:.1f} of {cores} cores busy "
                f"while it was timed ({threads}{load}). Close other programs or let background jobs finish, "
                "then rerun this cell."
            )
        return (
            f"{head} The machine looked quiet (other programs used {busy:.1f} of {cores} cores; "
            f"{threads}{load}), so a short disturbance or this machine itself is the "
            "cause. Rerun this cell; if the result repeats on a quiet machine, the expectation does not "
            "hold here, and the text explains what it depends on."
        )

    def check(self, holds: bool, expected: str, measured: str) -> bool:
        """Print ``note(holds, expected, measured)``, record it, and return ``holds``."""
        line = self.note(holds, expected, measured)
        self.checks.append((holds, line))
        print(line)
        return holds


@contextmanager
def timed_section(
    most_threads: int | None = None, *, sample_s: float = 0.2, show: bool = True
) -> Iterator[TimedSection]:
    """Run a block of timed code with a thread count chosen for the machine's load; restore it after.

    Args:
        most_threads: the largest thread count to use (default: torch's current setting).
        sample_s: seconds to sample the machine's load before the block starts.
        show: print the choice and its reason before the block runs.

    Yields:
        The ``TimedSection``: its choice, the load it saw, and ``check`` for the block's results.
    """
    previous = torch.get_num_threads()
    before = measure_load(sample_s)
    threads, reason = choose_threads(before, previous if most_threads is None else most_threads)
    section = TimedSection(threads, previous, reason, before)
    if show:
        print(section.describe())
    section._started = _cpu_counters()
    torch.set_num_threads(threads)
    try:
        yield section
    finally:
        torch.set_num_threads(previous)
        section.others_busy_during = _others_busy_since(section._started)
