"""Lab 13's judgement of a run of ``run_graph`` against the reference's: the final state or
error, the node calls, the waits and the checkpoints, with a hint chosen by the mistake found."""

from __future__ import annotations

from grading.checks.common import first_difference, reference
from grading.checks.lab13.graphs import GRAPHS, LOOP, MEDDLED, RUNNER, TASKS
from grading.checks.lab13.runs import SIBLING_TASKS, describe_run, drive_run, is_resume_case, with_recorded_runs
from grading.registry import Mismatch

_RESUME = "chapter 13, section “5 · Crash and resume from an SQLite checkpoint”"
RESUME_HINT = (
    "a second call with the same checkpointer and thread_id takes everything from the thread's latest "
    "checkpoint, not from the input state: its state, its step count and the node it had chosen next, "
    "which is the node that crashed, so that node runs again and no finished node runs twice "
    f"({_RESUME}). A thread whose latest checkpoint leads to END has finished and returns its state "
    "without running anything."
)
# the idea each mistake a run comparison can find has missed: a failure's hint
RUN_MISSED = {
    "limit": "a run is bounded by max_steps, the steps taken before a resume included: once that many steps "
    "have run, a node still due ends the run with GraphRecursionError, so a loop whose exit never comes "
    f"cannot run forever, while a run that needs exactly max_steps steps finishes ({LOOP}).",
    "gives up": "a node whose retries run out ends the whole run with its own error, unchanged; the checkpoints "
    "saved before it stay, ready for a resume.",
    "reducers": "a key with a reducer combines the old value with the node's update (the log grows step by step); "
    f"only the other keys are overwritten ({GRAPHS}).",
    "order": "one node runs per step, exactly once (through its retry policy): the entry node first, then the node "
    f"that the finished node's edge picks from the state with its update merged ({LOOP}).",
    "retry": "each node runs under its own retry policy (none: a single attempt), and every wait goes through the "
    "sleep argument the run was given.",
    "after merge": "a checkpoint is taken once its step is complete: it holds the state with that step's update "
    "merged, so that a resume neither loses nor repeats what the step did "
    f"({LOOP}).",
    "steps": "a checkpoint's step is the number of steps completed so far, this one included, and the count "
    "goes on across a resume.",
    "next": "a checkpoint names the node chosen to run next (END after the last one): that is where a resume "
    f"starts ({_RESUME}).",
    "every step": "there is exactly one checkpoint per completed step, the last one included, so that a finished "
    "thread is seen to be finished and a crash loses at most the step that was running.",
    "resume": RESUME_HINT,
    "copy": "a node is handed a deep copy of the state, one that shares nothing with the run's own: a new dict "
    "alone still holds the same lists, so a node that appends to one in place changes the run's state; "
    f"whatever a node does to what it is handed, only the update it returns reaches the state ({LOOP}).",
    "input": "the state dict the caller passes in is never changed, not even a list inside it: the run works on its "
    "own state, and every merge makes a new dict.",
}


def _own_siblings_hint(names: list[str]) -> str:
    own = " and ".join(f"{name} ({SIBLING_TASKS[name]})" for name in names)
    return (
        f"this check runs the course's next_node and call_with_retry in place of yours, so that run_graph is "
        f"judged on its own, but your run_graph still reached your own {own} some other way than by that name "
        "(another name, a default argument), so a mistake there shows here too: get that task's checks to "
        "pass first; if they pass, the difference is in run_graph itself."
    )


def _state_hint(got, expected) -> str:
    same_x = isinstance(got, dict) and got.get("x") == expected["x"]
    return RUN_MISSED["reducers"] if same_x and got.get("log") != expected["log"] else ""


def _checkpoints_hint(got: list, expected: list, first: int, start: dict) -> str:
    if first >= min(len(got), len(expected)):
        return RUN_MISSED["every step"]
    g, e = got[first], expected[first]
    before_the_step = expected[first - 1][3] if first and len(e) > 3 else start
    if len(e) > 3 and g[3] != e[3] and g[3] == before_the_step:
        return RUN_MISSED["after merge"]
    if g[0] != e[0]:
        return RUN_MISSED["steps"]
    return RUN_MISSED["next"] if g[2] != e[2] else ""


CHECKPOINT_FIELDS = ("step", "node", "next_node", "state")


def _checkpoints_mismatch(
    got: list, expected: list, where: str, start: dict, when: str, fields: int = 4
) -> Mismatch | None:
    """The first checkpoint that differs, and in which of its fields; ``fields=3`` leaves the states out."""
    got, expected = [c[:fields] for c in got], [c[:fields] for c in expected]
    if got == expected:
        return None
    first = first_difference(got, expected)
    names = ", ".join(CHECKPOINT_FIELDS[:fields])
    count = (
        f"{len(got)} checkpoints [{names}] as expected"
        if len(got) == len(expected)
        else f"{len(got)} checkpoints [{names}] where {len(expected)} were expected"
    )
    if first < min(len(got), len(expected)):
        differs = " and ".join(name for name, g, e in zip(CHECKPOINT_FIELDS, got[first], expected[first]) if g != e)
        which = (
            f"checkpoint {first} is the first that differs, in its {differs}: expected {expected[first]}, "
            f"got {got[first]}"
        )
    elif len(got) < len(expected):
        which = f"the first {first} are right, then checkpoint {first} is missing: expected {expected[first]}"
    else:
        which = f"the first {first} are right, then comes one too many: {got[first]}"
    return Mismatch(
        "run_graph saved the wrong checkpoints",
        f"on {where}: {when}, {count}; {which}",
        hint=_checkpoints_hint(got, expected, first, start),
    )


def _meddled(got, expected, where: str) -> Mismatch | None:
    """The node that changes its state in place reached the run's state: which copy was missing."""
    if not isinstance(got, dict) or got == expected:
        return None
    if isinstance(got.get("x"), int) and isinstance(expected.get("x"), int) and got["x"] >= expected["x"] + 1000:
        how = "its x += 1000 reached the run's state: the node was handed the run's own state dict"
    elif MEDDLED in (got.get("log") or []):
        how = (
            "its log.append('meddled') reached the run's state: the node was handed a new dict that still "
            "holds the run's lists"
        )
    else:
        return None
    return Mismatch(
        "a node's change to the state it was handed reached the run's state",
        f"on {where}: {how}; expected the final state {expected!r:.160}, got {got!r:.160}",
        hint=RUN_MISSED["copy"],
    )


def _limit_mismatch(g: dict, e: dict, case: dict, where: str) -> Mismatch | None:
    """Both runs stopped at max_steps, after different numbers of node calls."""
    if e["first"][:2] != ["raised", "GraphRecursionError"] or g["events"] == e["events"]:
        return None
    return Mismatch(
        "run_graph stopped at a different step limit",
        f"on {where}: with max_steps={case['max_steps']} the run should make {len(e['events'])} node "
        f"calls ({e['events']}) and then raise GraphRecursionError; yours made {len(g['events'])} "
        f"({g['events']})",
        hint=RUN_MISSED["limit"],
    )


def _input_mismatch(g: dict, e: dict, where: str, which: str) -> Mismatch | None:
    if g.get("input_after") == e["input_after"]:
        return None
    return Mismatch(
        "run_graph changed the state dict it was given",
        f"on {where}: the {which} was {e['input_after']!r:.120} before the call and "
        f"{g.get('input_after')!r:.120} after it",
        hint=RUN_MISSED["input"],
    )


def _run_mismatch(g: dict, e: dict, case: dict) -> Mismatch | None:
    if is_resume_case(case):
        return _resume_mismatch(g, e, case)
    where, start = describe_run(case), {"x": case["x"], "log": []}
    (gk, gv), (ek, ev) = g["first"][:2], e["first"][:2]
    wrong = (_meddled(gv, ev, where) if gk == ek == "value" else None) or _input_mismatch(g, e, where, "input state")
    if wrong:
        return wrong
    if [gk, gv] != [ek, ev]:
        if ek == "raised":
            return Mismatch(
                f"run_graph should raise {ev} here",
                f"on {where}: got {gv!r:.200}",
                hint=RUN_MISSED["limit" if ev == "GraphRecursionError" else "gives up"],
            )
        if gk == "raised" and gv == "GraphRecursionError":
            return Mismatch(
                "run_graph stopped at max_steps where it should finish",
                f"on {where}: the run needs {len(e['events'])} steps, within max_steps="
                f"{case['max_steps']}, and should end in {ev!r:.200}; yours raised GraphRecursionError "
                f"after {len(g['events'])} node calls",
                hint=RUN_MISSED["limit"],
            )
        if gk == "raised":
            return Mismatch("run_graph raised where it should finish", f"on {where}: expected {ev!r:.200}, got {gv}")
        if gk != "value":
            return Mismatch("run_graph must return the final state, a dict", f"on {where}: got {gv}")
        return Mismatch(
            "run_graph ended in the wrong state",
            f"on {where}: expected {ev!r:.200}, got {gv!r:.200}",
            hint=_state_hint(gv, ev),
        )
    wrong = _limit_mismatch(g, e, case, where)
    if wrong:
        return wrong
    if g["events"] != e["events"]:
        return Mismatch(
            "run_graph ran the nodes in the wrong order",
            f"on {where}: expected the calls {e['events']}, got {g['events']}",
            hint=RUN_MISSED["order"],
        )
    if g["sleeps"] != e["sleeps"]:
        return Mismatch(
            "run_graph did not retry as the node's policy says",
            f"on {where}: expected sleep() with {e['sleeps']}, got {g['sleeps']}",
            hint=RUN_MISSED["retry"],
        )
    return _checkpoints_mismatch(g["history"], e["history"], where, start, "after the run")


def _resume_mismatch(g: dict, e: dict, case: dict) -> Mismatch | None:
    """Task 4: the course's runner made the checkpoints, the runner under test resumed from them. What its
    resumed run saved is compared without the states: a checkpoint of the wrong state is task 3's."""
    where, start = describe_run(case), {"x": case["x"], "log": []}
    wrong = _input_mismatch(g, e, where, "input state of the second call")
    if wrong:
        return wrong
    (gk, gv), (ek, ev) = g.get("resumed", [None, None])[:2], e["resumed"][:2]
    stopped = ek == gk == "raised" and ev == gv == "GraphRecursionError"
    if stopped and abs(len(g.get("resumed_events") or []) - len(e["resumed_events"])) <= 1:
        return None  # the steps before the crash were counted; the exact step limit is task 3's check
    made = len(g.get("resumed_events") or [])
    if [gk, gv] != [ek, ev] and ek == "raised" and ev == "GraphRecursionError":
        return Mismatch(
            "the resumed run did not stop at max_steps",
            f"on {where}: the {case['crash_at']} steps before the crash count, so the resumed run should "
            f"stop after {len(e['resumed_events'])} more node calls with GraphRecursionError; yours made "
            f"{made} and {'raised ' + str(gv) if gk == 'raised' else 'returned ' + repr(gv)[:120]}",
            hint=RUN_MISSED["limit"],
        )
    if stopped:
        return Mismatch(
            "the resumed run did not count the steps taken before the crash",
            f"on {where}: with max_steps={case['max_steps']} and {case['crash_at']} steps done before the "
            f"crash, the resumed run should make {len(e['resumed_events'])} node calls and then raise "
            f"GraphRecursionError; yours made {made}",
            hint=RUN_MISSED["limit"],
        )
    if g.get("resumed_events") != e["resumed_events"]:
        return Mismatch(
            "the resumed run did not start from the last checkpoint",
            f"on {where}: expected it to call {e['resumed_events']}, it called {g.get('resumed_events')}",
            hint=RUN_MISSED["resume"],
        )
    if [gk, gv] != [ek, ev]:
        return Mismatch(
            "the resumed run ended in the wrong state",
            f"on {where}: expected {ev!r:.200}, got {gv!r:.200}",
            hint=RUN_MISSED["resume"],
        )
    return _checkpoints_mismatch(g["history"], e["history"], where, start, "after the resumed run", fields=3)


def compare_run(got, expected, cases) -> Mismatch | None:
    """The first case whose run differs from the reference's, and how; a resume case is judged on its resume."""
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        wrong = _run_mismatch(g, e, case)
        if wrong and g.get("own_siblings"):
            names = g["own_siblings"]
            return Mismatch(
                f"{wrong.what}; your run_graph ran your own {' and '.join(names)}, not the course's",
                wrong.detail,
                hint=_own_siblings_hint(names),
            )
        if wrong:
            return wrong
    return None


def run_graph_parts(task: int, make) -> dict:
    """The fields the checks of tasks 3 and 4 share: ``run_graph`` on the cases ``make`` draws (with the
    reference's recorded runs), driven on the stand-ins and judged by :func:`compare_run`."""
    return {
        "task": TASKS[task],
        "reference": reference(RUNNER, "run_graph"),
        "make_inputs": with_recorded_runs(make),
        "drive": drive_run,
        "compare": compare_run,
    }
