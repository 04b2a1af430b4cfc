"""Checks for lab 08 (the scheduler and the engine loop).

Task 1: the learner writes ``schedule(self) -> SchedulerOutput``; the checks plug it into a subclass of the
course's ``Scheduler`` (which keeps the queues, the block pool and the helpers) and drive whole engines with
it: seeded workloads on the simulated runner, compared with the reference scheduler step by step, with the
scheduler's invariants checked after every step; then a small random model served by the real engine, whose
tokens must equal greedy decoding.

Task 2: the learner writes ``engine_step(engine) -> list[RequestOutput]``, run as the step of
``engine_class(engine_step)`` on the small random model with a tokenizer that gives it text, replaying the
reference scheduler's plans; every step's outputs, free blocks and the course's books are compared with the
reference engine's (part 6).

Shortcuts: ``Scheduler.schedule`` and ``Scheduler.make_room`` (the reference's planning and its preemption
loop) are registered as methods, not the class: the class would stand for every one of its methods, including
the helpers (``can_reserve``, ``reserve``, ``admit``, ``preempt``...) the learner is meant to call. Likewise
``LLMEngine.step`` and the module's ``engine_step`` (its body), not the engine, whose surface the learner's
step uses. No check runs either task's reference in the graded kernel (``engines``).
"""

from grading.registry import register_shortcuts

from . import (  # noqa: F401  (each part's module registers its checks, in the lab's order)
    part1_running_first,
    part2_admission,
    part3_preemption,
    part4_engine,
    part5_records,
    part6_engine_step,
)

# The reference's planning and its preemption loop, and the reference's engine step: an answer that calls one
# (``Scheduler.schedule``, ``super().schedule()``, ``self.make_room(...)``, ``LLMEngine.step(engine)``) is a
# shortcut, found statically and while the checks run.
register_shortcuts(
    "lab08",
    [
        "infra_lib.serving.scheduler:Scheduler.schedule",
        "infra_lib.serving.scheduler:Scheduler.make_room",
        "infra_lib.serving.engine:engine_step",
        "infra_lib.serving.engine:LLMEngine.step",
    ],
)
