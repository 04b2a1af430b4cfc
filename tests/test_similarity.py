"""The similarity report: pasted references and near-copies flagged, honest answers in their own
style not, short answers not compared, hostile sources neither crash it nor slow it down."""

from __future__ import annotations

import inspect

import pytest

from conftest import REPO, write_learner_notebook
from grading.similarity import class_matches, flags, grams, report, score, tokens
from infra_lib.timing import time_op

HEAD2 = '''def time_op(fn, *, warmup: int = 3, iters: int = 10, sync=None) -> float:
    """Median seconds of one call of fn, warm-up excluded, device synchronised."""
'''
HEAD3 = '''def dominant_op(prof) -> str:
    """Name of the op or kernel with the largest self time in a profiler result."""
'''
ALICE = {
 "task2_time_op": HEAD2 + '''    import time as _t
    i = 0
    while i < warmup:
        fn()
        i += 1
    if sync:
        sync()
    times = sorted(_measure(fn, sync, _t) for _ in range(iters))
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2


def _measure(fn, sync, clock):
    t0 = clock.perf_counter()
    fn()
    if sync:
        sync()
    return clock.perf_counter() - t0
''',
 "task3_dominant_op": HEAD3 + '''    best_name, best = None, -1.0
    events = prof.key_averages()
    use_device = False
    for e in events:
        if e.self_device_time_total > 0:
            use_device = True
            break
    for e in events:
        t = e.self_device_time_total if use_device else e.self_cpu_time_total
        if t > best:
            best_name, best = e.key, t
    return best_name
'''}
BOB = {
 "task2_time_op": HEAD2 + '''    [fn() for _ in range(warmup)]
    (sync or (lambda: None))()
    samples = []
    while len(samples) < iters:
        begin = time.perf_counter_ns()
        fn()
        (sync or (lambda: None))()
        samples.append((time.perf_counter_ns() - begin) / 1e9)
    return float(statistics.median(samples))
''',
 "task3_dominant_op": HEAD3 + '''    table = {row.key: (row.self_device_time_total, row.self_cpu_time_total) for row in prof.key_averages()}
    column = 0 if any(device for device, _ in table.values()) else 1
    return sorted(table, key=lambda name: table[name][column])[-1]
'''}
# carol pastes the body of the course's own time_op (infra_lib.timing), renaming a variable
CAROL = {"task2_time_op": HEAD2 + inspect.getsource(time_op).split('"""')[2].lstrip("\n").replace("samples", "ts")}
DAVE = {
 "task3_dominant_op": HEAD3 + '''    averages = prof.key_averages()
    device_total = sum(a.self_device_time_total for a in averages)
    if device_total > 0:
        ranked = sorted(averages, key=lambda a: a.self_device_time_total, reverse=True)
    else:
        ranked = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)
    top = ranked[0]
    return str(top.key)
'''}
ERIN = {  # dave's, renamed and reformatted, a comment added
 "task3_dominant_op": HEAD3 + '''    # rank every op by its self time
    avgs = prof.key_averages()
    dev = sum(x.self_device_time_total for x in avgs)
    if dev > 0:
        order = sorted(avgs, key=lambda x: x.self_device_time_total, reverse=True)
    else:
        order = sorted(avgs,
                       key=lambda x: x.self_cpu_time_total,
                       reverse=True)
    first = order[0]
    return str(first.key)
'''}

CLASS = {"alice": ALICE, "bob": BOB, "carol": CAROL, "dave": DAVE, "erin": ERIN,
         "frank": {"task1_gemm_flops": "def gemm_flops(m, n, k):\n    return 2 * m * n * k\n"},
         "gina": {"task1_gemm_flops": "def gemm_flops(m, n, k):\n    return 2 * k * n * m  # the same count\n"}}


@pytest.fixture(scope="module")
def matches(tmp_path_factory):
    folder = tmp_path_factory.mktemp("class")
    notebooks = {learner: write_learner_notebook(folder / learner / "lab01_gemm.ipynb", answers)
                 for learner, answers in CLASS.items()}
    (folder / "broken.ipynb").write_text("{ not json")
    notebooks["hal"] = folder / "broken.ipynb"
    return class_matches(notebooks, "lab01_gemm", REPO / "solutions")


def test_a_pasted_reference_and_two_near_copies_are_flagged_and_honest_answers_are_not(matches):
    found = {(m.learner, m.answer, m.other) for m in matches}
    assert ("carol", "task2_time_op", "reference infra_lib.timing.time_op") in found
    assert ("carol", "task2_time_op", "the course's solution") in found
    assert {("dave", "task3_dominant_op", "erin"), ("erin", "task3_dominant_op", "dave")} <= found
    flagged = flags(matches)
    assert set(flagged) == {"carol", "dave", "erin"}, flagged
    assert flagged["dave"] == "task3_dominant_op: erin 1.00"
    # one-line answers are the one obvious answer: frank's and gina's are not compared
    assert not any(m.answer == "task1_gemm_flops" for m in matches)
    text = report(matches, "lab01_gemm", len(CLASS) + 1)
    assert "| carol | task2_time_op | reference infra_lib.timing.time_op |" in text
    assert "not a verdict" in text and "alice" not in text and "bob" not in text


def test_names_comments_layout_and_constants_do_not_change_an_answers_structure():
    a = "def f(xs, k=3):\n    total = 0\n    for x in xs:\n        total += x * k\n    return total\n"
    b = ("def g(values, scale=7):\n    '''Docstring.'''\n    # a comment\n    acc = 0\n    for v in values:\n"
         "        acc += v * scale\n\n    return acc\n")
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(a.replace("x * k", "x + k"))
    assert grams(a) == grams(b)
    assert score(grams("def f(m, n):\n    return 2 * m * n\n"), grams("def g(a, b):\n    return 2 * a * b\n")) is None


@pytest.mark.parametrize("source", ["def f(:\n", "(" * 5000 + ")" * 5000, "x = [" + "[" * 300 + "]" * 301 + "\n",
                                    "a = 1\n" * 100_000], ids=["syntax error", "parentheses", "nesting", "long"])
def test_a_hostile_answer_is_left_out_not_a_crash(source):
    assert tokens(source) is None
