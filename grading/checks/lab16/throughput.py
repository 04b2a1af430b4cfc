"""Capstone task 5's throughput: the learner's engine against the course's, timed in turns.

Both engines serve the same requests in alternating rounds in one process (yours then the course's,
then the course's then yours, then yours then the course's), and each tier judges the median of the
three rounds' paired ratios. A busy machine slows both halves of a pair alike, so the verdict does not
move with the load; a round disturbed by a burst moves one ratio of three, which the median ignores.
Both run on one torch thread: with more, every small operation waits for its slowest thread, and a
thread waiting for a core on a busy machine slows an engine of many small operations (attention per
sequence) far more than one of few large ones, so the ratio itself would move with the load.

The course's rounds run in the learner's kernel, beside the learner's code. So that this code cannot
slow them (a thread or a process left running that works only while the course's engine is timed), the
driver counts the process's threads and its child processes before any of the learner's code runs,
and refuses the measurement when a course round would start with more of either.
"""

from __future__ import annotations

import os
import statistics
import time

from grading.checks.lab16.engine import (
    COURSE,
    QUESTIONS,
    TASKS,
    assembled_pieces,
    course,
    one_thread,
    run_engine,
    where,
)
from grading.registry import Check, Mismatch, register

_clock = time.perf_counter  # taken before any answer runs: a learner rebinding time.perf_counter changes nothing

_MEASURED: list = []  # (implementation, case, result) of this process's throughput runs


def _drive_throughput(implementation, case):
    """The paired measurement (the course's side: its answers, which every timed round's must equal).

    Both throughput tiers judge one measurement: they draw the same case for a seed (one inputs_group),
    and a second check with the same functions and the same case reuses the first one's rounds (the entry
    keeps the functions alive, so their ids stay theirs).
    """
    if implementation is COURSE:  # the course's engine against itself: its answers, at 1.0x by definition
        answers = run_engine({}, case, invariants=False)["tokens"]
        return {
            "answers": answers,
            "ratio": 1.0,
            "ratios": [1.0],
            "tokens": [answers],
            "course_tokens": [answers],
            "yours": [],
        }
    if type(implementation) is not dict:
        return _measure_throughput(implementation, case)  # assembled_pieces says what it needs
    key = sorted((lab, id(function)) for lab, function in implementation.items())
    for functions, measured_case, result in _MEASURED:
        if measured_case == case and sorted((lab, id(f)) for lab, f in functions.items()) == key:
            return dict(result)
    result = _measure_throughput(implementation, case)
    _MEASURED.append((dict(implementation), case, result))
    return dict(result)


def _threads() -> int:
    """The process's threads, native ones included (torch's pools, a thread started from C)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _children() -> int:
    import psutil

    try:
        return len(psutil.Process().children(recursive=True))
    except psutil.Error:
        return 0


def _timed(pieces, case) -> dict:
    start = _clock()
    out = run_engine(pieces, case, invariants=False)
    seconds = _clock() - start
    return {"tokens_per_s": sum(len(t) for t in out["tokens"] if t) / seconds, "tokens": out["tokens"]}


def _measure_throughput(implementation, case):
    with one_thread():
        return _paired_rounds(implementation, case)


def _paired_rounds(implementation, case):
    short = {**case, "new_tokens": [2] * len(case["questions"])}
    run_engine({}, short, invariants=False)  # the course's warm-up: the model loaded, torch's threads started
    threads, children = _threads(), _children()
    pieces = assembled_pieces(implementation)
    run_engine(pieces, short, invariants=False)  # yours
    rounds = []
    for r in range(case["rounds"]):
        pair = {}
        for side in ("yours", "course") if r % 2 == 0 else ("course", "yours"):
            if side == "course" and (_threads() > threads or _children() > children):
                return {
                    "left_running": {"threads": _threads() - threads, "processes": _children() - children},
                    "yours": sorted(pieces),
                }
            pair[side] = _timed(pieces if side == "yours" else {}, case)
        rounds.append(pair)
    ratios = [p["yours"]["tokens_per_s"] / p["course"]["tokens_per_s"] for p in rounds]
    return {
        "ratio": round(statistics.median(ratios), 3),
        "ratios": [round(x, 3) for x in ratios],
        "tokens_per_s": round(statistics.median(p["yours"]["tokens_per_s"] for p in rounds), 2),
        "course_tokens_per_s": round(statistics.median(p["course"]["tokens_per_s"] for p in rounds), 2),
        "tokens": [p["yours"]["tokens"] for p in rounds],
        "course_tokens": [p["course"]["tokens"] for p in rounds],
        "yours": sorted(pieces),
    }


def throughput_ratio(got, expected=None) -> float:
    """The median of the paired rounds' ratios (yours over the course's output tokens per second)."""
    return float(got.get("ratio", 0.0)) if type(got) is dict else 0.0


def _compare_throughput(threshold):
    def compare(got, expected, case):
        if type(got) is not dict:
            return Mismatch("the throughput run returned no measurement")
        if got.get("left_running"):
            left = got["left_running"]
            return Mismatch(
                "your engine left work running while the course's engine was timed beside it",
                f"on {where(case)}: {left.get('threads', 0)} more thread(s) and {left.get('processes', 0)} more "
                "process(es) than before your code ran",
                hint="the two engines are timed in turns in one process: a piece must finish its work in its "
                "own calls, leaving no thread or process behind.",
            )
        if type(got.get("ratio")) not in (int, float) or type(got.get("tokens")) is not list:
            return Mismatch("the throughput run returned no measurement")
        if any(tokens != expected.get("answers") for tokens in got["tokens"]):  # speed counts only for these answers
            return Mismatch(
                "the throughput run's answers differ from the course's engine's",
                f"on {where(case)}: the engine must give the same greedy tokens while it is timed",
            )
        if any(tokens != expected.get("answers") for tokens in got.get("course_tokens", [])):
            return Mismatch(
                "the course's engine, timed beside yours, answered differently than on its own",
                f"on {where(case)}: something your pieces changed reached the course's engine",
                hint="a piece must not change the course's classes or shared state: the course's engine is "
                "timed in the same process as yours.",
            )
        ratio = throughput_ratio(got)
        if ratio < threshold:
            return Mismatch(
                f"your engine's throughput is {ratio:.2f}x the course's engine's; this check needs {threshold:.2f}x",
                f"on {where(case)}: the median of {len(got.get('ratios', []))} paired rounds "
                f"{got.get('ratios')} ({got.get('tokens_per_s')} against {got.get('course_tokens_per_s')} output "
                f"tokens/s); yours: {', '.join(got.get('yours', []))}",
            )
        return None

    return compare


def _throughput_case(rng):
    return {
        "questions": rng.sample(QUESTIONS, 4),
        "new_tokens": [8] * 4,
        "rounds": 3,
        "config": {"max_num_seqs": 4, "budget": 64, "block_size": 16, "num_blocks": 64},
    }


THROUGHPUT_TIERS = {"lab16.throughput_a_quarter": 1 / 4, "lab16.throughput_half": 1 / 2}


def _measures(got, expected) -> dict:
    return {"throughput_ratio": round(throughput_ratio(got), 3), "pieces_yours": len(got.get("yours", []))}


def throughput_parts(check_id: str) -> dict:
    """The fields of a throughput tier's check: both tiers judge one measurement (one inputs_group)."""
    return dict(
        task=TASKS[5],
        reference=course,
        make_inputs=_throughput_case,
        drive=_drive_throughput,
        compare=_compare_throughput(THROUGHPUT_TIERS[check_id]),
        inputs_group="lab16.throughput",
        measure=_measures,
        hint="measure where your engine's step spends its time (chapter 16's profile of one step): "
        "work per waiting request in the scheduler, a pool operation that walks every block, or Python "
        "loops per token in attention are the usual places (chapters 07, 08 and 15).",
    )


register(Check(check_id="lab16.throughput_a_quarter", **throughput_parts("lab16.throughput_a_quarter")))
register(Check(check_id="lab16.throughput_half", **throughput_parts("lab16.throughput_half")))
