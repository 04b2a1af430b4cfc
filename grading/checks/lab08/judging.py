"""Lab 08's judgement of the learner's plans, step by step, by part: each part judges only the steps and the
part of a plan its behaviour decides, and names the idea a difference most likely comes from."""

from __future__ import annotations

from grading.checks.lab08.forced_steps import TASKS, drive_forced, schedule_reference, with_reference_steps
from grading.checks.lab08.plans import plan_text, workload_text
from grading.registry import Mismatch

HINT = {  # the idea a learner has most likely missed, by the kind of difference found
    "budget": "every planned sequence spends its tokens from one budget shared by the whole step, the running "
    "sequences and the admissions alike: what one takes, the next cannot, and the step's tokens never "
    "add up to more than max_num_batched_tokens.",
    "max_seqs": "admissions stop while max_num_seqs sequences are running: a step may plan at most that many "
    "sequences.",
    "running_order": "running sequences are planned oldest first (the order of the running queue), each before "
    "any admission.",
    "running_missing": "every running sequence is planned while the budget lasts, the oldest first; only once the "
    "budget is spent do the rest wait a step.",
    "running_tokens": "a running sequence computes what it has not computed yet, cut at the budget left: 1 token "
    "for a decode, the rest of its prompt (or a chunk of it) for one still in prefill.",
    "reserve": "a sequence goes into the plan only with blocks for the positions it computes in this step.",
    "fcfs": "admission is first come, first served: only the head of the waiting queue is ever considered, and "
    "the first sequence that cannot come in ends the step's admissions, even when one behind it would fit.",
    "admit_tokens": "a new sequence computes its tokens past its prefix-cache hit, cut at the budget left when "
    "chunked prefill is on.",
    "cut_first": "the blocks an admission asks for are those of the tokens it computes in this step: the prompt is "
    "cut to the budget left first, and only that chunk needs blocks now (the rest gets its blocks in "
    "later steps, as a running sequence).",
    "whole": "with chunked prefill off, a prompt is admitted whole or not at all: one larger than the budget left "
    "waits for a later step, and nobody behind it is admitted.",
    "held_back": {
        "budget exhausted": "once the budget is spent nobody more is admitted in this step.",
        "max_num_seqs": "admissions stop while max_num_seqs sequences are running.",
        "prefill of": "with chunked prefill off, a prompt larger than the budget left waits, whole.",
        "out of blocks": "a sequence whose blocks cannot be found waits, and so does everyone behind it.",
    },
    "victim": "when a running sequence cannot get its blocks, the victim is the newest running sequence (the most "
    "recently admitted), then the next newest, as many as needed, so that the oldest keep making "
    "progress.",
    "no_preemption": "preempt only when a running sequence cannot get the blocks for its next positions, and "
    "only as many sequences as that takes.",
    "missed_preemption": "when a running sequence cannot get the blocks for its next positions, blocks are freed by "
    "preempting running sequences, newest first; it is never skipped or planned without them.",
    "after_preemption": "a victim gets no tokens in this step, and once a sequence has preempted itself (it was the "
    "newest) no later running sequence is planned: they were all preempted before it.",
    "no_admission": "a step that preempted admits nobody: blocks were short a moment ago, and a waiting sequence "
    "never takes blocks from a running one.",
    "victim_front": "a victim goes back to the front of the waiting queue, ahead of everyone who never ran, so it "
    "is the next to come back.",
    "step_index": "each call plans one step and counts it once: the plan carries the index of the step it plans, "
    "and the scheduler's step count rises by one per call.",
    "cached_record": "every admission records its prefix-cache hit, the number found before admitting it, and 0 is "
    "recorded too: the record holds one entry per admitted sequence, no more, no fewer.",
}


def _entries(step: dict, ids) -> list:
    return [entry for entry in step.get("scheduled", []) if entry[0] in ids]


def _running_at_start(step: dict) -> set:
    return {seq_id for seq_id, _ in step["start"]["running"]}


def _start_text(step: dict) -> str:
    running = ", ".join(f"seq {i} ({n} to compute)" for i, n in step["start"]["running"]) or "none"
    head = step["start"]["head"]
    first = f"seq {head[0]} ({head[1]} tokens, {head[2]} cached)" if head else "none"
    return f"running at its start: {running}; first waiting: {first}"


def _step_detail(where: str, k: int, g: dict, e: dict, what: str = "") -> str:
    yours = plan_text(g) if "scheduled" in g else "(no plan)"
    extra = f"\n  {what}" if what else ""
    return (
        f"on {where}: at step {k} ({_start_text(e)})\n  expected: {plan_text(e)}\n  yours:    {yours}{extra}\n"
        "  (each step is planned from the reference's state, so earlier steps do not carry your differences)"
    )


def _limit(g: dict, *marks: str) -> str | None:
    for text in (g.get("limits"), g.get("books")):
        if text and any(mark in text for mark in marks):
            return text
    return None


def _part1(g: dict, e: dict) -> tuple[str, str, str] | None:
    """(what, extra detail, hint) for a difference part 1 owns at a step without preemption."""
    over = _limit(g, "tokens, budget")
    if over:
        return "the step plans more tokens than the budget", over, HINT["budget"]
    crowd = _limit(g, "distinct sequences", "max_num_seqs is")
    if crowd:
        return "the step plans more sequences than max_num_seqs", crowd, HINT["max_seqs"]
    running = _running_at_start(e)
    mine, want = _entries(g, running), _entries(e, running)
    if mine != want:
        if sorted(mine) == sorted(want):
            return "the running sequences are planned in another order", "", HINT["running_order"]
        if [m[0] for m in mine] == [w[0] for w in want]:
            return "a running sequence computes another number of tokens", "", HINT["running_tokens"]
        if len(mine) < len(want):
            return "a running sequence that should run this step waits", "", HINT["running_missing"]
        return "the running sequences' entries differ from the reference's", "", HINT["budget"]
    blocks = _limit(g, "holds", "blocks; its computed")
    if blocks:
        return "a planned sequence does not hold the blocks for the positions it computes", blocks, HINT["reserve"]
    return None


def _part2(g: dict, e: dict) -> tuple[str, str, str] | None:
    """(what, extra detail, hint) for a difference part 2 owns at a step part 1 agrees on."""
    whole = _limit(g, "split a prefill although chunked prefill is off")
    if whole:
        return "a prompt was cut into chunks although chunked prefill is off", whole, HINT["whole"]
    if g["admitted"] != e["admitted"]:
        head = e["start"]["head"]
        if len(g["admitted"]) > len(e["admitted"]) and g["admitted"][: len(e["admitted"])] == e["admitted"]:
            reason = next((r for r in e.get("reasons", []) if "waits" in r), "")
            first, held = g["admitted"][len(e["admitted"])], (e.get("waiting") or [None])[0]
            if held is not None and first != held:  # the head could not come in, and one behind it did
                return (
                    "a sequence was admitted ahead of one that arrived before it and could not come in",
                    f"seq {first} was admitted ahead of seq {held}, which the reference holds back"
                    + (f" ({reason})" if reason else ""),
                    HINT["fcfs"],
                )
            hint = next((h for mark, h in HINT["held_back"].items() if reason.startswith(mark)), HINT["fcfs"])
            return "a sequence was admitted that the reference holds back", reason, hint
        if g["admitted"] and (not e["admitted"] or g["admitted"][0] != e["admitted"][0]):
            return "a sequence was admitted out of arrival order", "", HINT["fcfs"]
        missing = e["admitted"][len(g["admitted"])] if len(e["admitted"]) > len(g["admitted"]) else None
        chunk = _entries(e, {missing}) if missing is not None else []
        if not g["admitted"] and chunk and head and head[0] == missing and chunk[0][1] < head[1] - head[2]:
            return "a prompt whose chunk fits was not admitted", "", HINT["cut_first"]
        return "admissions stopped earlier than the reference's", "", HINT["fcfs"]
    admitted = set(e["admitted"])
    if _entries(g, admitted) != _entries(e, admitted):
        return "an admitted sequence computes another number of tokens", "", HINT["admit_tokens"]
    if g["waiting"] != e["waiting"]:
        return "the waiting queue after the step differs", "", HINT["fcfs"]
    return None


def _part3(g: dict, e: dict) -> tuple[str, str, str] | None:
    """(what, extra detail, hint) for a difference part 3 owns at a step where blocks ran out."""
    mine, want = g.get("preempted", []), e["preempted"]
    if mine != want:
        if not mine:
            return "no sequence was preempted although blocks ran out", "", HINT["missed_preemption"]
        if not want:
            return "a sequence was preempted although its blocks could be found", "", HINT["no_preemption"]
        return "other sequences were preempted than the reference's", "", HINT["victim"]
    both = _limit(g, "and preempted it in the same step")
    if both:
        return "a preempted sequence is also planned in the same step", both, HINT["after_preemption"]
    if g["admitted"]:
        return "a step that preempted also admitted a sequence", "", HINT["no_admission"]
    if g["scheduled"] != e["scheduled"]:
        return "the plan after the preemption differs", "", HINT["after_preemption"]
    if g["waiting"] != e["waiting"]:
        return "the waiting queue after the preemption differs", "", HINT["victim_front"]
    return None


def _part5(g: dict, e: dict) -> tuple[str, str, str] | None:
    """(what, extra detail, hint) for a slip in the step's records."""
    if (g["step"], g["num_steps_after"]) != (e["step"], e["num_steps_after"]):
        return (
            "the step index is wrong",
            f"the plan says step {g['step']} and the scheduler counted "
            f"{g['num_steps_after']} steps after it; expected step {e['step']} and {e['num_steps_after']}",
            HINT["step_index"],
        )
    recorded = {seq_id: n for seq_id, n in g["num_cached_tokens"]}
    took = {seq_id: n for seq_id, n in g["hits"]}
    if recorded != took:
        missing = sorted(set(took) - set(recorded))
        if missing:
            return (
                "an admission's prefix-cache hit is not recorded",
                f"num_cached_tokens has no entry for seq {missing[0]} (its admission took {took[missing[0]]} "
                f"cached tokens); recorded {recorded}",
                HINT["cached_record"],
            )
        extra = sorted(set(recorded) - set(took))
        if extra:
            return (
                "num_cached_tokens records a sequence that was not admitted",
                f"seq {extra[0]} is recorded but not admitted in this step",
                HINT["cached_record"],
            )
        wrong = next(i for i in took if recorded[i] != took[i])
        return (
            "an admission's recorded prefix-cache hit is wrong",
            f"seq {wrong}: recorded {recorded[wrong]}, its admission took {took[wrong]} cached tokens",
            HINT["cached_record"],
        )
    return None


_PARTS = {1: _part1, 2: _part2, 3: _part3, 5: _part5}


def _judged(part: int, g: dict, e: dict) -> bool:
    """Whether a step is part ``part``'s to judge (see the table above)."""
    preempting = bool(g.get("preempted")) or bool(e["preempted"])
    if part == 1:
        return not preempting
    if part == 2:
        return not preempting and _part1(g, e) is None
    if part == 3:
        return preempting and not _limit(g, "tokens, budget")
    return True


def judge_for(part: int):
    """The comparison of one part: the first step it judges where the learner's plan differs."""

    def compare(got, expected, runs):
        if type(got) is not list or len(got) != len(expected):
            return Mismatch("the check recorded the wrong number of runs")
        seen = {"steps": 0, "hit": 0, "zero": 0}
        for run, g_run, e_run in zip(runs, got, expected):
            where = workload_text(run)
            if len(g_run["steps"]) != len(e_run["steps"]):
                return Mismatch("the check recorded the wrong number of steps")
            for k, (g, e) in enumerate(zip(g_run["steps"], e_run["steps"])):
                if not _judged(part, g, e) and not g["error"]:
                    continue
                if g["error"]:
                    return Mismatch(
                        f"your schedule raised {g['error'].split(':', 1)[0]} at step {k}",
                        _step_detail(where, k, g, e, f"it raised {g['error']}"),
                        hint="read the error: it names the line of your schedule that raised.",
                    )
                if (part == 2 and e["admitted"]) or (part == 3 and e["preempted"]):
                    seen["steps"] += 1
                if part == 5:
                    seen["hit"] += sum(1 for _, n in g["hits"] if n > 0)
                    seen["zero"] += sum(1 for _, n in g["hits"] if n == 0)
                problem = _PARTS[part](g, e)
                if problem:
                    what, extra, hint = problem
                    return Mismatch(what, _step_detail(where, k, g, e, extra), hint=hint)
        if part in (2, 3) and not seen["steps"]:
            return Mismatch(
                f"part {part} could not be judged: no step of its workloads left part 1's rules intact",
                "every step that " + ("admits" if part == 2 else "preempts") + " in the reference's "
                "run also breaks part 1's rules in yours",
                hint="fix part 1 first.",
            )
        if part == 5 and not (seen["hit"] and seen["zero"]):
            return Mismatch(
                "the records could not be judged: your scheduler admitted no sequence "
                + ("with a prefix-cache hit" if seen["zero"] else "at all"),
                "these workloads share prompt prefixes, so the reference admits sequences with hits and without",
                hint="fix part 2 (admission) first.",
            )
        return None

    return compare


def forced_parts(part: int, make) -> dict:
    """The fields of a simulated check of ``part`` whose runs ``make`` draws."""
    return dict(
        task=TASKS[1],
        reference=schedule_reference,
        make_inputs=with_reference_steps(make),
        drive=drive_forced,
        compare=judge_for(part),
    )
