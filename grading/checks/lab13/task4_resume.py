"""Lab 13 task 4: ``run_graph`` resuming a thread from the checkpoints of a crashed run."""

from __future__ import annotations

import random

from grading.checks.lab13.graphs import counting_loop, graph_spec, random_policy
from grading.checks.lab13.run_comparison import RESUME_HINT, run_graph_parts
from grading.checks.lab13.runs import reference_run
from grading.registry import Check, register


def _resume_cases(rng: random.Random) -> list[dict]:
    spec = graph_spec(rng, 5)
    steps = len(reference_run(spec, 2, 200)["log"])
    cases = [{"spec": spec, "x": 2, "max_steps": 200, "crash_at": k} for k in range(0, steps, max(1, steps // 6))]
    cases.append({"spec": spec, "x": 2, "max_steps": 200, "crash_at": steps - 1})
    cases.append({"spec": spec, "x": 2, "max_steps": 200, "crash_at": None, "rerun_finished": True})
    # The steps before the crash count towards max_steps: a loop that would run for long stops max_steps steps after
    # its start, not max_steps steps after the resume (where exactly is task 3's check: see run_comparison).
    max_steps = rng.randint(8, 12)
    cases.append(
        {"spec": counting_loop(600), "x": 0, "max_steps": max_steps, "crash_at": rng.randint(3, max_steps - 3)}
    )
    return cases


def _sqlite_resume_cases(rng: random.Random) -> list[dict]:
    """A crash at every step of a graph with a flaky node, checkpoints in SQLite, resumed by a new checkpointer."""
    spec = graph_spec(rng, 6)
    spec["nodes"]["n3"]["retry"] = random_policy(rng)
    steps = len(reference_run(spec, 1, 200)["log"])
    return [
        {"spec": spec, "x": 1, "max_steps": 200, "crash_at": k, "sqlite": True, "flaky": {"n3": ["Flaky"]}}
        for k in range(steps)
    ]


register(Check(check_id="lab13.run_graph_resume", **run_graph_parts(4, _resume_cases), hint=RESUME_HINT))
register(
    Check(
        check_id="lab13.run_graph_resume_sqlite",
        **run_graph_parts(4, _sqlite_resume_cases),
        hint=RESUME_HINT + " Hidden cases: a crash at every step of a graph with a flaky node, checkpoints in "
        "SQLite, and the second run on a new SqliteCheckpointer over the same file.",
    )
)
