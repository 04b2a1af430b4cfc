"""Checks for lab 08 (the scheduler): the learner writes ``schedule(self) -> SchedulerOutput``; the
checks plug it into a subclass of the course's ``Scheduler`` (which keeps the queues, the block pool
and the helpers) and drive whole engines with it: seeded workloads on the simulated runner, compared
with the reference scheduler step by step, with the scheduler's invariants checked after every step;
then a small random model served by the real engine, whose tokens must equal greedy decoding.

Shortcuts: ``Scheduler.schedule`` and ``Scheduler.make_room`` (the reference's planning and its
preemption loop) are registered as methods, not the class: the class would stand for every one of its
methods, including the helpers (``can_reserve``, ``reserve``, ``admit``, ``preempt``...) the learner is
meant to call.
"""

from grading.registry import register_shortcuts

from . import (  # noqa: F401  (each part's module registers its checks, in the lab's order)
    part1_running_first,
    part2_admission,
    part3_preemption,
    part4_engine,
    part5_records,
)

# The reference's planning and its preemption loop: an answer that calls either (``Scheduler.schedule``,
# ``super().schedule()``, ``self.make_room(...)``) is a shortcut, found statically and while the checks run.
register_shortcuts(
    "lab08", ["infra_lib.serving.scheduler:Scheduler.schedule", "infra_lib.serving.scheduler:Scheduler.make_room"]
)
