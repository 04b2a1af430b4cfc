"""The similarity report: pasted references and near-copies flagged, honest answers in their own
style not, short answers not compared, hostile sources neither crash it nor slow it down."""

from __future__ import annotations

import inspect
import re

import pytest
from conftest import REPO, answer_cells, write_learner_notebook

from grading.similarity import class_matches, flags, grams, report, score, tokens
from infra_lib.timing import time_op

HEAD2 = '''def time_op(fn, *, warmup: int = 3, iters: int = 10, sync=None) -> float:
    """Median seconds of one call of fn, warm-up excluded, device synchronised."""
'''
HEAD3 = '''def dominant_op(prof) -> str:
    """Name of the op or kernel with the largest self time in a profiler result."""
'''
ALICE = {
    "task2_time_op": HEAD2
    + """    import time as _t
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
""",
    "task3_dominant_op": HEAD3
    + """    best_name, best = None, -1.0
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
""",
}
BOB = {
    "task2_time_op": HEAD2
    + """    [fn() for _ in range(warmup)]
    (sync or (lambda: None))()
    samples = []
    while len(samples) < iters:
        begin = time.perf_counter_ns()
        fn()
        (sync or (lambda: None))()
        samples.append((time.perf_counter_ns() - begin) / 1e9)
    return float(statistics.median(samples))
""",
    "task3_dominant_op": HEAD3
    + """    table = {row.key: (row.self_device_time_total, row.self_cpu_time_total) for row in prof.key_averages()}
    column = 0 if any(device for device, _ in table.values()) else 1
    return sorted(table, key=lambda name: table[name][column])[-1]
""",
}
# carol pastes the body of the course's own time_op (infra_lib.timing), renaming a variable
CAROL = {"task2_time_op": HEAD2 + inspect.getsource(time_op).split('"""')[2].lstrip("\n").replace("samples", "ts")}
DAVE = {
    "task3_dominant_op": HEAD3
    + """    averages = prof.key_averages()
    device_total = sum(a.self_device_time_total for a in averages)
    if device_total > 0:
        ranked = sorted(averages, key=lambda a: a.self_device_time_total, reverse=True)
    else:
        ranked = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)
    top = ranked[0]
    return str(top.key)
"""
}
ERIN = {  # dave's, renamed and reformatted, a comment added
    "task3_dominant_op": HEAD3
    + """    # rank every op by its self time
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
"""
}

CLASS = {
    "alice": ALICE,
    "bob": BOB,
    "carol": CAROL,
    "dave": DAVE,
    "erin": ERIN,
    "frank": {"task1_gemm_flops": "def gemm_flops(m, n, k):\n    return 2 * m * n * k\n"},
    "gina": {"task1_gemm_flops": "def gemm_flops(m, n, k):\n    return 2 * k * n * m  # the same count\n"},
}


@pytest.fixture(scope="module")
def matches(tmp_path_factory):
    folder = tmp_path_factory.mktemp("class")
    notebooks = {
        learner: write_learner_notebook(folder / learner / "lab01_gemm.ipynb", answers)
        for learner, answers in CLASS.items()
    }
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
    b = (
        "def g(values, scale=7):\n    '''Docstring.'''\n    # a comment\n    acc = 0\n    for v in values:\n"
        "        acc += v * scale\n\n    return acc\n"
    )
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(a.replace("x * k", "x + k"))
    assert grams(a) == grams(b)
    assert score(grams("def f(m, n):\n    return 2 * m * n\n"), grams("def g(a, b):\n    return 2 * a * b\n")) is None


@pytest.mark.parametrize(
    "source",
    ["def f(:\n", "(" * 5000 + ")" * 5000, "x = [" + "[" * 300 + "]" * 301 + "\n", "a = 1\n" * 100_000],
    ids=["syntax error", "parentheses", "nesting", "long"],
)
def test_a_hostile_answer_is_left_out_not_a_crash(source):
    assert tokens(source) is None


# --- lab 08: dressed copies of real answers --------------------------------------------------------------
#
# Alice and Frank answer lab 08's schedule honestly, each in a style of their own (both pass every check).
# Bob, Carol and Dave copy Alice's and dress it: renamed helper parameters, reordered helper definitions, a
# helper inlined into its caller. Erin pastes the course's Scheduler.schedule and make_room with names,
# comments and the reason strings changed. Measured on these answers with the earlier measure (names
# numbered across the whole cell): Bob 0.50, Carol 0.73, Bob's and Carol's dressing at once 0.49, Dave
# 0.12 against Alice; Erin 0.17 against the reference and 0.18 against the solution. With this one:
# Bob, Carol and both at once 1.00, Dave 0.86, Erin 0.93 and 0.82; the honest answers at most 0.61.

LAB08 = REPO / "labs" / "lab08_scheduler" / "lab08_scheduler.ipynb"
HEAD = answer_cells(REPO / "solutions" / "lab08_scheduler" / "lab08_scheduler.ipynb")["schedule"].split(
    "    ### BEGIN SOLUTION"
)[0]

ALICE = (
    HEAD
    + '''    budget = _serve_running(self, out, budget)
    if not out.preempted:
        _serve_waiting(self, out, budget)
    return finish_plan(self, out)


def _serve_running(sched, out, budget):
    """Oldest first; returns the budget left."""
    i = 0
    while i < len(sched.running) and budget > 0:
        seq = sched.running[i]
        want = min(seq.num_uncomputed_tokens, budget)
        if not _free_blocks_for(sched, seq, want, out):
            break
        sched.reserve(seq, want)
        out.add(seq, want)
        budget -= want
        i += 1
    return budget


def _free_blocks_for(sched, seq, want, out):
    """Preempt the newest running sequences until seq fits; False when seq itself had to go."""
    while not sched.can_reserve(seq, want):
        newest = sched.running[-1]
        sched.preempt(newest)
        out.preempted.append(newest.seq_id)
        if newest is seq:
            return False
    return True


def _serve_waiting(sched, out, budget):
    chunked = sched.config.enable_chunked_prefill
    while sched.waiting:
        if budget <= 0 or len(sched.running) >= sched.config.max_num_seqs:
            return
        head = sched.waiting[0]
        hit = sched.cached_tokens(head)
        todo = head.num_tokens - hit
        if todo > budget:
            if not chunked:
                return
            todo = budget
        if not sched.can_admit(head, todo):
            return
        sched.admit(head, todo)
        out.admitted.append(head.seq_id)
        out.num_cached_tokens[head.seq_id] = hit
        out.add(head, todo)
        budget -= todo
'''
)

# bob: alice's, the helpers' parameters (and their uses) renamed
_schedule, _sep, _helpers = ALICE.partition("\n\n\ndef _serve_running")
for _old, _new in (("sched", "s"), ("out", "plan"), ("budget", "left"), ("seq", "item"), ("want", "k")):
    _helpers = re.sub(rf"\b{_old}\b", _new, _helpers)
BOB = _schedule + _sep + _helpers


def _split(source):
    """The top-level function definitions after the answer's schedule, by name."""
    head, _, rest = source.partition("\n\n\ndef _")
    parts = ("def _" + rest).split("\n\n\n")
    return head, {p.split("(")[0][4:]: p for p in parts}


# carol: alice's, her helpers defined in another order
_head, _parts = _split(ALICE)
CAROL = (
    _head
    + "\n\n\n"
    + "\n\n\n".join(_parts[n].rstrip("\n") for n in ("_serve_waiting", "_free_blocks_for", "_serve_running"))
    + "\n"
)

# bob and carol at once: what the note describes
_head, _parts = _split(BOB)
BOB_CAROL = (
    _head
    + "\n\n\n"
    + "\n\n\n".join(_parts[n].rstrip("\n") for n in ("_serve_waiting", "_free_blocks_for", "_serve_running"))
    + "\n"
)

# dave: alice's, with _free_blocks_for inlined into _serve_running and _serve_waiting into schedule
DAVE = (
    HEAD
    + """    budget = _serve_running(self, out, budget)
    chunked = self.config.enable_chunked_prefill
    while self.waiting and not out.preempted:
        if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            break
        head = self.waiting[0]
        hit = self.cached_tokens(head)
        todo = head.num_tokens - hit
        if todo > budget:
            if not chunked:
                break
            todo = budget
        if not self.can_admit(head, todo):
            break
        self.admit(head, todo)
        out.admitted.append(head.seq_id)
        out.num_cached_tokens[head.seq_id] = hit
        out.add(head, todo)
        budget -= todo
    return finish_plan(self, out)


def _serve_running(sched, out, budget):
    i = 0
    while i < len(sched.running) and budget > 0:
        seq = sched.running[i]
        want = min(seq.num_uncomputed_tokens, budget)
        gone = False
        while not sched.can_reserve(seq, want):
            newest = sched.running[-1]
            sched.preempt(newest)
            out.preempted.append(newest.seq_id)
            if newest is seq:
                gone = True
                break
        if gone:
            break
        sched.reserve(seq, want)
        out.add(seq, want)
        budget -= want
        i += 1
    return budget
"""
)

# erin: the course's Scheduler.schedule and make_room pasted, renamed, comments and constants changed
ERIN = (
    HEAD
    + """    # walk the running queue first
    for s in list(self.running):
        if s.status is not SequenceStatus.RUNNING:
            break
        if budget == 0:
            out.reasons.append(f"no budget left for {s.seq_id}")
            break
        take = min(s.num_uncomputed_tokens, budget)
        if not _room(self, s, take, out):
            break
        self.reserve(s, take)
        out.add(s, take)
        budget -= take
    # then the queue of new requests
    while self.waiting and not out.preempted:
        s = self.waiting[0]
        if budget == 0 or len(self.running) >= self.config.max_num_seqs:
            out.reasons.append(f"{'no budget' if budget == 0 else 'seq limit'}: {s.seq_id} stays")
            break
        hit = self.cached_tokens(s)
        take = s.num_tokens - hit
        if take > budget and not self.config.enable_chunked_prefill:
            out.reasons.append(f"whole prompt {take} does not fit {budget}")
            break
        take = min(take, budget)
        if not self.can_admit(s, take):
            out.reasons.append(f"no blocks for {s.seq_id}")
            break
        self.admit(s, take)
        out.admitted.append(s.seq_id)
        out.num_cached_tokens[s.seq_id] = hit
        out.add(s, take)
        budget -= take
    if out.preempted and self.waiting:
        out.reasons.append("nobody admitted after a preemption")
    return finish_plan(self, out)


def _room(sched, s, take, out):
    # evict from the back until s fits
    while not sched.can_reserve(s, take):
        last = sched.running[-1]
        sched.preempt(last)
        out.preempted.append(last.seq_id)
        out.reasons.append(f"preempted {last.seq_id} for {s.seq_id}")
        if last is s:
            return False
    return True
"""
)

# frank: an honest answer of his own, in one function
FRANK = (
    HEAD
    + """    for seq in list(self.running):
        if budget == 0 or seq.status is not SequenceStatus.RUNNING:
            break
        k = min(budget, seq.num_uncomputed_tokens)
        gone = False
        while not gone and not self.can_reserve(seq, k):
            last = self.running.pop()
            self.running.append(last)
            self.preempt(last)
            out.preempted.append(last.seq_id)
            gone = last is seq
        if gone:
            break
        self.reserve(seq, k)
        out.add(seq, k)
        budget -= k
    queue = [] if out.preempted else list(self.waiting)
    for seq in queue:
        if not budget or len(self.running) == self.config.max_num_seqs:
            break
        hit = self.cached_tokens(seq)
        need = seq.num_tokens - hit
        if need > budget and not self.config.enable_chunked_prefill:
            break
        take = need if need <= budget else budget
        if not self.can_admit(seq, take):
            break
        self.admit(seq, take)
        out.admitted.append(seq.seq_id)
        out.num_cached_tokens[seq.seq_id] = hit
        out.add(seq, take)
        budget -= take
    return finish_plan(self, out)
"""
)

SCHEDULERS = {"alice": ALICE, "bob": BOB, "carol": CAROL, "dave": DAVE, "erin": ERIN, "frank": FRANK}
REFERENCE = "reference infra_lib.serving.scheduler.Scheduler.schedule"


@pytest.fixture(scope="module")
def lab08_matches(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lab08")
    notebooks = {
        learner: write_learner_notebook(folder / f"{learner}.ipynb", {"schedule": answer}, base=LAB08)
        for learner, answer in SCHEDULERS.items()
    }
    return class_matches(notebooks, "lab08_scheduler", REPO / "solutions")


def test_the_lab08_answers_are_real_answers():
    from grading import check
    from infra_lib.serving.scheduler_output import SchedulerOutput
    from infra_lib.serving.sequence import SequenceStatus

    for answer in (ALICE, DAVE, FRANK):
        namespace = {"SchedulerOutput": SchedulerOutput, "SequenceStatus": SequenceStatus}
        exec(answer, namespace)
        check("lab08.preemption", namespace["schedule"])


@pytest.mark.parametrize(
    "copier, dressing",
    [
        ("bob", "renamed helper parameters"),
        ("carol", "reordered helper definitions"),
        ("dave", "a helper inlined into its caller"),
    ],
)
def test_a_copy_is_flagged_however_it_is_dressed(lab08_matches, copier, dressing):
    found = {(m.learner, m.other): m for m in lab08_matches if m.answer == "schedule"}
    assert (copier, "alice") in found and ("alice", copier) in found, dressing
    match = found[(copier, "alice")]
    assert match.score >= 0.8 and match.pair == f"{copier}:schedule ~ alice:schedule", match


def test_renamed_and_reordered_at_once_is_still_the_same_answer():
    from grading.similarity import best_pair, fingerprint

    base = grams(HEAD + "    raise NotImplementedError\n")
    assert best_pair(fingerprint(BOB_CAROL, base, entries=True), fingerprint(ALICE, base, entries=True))[0] == 1.0


def test_a_pasted_reference_with_comments_and_constants_changed_is_flagged(lab08_matches):
    found = {m.other: m for m in lab08_matches if m.learner == "erin"}
    assert REFERENCE in found and found[REFERENCE].score >= 0.9, found
    assert found[REFERENCE].pair == "erin:schedule ~ reference:Scheduler.schedule"
    assert "the course's solution" in found


def test_two_honest_independent_answers_are_not_flagged(lab08_matches):
    for honest in ("alice", "frank"):
        others = {m.other for m in lab08_matches if m.learner == honest}
        assert others <= {"bob", "carol", "dave"}, (honest, others)  # only the copies of alice's
    assert not any("frank" in (m.learner, m.other) for m in lab08_matches)
    text = report(lab08_matches, "lab08_scheduler", len(SCHEDULERS))
    assert "| bob | schedule | alice |" in text and "bob:schedule ~ alice:schedule" in text


def test_a_helper_is_judged_with_the_function_that_calls_it():
    """Alice's preemption helper alone is the one obvious loop (0.93 of it stands in the reference's
    make_room); her answer as a whole, helpers included, is her own."""
    from grading.similarity import best_pair, fingerprint, reference_prints

    base = grams(HEAD + "    raise NotImplementedError\n")
    room = reference_prints("lab08_scheduler")["reference infra_lib.serving.scheduler.Scheduler.make_room"]
    assert best_pair(fingerprint(ALICE, base), room, base)[1] == "_free_blocks_for"
    whole = best_pair(fingerprint(ALICE, base, entries=True), room, base)
    assert whole[1] == "schedule" and whole[0] < 0.8


def test_an_expression_helper_called_in_an_assignment_is_the_code_it_replaced():
    """A one-expression helper defined after its caller and called in an assignment reads, once pasted
    back, as the line it replaced: lab 01's dominant_op split that way is the same answer."""
    from grading.similarity import best_pair, fingerprint

    inline = (
        "def dominant_op(prof):\n"
        "    rows = list(prof.key_averages())\n"
        "    on_device = any(row.self_device_time_total > 0 for row in rows)\n"
        "    if on_device:\n"
        "        return max(rows, key=lambda row: row.self_device_time_total).key\n"
        "    return max(rows, key=lambda row: row.self_cpu_time_total).key\n"
    )
    split = (
        "def dominant_op(prof):\n"
        "    entries = list(prof.key_averages())\n"
        "    on_gpu = _ran_on_device(entries)\n"
        "    if on_gpu:\n"
        "        return max(entries, key=lambda entry: entry.self_device_time_total).key\n"
        "    return max(entries, key=lambda entry: entry.self_cpu_time_total).key\n\n\n"
        "def _ran_on_device(entries):\n"
        "    return any(entry.self_device_time_total > 0 for entry in entries)\n"
    )
    found = best_pair(fingerprint(inline, entries=True), fingerprint(split, entries=True))
    assert found == (1.0, "dominant_op", "dominant_op")
