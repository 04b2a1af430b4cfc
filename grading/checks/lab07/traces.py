"""Lab 07's comparison of the traces of a replayed script, step by step, and the fields its step-by-step
checks share."""

from __future__ import annotations

from grading.checks.lab07.pool_replay import POOL, TASKS, is_id
from grading.checks.lab07.stand_ins import METHOD_TASK, drive_replays_for, with_decisions
from grading.registry import Mismatch

# --- comparing traces -----------------------------------------------------------------------------


def _state_change(before: dict, after: dict) -> str:
    for block, (old, new) in enumerate(zip(before["counts"], after["counts"])):
        if old != new:
            return f"block {block}'s reference count went from {old} to {new}"
    return f"num_free went from {before['num_free']} to {after['num_free']}"


def _broken_invariant(step: dict) -> str | None:
    counts = step["counts"]
    if any(not is_id(c) for c in counts) or not is_id(step["num_free"]):
        return f"ref_count and num_free must return ints (num_free={step['num_free']}, counts={counts})"
    negative = [b for b, c in enumerate(counts) if c < 0]
    if negative:
        return f"block {negative[0]} has a negative reference count ({counts[negative[0]]})"
    zero = sum(1 for c in counts if c == 0)
    if step["num_free"] != zero:
        return f"num_free is {step['num_free']} but {zero} blocks have reference count 0 (counts {counts})"
    return None


# What a learner most likely missed, by the kind of difference found (and the method it was found in).
MISSED = {
    "atomic": "a call that raises must leave the pool exactly as it was: every reason to refuse it (an id outside the "
    "pool, a free block, more releases of a block than it has holders, too few free blocks) is found before "
    "any count or the free queue changes.",
    "refuse": {
        "allocate": "allocate serves a request in full or not at all: more blocks than are free is OutOfBlocks, and a "
        "count that is negative or not an int (a float such as 2.0, or a bool) is a ValueError.",
        "ref_count": "an id outside 0 .. num_blocks - 1 is no block of the pool, a ValueError, and a negative one "
        "included: it must not count from the end of the list of counts.",
        "free": "free refuses a double free: within one call a block may be released at most as many times as "
        "tables hold it, so a block listed twice that only one table holds is refused, and so is a free block "
        "or an id outside the pool.",
        "fork": "only blocks some table holds can be shared: a free block, or an id outside the pool, anywhere in the "
        "list refuses the whole fork.",
        "prepare_write": "a table can only write blocks it holds, so writing a free block or an id outside the pool "
        "(a negative one included) is refused; and a copy needs a free block, so when none is left "
        "the call is refused with OutOfBlocks.",
        "": "this method must refuse this call: see the table of errors in the lab's text.",
    },
    "accept": {
        "allocate": "a request for no blocks, or for exactly as many as are free, is valid.",
        "free": "a block held by several tables may be released once per holder, even several times in one call; "
        "only releases beyond its count are a double free.",
        "fork": "any block some table holds can be shared again, however many tables already hold it, and a list may "
        "name a block twice.",
        "prepare_write": "writing a block the caller holds is always allowed: a block held by one table is written "
        "in place, a shared one is copied first.",
        "": "this call is valid: compare it with the table of errors in the lab's text.",
    },
    "exception": "the pool raises two kinds of error: OutOfBlocks when there are too few free blocks, and ValueError "
    "for a wrong argument (a negative count, an id outside the pool, a double free, sharing or writing "
    "a free block).",
    "out_of_blocks": "OutOfBlocks carries three numbers: how many blocks the call needed, how many were free at the "
    "moment it was refused, and the pool's size.",
    "same_list": "the table that fork returns changes independently of the one it was given (copy-on-write "
    "replaces entries in one of them), so it must be a list of its own, not the same object.",
    "order": "blocks are handed out from the front of the free queue and join its back when their count reaches 0, "
    "one at a time in the order the call releases them, so the block freed longest ago is reused first.",
    "result": {
        "allocate": "allocate returns the blocks it took, in the order taken, as a list.",
        "can_allocate": "can_allocate answers whether allocate would succeed for that count now.",
        "fork": "fork returns the same ids it was given, in the same order.",
        "prepare_write": "prepare_write returns the block to write and the block it was copied from: the block itself "
        "and None when the caller holds it alone, else a new block and the shared one.",
        "": "compare what this call returned with the lab's table of methods.",
    },
    "books": "num_free and the reference counts are two views of one set of books: num_free is always exactly the "
    "number of blocks whose count is 0, and no count is ever negative.",
    "counts": {
        "allocate": "each block allocate hands out is then held by one table: count 1.",
        "free": "free takes one holder from each listed block (twice for a block listed twice), never more.",
        "fork": "fork adds one holder to each listed block (twice for a block listed twice), and copies nothing.",
        "prepare_write": "a copy moves the writer's hold from the shared block to the new one: the shared block loses "
        "one holder (the others keep it), the new block has one; a block held alone is untouched.",
        "": "each call changes the counts of exactly the blocks it names.",
    },
}


def _missed(kind: str, method: str) -> str:
    entry = MISSED[kind]
    return entry.get(method, entry[""]) if isinstance(entry, dict) else entry


def _other_blocks_alike(method: str, got: str, expected: str) -> bool:
    """Whether two results differ only in which free blocks were handed out: the same number of blocks
    from allocate, or a copy from prepare_write of the same shared block."""
    if method == "allocate":
        return got.startswith("[") and expected.startswith("[") and got.count(",") == expected.count(",")
    if method == "prepare_write":
        return (
            got.startswith("(")
            and expected.startswith("(")
            and not expected.endswith("None)")
            and got.split(",")[-1] == expected.split(",")[-1]
        )
    return False


def _step_difference(g: dict, e: dict, g_before: dict) -> tuple[str, str, str] | None:
    """(what, detail, hint) for the first way one step differs, else None; the hint is chosen by the
    kind of difference and the method it was found in."""
    method = e["call"].split("(")[0]
    expected_error = f"{e['error']} ({e['message']})" if e["error"] else None
    if g["call"] != e["call"]:
        return (
            "the check's operations went differently on your pool",
            f"the check called {g['call']} on your pool but {e['call']} on the reference",
            _missed("result", method),
        )
    if e["error"] and not g["error"]:
        return (
            f"{method} did not raise where the reference pool raises",
            f"expected {expected_error}, but it returned {g['result']}",
            _missed("refuse", method),
        )
    if g["error"] and not e["error"]:
        return (
            f"{method} raised where the reference pool does not",
            f"it raised {g['error']}: {g['message']}; expected it to return {e['result']}",
            _missed("accept", method),
        )
    if g["error"] != e["error"]:
        return (
            f"{method} raised the wrong exception",
            f"expected {expected_error}, got {g['error']}: {g['message']}",
            _missed("exception", method),
        )
    if e["error"] and (g["counts"], g["num_free"]) != (g_before["counts"], g_before["num_free"]):
        return (
            f"{method} raised but changed the pool first (a call that raises must change nothing)",
            f"it raised {g['error']} as expected, but {_state_change(g_before, g)}",
            _missed("atomic", method),
        )
    if e["out_of_blocks"] is not None and g["out_of_blocks"] != e["out_of_blocks"]:
        return (
            "OutOfBlocks carries the wrong numbers",
            "expected OutOfBlocks(requested={}, free={}, total={}), got OutOfBlocks(requested={}, free={}, "
            "total={})".format(*e["out_of_blocks"], *g["out_of_blocks"]),
            _missed("out_of_blocks", method),
        )
    if g["result"] != e["result"]:
        if g["result"] == "the very list it was given":
            return (
                "fork returned the list it was given instead of a new one",
                f"expected a new list {e['result']}, got the caller's own list object",
                _missed("same_list", method),
            )
        if _other_blocks_alike(method, g["result"], e["result"]):
            return (
                f"{method} handed out other blocks than the reference pool",
                f"expected {e['result']}, got {g['result']}; with the same counts your pool took other free "
                "blocks, so its free queue is in another order",
                _missed("order", method),
            )
        return (
            f"{method} returned something different from the reference pool",
            f"expected {e['result']}, got {g['result']}",
            _missed("result", method),
        )
    broken = _broken_invariant(g)
    if broken:
        return "the pool's books disagree with each other", f"afterwards {broken}", _missed("books", method)
    if g["counts"] != e["counts"]:
        block = next(b for b, (x, y) in enumerate(zip(g["counts"], e["counts"])) if x != y)
        return (
            "reference counts differ from the reference pool's",
            f"afterwards block {block} has reference count {g['counts'][block]}, expected {e['counts'][block]} "
            f"(all counts: expected {e['counts']}, got {g['counts']})",
            _missed("counts", method),
        )
    if g["num_free"] != e["num_free"]:
        return (
            "num_free differs from the reference pool's",
            f"expected {e['num_free']}, got {g['num_free']}",
            _missed("books", method),
        )
    return None


def _history(steps: list[dict], upto: int, shown: int = 8) -> str:
    def one(step):
        outcome = step["error"] if step["error"] else step["result"]
        return f"{step['call']} -> {outcome}"

    first = max(0, upto - shown)
    earlier = "; ".join(one(s) for s in steps[first:upto])
    if not earlier:
        return "it was the first call on a new pool"
    which = f"the last {upto - first} of the {upto} calls" if first else "the calls"
    return f"{which} before it, as the reference pool answered them: {earlier}"


def compare_replays_for(task: int):
    def compare(got, expected, sessions):
        if (
            type(got) is not dict
            or type(got.get("traces")) is not list
            or len(got["traces"]) != len(expected["traces"])
        ):
            return Mismatch("the check recorded the wrong number of pools")
        for session, g_steps, e_steps in zip(sessions, got["traces"], expected["traces"]):
            n = session["num_blocks"]
            before = {"counts": [0] * n, "num_free": n}
            for k, (g, e) in enumerate(zip(g_steps, e_steps)):
                problem = _step_difference(g, e, before)
                if problem:
                    what, detail, hint = problem
                    detail = (
                        f"on BlockPool({n}, {session['block_size']}), call {k + 1}: {e['call']}: {detail}\n"
                        f"  {_history(e_steps, k)}"
                    )
                    owner = METHOD_TASK.get(e["call"].split("(")[0], task)
                    own = [name for name in (g.get("own") or []) if name in METHOD_TASK]
                    if own:
                        # The learner's books had left the reference's, or its method called another task's in
                        # a way the reference does not: the stand-ins handed those calls to its own methods.
                        named = " and ".join(f"{name} (task {METHOD_TASK[name]})" for name in own)
                        what = f"{what}; your pool's own {named} ran in this call"
                        hint = (
                            f"this check of task {task} puts the course's stand-ins in place of other tasks' "
                            f"methods, but in this call your pool's own {named} ran instead (a call the reference "
                            f"pool never makes from these books), so a mistake there shows here too: get those "
                            f"tasks' checks to pass first. {hint[:1].upper()}{hint[1:]}"
                        )
                    elif owner != task and not got["isolated"]:
                        # Only when the pool keeps other books: the stand-ins could not work on them.
                        what = f"in your {e['call'].split('(')[0]} (task {owner}): {what}"
                        hint = (
                            f"this check of task {task} used your task {owner} method too, because your pool keeps "
                            "its books differently from the lab's __init__ (the checks put their stand-ins in "
                            "place of other tasks' methods only on those books); fix task "
                            f"{owner} first. {hint[:1].upper()}{hint[1:]}"
                        )
                    return Mismatch(what, detail, hint=hint)
                before = g
            if len(g_steps) != len(e_steps):
                return Mismatch(
                    "the check's operations went differently on your pool",
                    f"on BlockPool({n}, {session['block_size']}): {len(g_steps)} calls instead of {len(e_steps)}",
                )
        return None

    return compare


def replay_parts(task: int, make) -> dict:
    """The fields of a step-by-step check of ``task`` whose scripts ``make`` draws."""
    return dict(
        task=TASKS[task],
        reference=POOL,
        make_inputs=with_decisions(make, task),
        drive=drive_replays_for(task),
        compare=compare_replays_for(task),
    )
