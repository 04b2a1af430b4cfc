"""Checks for lab 13 (the graph runner): the learner writes ``next_node(graph, current, state)``,
``call_with_retry(fn, state, policy, sleep)`` and ``run_graph(graph, state, *, checkpointer,
thread_id, max_steps, sleep)``: execute a node, merge its update, pick the next edge, checkpoint,
retry with exponential backoff, and resume from the last checkpoint.

Graphs are built from seeded plain-data specs with the course's ``StateGraph``: nodes that add to
or multiply a counter and append their name to a log (a reducer), plain edges, conditional edges
whose routers compare the counter with a limit (some through a mapping), and loops that end once
the counter passes a limit. Flaky functions fail a planned number of times with planned exception
types; ``sleep`` is replaced by a recorder, so the backoff sequence is compared exactly and no
check waits. A crash is a planned exception at step k of a run of the reference runner, recorded where the
inputs are made (in the grader's process when the kernel is sandboxed): its checkpoints, node calls
and waits are what a correct runner leaves. The learner's kernel only writes those checkpoints into
the thread, and the learner's run_graph then resumes it and must end in the same state as an
uninterrupted run, re-running only the node that crashed. So task 4 judges the resume alone, and a
checkpoint mistake costs task 3 only.

Each task is scored on its own: while a check of task 3 or 4 runs, the learner's notebook sees the
course's stand-ins for ``next_node`` and ``call_with_retry`` under those names, so a slip in task 1
or 2 costs only that task. The stand-ins answer from the check's own plain data, never by the
tasks' rules: the next node from the graph's spec, and a node's attempts and waits from the
reference's retries of that node, recorded with the inputs. A failure's hint is chosen by the
mistake the comparison found.
"""

from grading.registry import register_shortcuts

from . import (  # noqa: F401  (each task's module registers its checks, in task order)
    task1_next_node,
    task2_call_with_retry,
    task3_run_graph,
    task4_resume,
)

register_shortcuts(
    "lab13",
    [
        "infra_lib.apps.agents.runner:next_node",
        "infra_lib.apps.agents.runner:run_graph",
        "infra_lib.apps.agents.retry:call_with_retry",
        "infra_lib.apps.agents.retry:backoff_delays",
    ],
)
