"""Checks for lab 07 (the block pool): seeded sequences of allocate / free / fork / prepare_write
calls replayed on the learner's pool and on the reference, compared step by step (what each call
returned or raised, the free count and every block's reference count); then the learner's pool
behind a paged KV cache, serving a small random model and SmolLM2 with forked sequences."""

from __future__ import annotations

import os
import random

from grading.checks.common import array_mismatch, reference, token_difference
from grading.checks.model_cases import case_model, case_prompts, smollm2_case, tiny_prompts
from grading.registry import Check, Mismatch, register, register_shortcuts

# The reference pool: an answer importing it is not run, and a call into any of its methods
# while a check drives the learner's pool is a shortcut. `_new_pool` also refuses a pool built on it.
register_shortcuts("lab07", ["infra_lib.serving.block_pool:BlockPool"])

_POOL = reference("infra_lib.serving.block_pool", "BlockPool")


def _new_pool(pool_class, num_blocks: int, block_size: int):
    """The pool a check drives. One that is, extends or wraps the course's BlockPool is refused
    (except the reference itself, driven for the expected data outside the grader's kernel)."""
    from grading.check import RECORD_ENV
    from infra_lib.serving.block_pool import BlockPool

    pool = pool_class(num_blocks, block_size)
    if pool_class is BlockPool and not os.environ.get(RECORD_ENV):
        return pool
    if any(isinstance(held, BlockPool) for held in [pool, *getattr(pool, "__dict__", {}).values()]):
        raise RuntimeError("your BlockPool is built on the course's reference pool "
                           "(infra_lib.serving.block_pool.BlockPool): keep the books yourself")
    return pool


# --- replaying operations -------------------------------------------------------------------------
#
# An operation names what to do, not the block ids: ids come from what the pool under test
# returned earlier ("free the second live table"), so the learner's pool and the reference each
# run the same script on their own state, and their traces agree step by step when they behave
# alike. Each op is a list: [kind, *arguments]; `pick` chooses among candidates modulo their count.

def _is_id(value) -> bool:
    return type(value) is int


def _shown(value, method: str) -> str:
    """A call's result as text: "[3, 1]", "(4, None)", "True", or the type it had."""
    if value is None or type(value) is bool:
        return repr(value)
    if type(value) in (list, tuple) and all(_is_id(v) or v is None for v in value):
        if method == "prepare_write" and len(value) == 2:
            return repr(tuple(value))
        return repr(list(value) if type(value) is list else tuple(value))
    return f"a {type(value).__name__}"


def _plain_number(value):
    return value if _is_id(value) else f"a {type(value).__name__}"


class _Replay:
    """Runs abstract operations on one pool and records what every call did."""

    def __init__(self, pool, num_blocks: int, books: bool = False):
        self.pool, self.num_blocks = pool, num_blocks
        # With the lab's books and the stand-ins in place, the state after each call is read from the books
        # themselves: another task's num_free and ref_count are not the learner's to answer in this check.
        self.books = books
        self.own_calls = getattr(type(pool), OWN_CALLS, None)  # the learner's methods a stand-in handed calls to
        self.tables: list[list[int]] = []  # the block tables of the live sequences
        self.counts = [0] * num_blocks  # reference counts seen after the last call
        self.num_free = num_blocks
        self.steps: list[dict] = []

    # -- one call, recorded --

    def call(self, method: str, *args):
        """Call ``pool.method(*args)``; record its result or exception, then the pool's state."""
        text = f"{method}({', '.join(map(repr, args))})"
        result, error = None, None
        try:
            result = getattr(self.pool, method)(*args)
        except (NotImplementedError, MemoryError):
            raise  # an unwritten stub names its task; memory is the grader's business
        except Exception as exc:  # the contract's errors, and the learner's bugs, are recorded
            error = exc
        if self.books:
            num_free, counts = len(self.pool.free_queue), list(self.pool.ref_counts)
        else:
            num_free = self.pool.num_free
            counts = [self.pool.ref_count(b) for b in range(self.num_blocks)]
        step = {"call": text, "result": None, "error": None, "out_of_blocks": None, "message": None,
                "num_free": _plain_number(num_free), "counts": [_plain_number(c) for c in counts]}
        if self.own_calls:
            step["own"] = sorted(set(self.own_calls))
            self.own_calls.clear()
        if error is None:
            step["result"] = _shown(result, method)
            if method == "fork" and result is args[0]:
                step["result"] = "the very list it was given"
        else:
            step["error"], step["message"] = type(error).__name__, str(error)[:200]
            if step["error"] == "OutOfBlocks":
                step["out_of_blocks"] = [_plain_number(getattr(error, name, None))
                                         for name in ("requested", "free", "total")]
        self.steps.append(step)
        self.num_free = num_free if _is_id(num_free) else 0
        self.counts = [c if _is_id(c) else 0 for c in counts]
        if error is None and step["result"].startswith(("[", "(")):
            ids = list(result)
            if method == "prepare_write":  # (block to write, block copied from or None)
                return ids if len(ids) == 2 and self._is_block(ids[0]) and (ids[1] is None or self._is_block(ids[1])) \
                    else None
            return ids if all(self._is_block(b) for b in ids) else None
        return None

    def _is_block(self, value) -> bool:
        return _is_id(value) and 0 <= value < self.num_blocks

    # -- what the script can ask for --

    def _free_blocks(self) -> list[int]:
        return [b for b, c in enumerate(self.counts) if c == 0]

    def _table(self, pick: int) -> list[int]:
        return self.tables[pick % len(self.tables)] if self.tables else []

    def allocate(self, n: int):
        got = self.call("allocate", n)
        if got is not None:
            self.tables.append(got)

    def allocate_free(self, delta: int):
        """allocate(num_free + delta): everything that is free, or more (OutOfBlocks)."""
        self.allocate(self.num_free + delta)

    def can_allocate(self, n: int):
        self.call("can_allocate", n)

    def ref_count_unknown(self, negative: bool):
        """The count of an id that is no block of this pool (a negative one must not count from the end)."""
        self.call("ref_count", -1 if negative else self.num_blocks)

    def can_allocate_free(self, delta: int):
        self.call("can_allocate", max(0, self.num_free + delta))

    def free(self, pick: int, reverse: bool):
        """Release a live table (tail first when ``reverse``, as a finished sequence does)."""
        if self.tables:
            table = self.tables.pop(pick % len(self.tables))
            self.call("free", table[::-1] if reverse else list(table))

    def free_bad(self, pick: int):
        """A live table's blocks and then one free block: a double free, raised before any change."""
        free = self._free_blocks()
        if free:
            self.call("free", self._table(pick) + [free[pick % len(free)]])

    def free_twice(self, pick: int):
        """A block held once, freed twice in one call."""
        held_once = [b for table in self.tables for b in table if self.counts[b] == 1]
        if held_once:
            block = held_once[pick % len(held_once)]
            self.call("free", [block, block])

    def free_unknown(self, pick: int, negative: bool):
        """A live table's blocks and an id that is no block of this pool."""
        self.call("free", self._table(pick) + [-1 if negative else self.num_blocks])

    def fork(self, pick: int):
        if self.tables:
            got = self.call("fork", self._table(pick))
            if got is not None:
                self.tables.append(got)

    def fork_twice(self, pick: int):
        """A held block listed twice in one fork: it gains two holders."""
        held = [b for table in self.tables for b in table]
        if held:
            block = held[pick % len(held)]
            got = self.call("fork", [block, block])
            if got is not None:
                self.tables.append(got)

    def fork_unknown(self, pick: int, negative: bool):
        """A live table's blocks and an id that is no block of this pool."""
        self.call("fork", self._table(pick) + [-1 if negative else self.num_blocks])

    def fork_bad(self, pick: int):
        """A live table's blocks and one free block: nothing may be shared."""
        free = self._free_blocks()
        if free:
            self.call("fork", self._table(pick) + [free[pick % len(free)]])

    def _write(self, table: list[int], index: int):
        got = self.call("prepare_write", table[index])
        if got is not None and len(got) == 2 and got[1] is not None and _is_id(got[0]):
            table[index] = got[0]  # the sequence now writes its private copy

    def write(self, pick: int, position: int):
        tables = [t for t in self.tables if t]
        if tables:
            table = tables[pick % len(tables)]
            self._write(table, position % len(table))

    def write_shared(self, pick: int):
        """prepare_write on a block some other table also holds: copy-on-write."""
        shared = [(t, i) for t in self.tables for i, b in enumerate(t) if self.counts[b] > 1]
        if shared:
            self._write(*shared[pick % len(shared)])

    def write_unknown(self, negative: bool):
        self.call("prepare_write", -1 if negative else self.num_blocks)

    def write_free(self, pick: int):
        free = self._free_blocks()
        if free:
            self.call("prepare_write", free[pick % len(free)])


# --- one task at a time ------------------------------------------------------------------------------
#
# A task's checks call the learner's methods for that task and stand-ins for the other tasks' methods, so that
# a slip in one method never costs another task's points. The stand-ins solve no task. Where the inputs are
# made (in the grader's process when the kernel is sandboxed, where the reference is a stub), the reference
# pool runs the check's own calls, and each call of another task's method is recorded with the books it met
# (every block's count and the number free) and what the reference decided: the value it returned, the error
# it raised, or how its books changed (the counts of the blocks it was given, how many blocks it took from the
# front of the free queue and their counts, which blocks joined its back). In the kernel a stand-in looks its call up by the learner's books and carries
# that decision out on them: taken blocks come from the front of the learner's own free queue, so an order the
# learner's method left there shows as other blocks handed out. A call the reference never met in those books
# (the learner's books already differ, or its method calls another task's in a way the reference does not)
# goes to the learner's own method, and a failure it causes names that method and its task. The stand-ins work
# on the books the lab's __init__ starts (`ref_counts`, a list, and `free_queue`, a deque); a pool that keeps
# them some other way is driven with all its own methods, and a failure inside another task's method then names
# that method and its task.

_METHOD_TASK = {"num_free": 1, "ref_count": 1, "can_allocate": 1, "allocate": 1, "free": 2, "fork": 3,
                "prepare_write": 4}
_BOOKS = {"num_blocks", "block_size", "ref_counts", "free_queue"}
_ANSWERS = ("ref_count", "can_allocate")  # the methods whose decision is the value they return
OWN_CALLS = "_course_stand_ins_passed_on"  # on an isolated class: the learner's methods a stand-in called


def _decision_key(method: str, args: tuple, counts, num_free) -> tuple:
    return method, repr(args), tuple(counts), num_free


def _recording_pool(decisions: dict, task: int):
    """The reference pool, recording the decision of every call of a method that is not ``task``'s."""
    from infra_lib.serving.block_pool import BlockPool

    def recorded(method: str):
        base = getattr(BlockPool, method)

        def call(self, *args):
            counts, free = list(self._ref_counts), self.free_block_ids()
            key = _decision_key(method, args, counts, len(free))
            try:
                result = base(self, *args)
            except Exception as error:
                numbers = [getattr(error, name, None) for name in ("requested", "free", "total")]
                decisions.setdefault(key, ["raise", type(error).__name__, str(error), numbers])
                raise
            if method in _ANSWERS:
                decisions.setdefault(key, ["return", result])
            else:  # the change to the books: counts, the blocks taken from the queue's front, those joining its back
                after, now = self.free_block_ids(), self._ref_counts
                taken = [b for b in free if b not in set(after)]
                changes = [[b, now[b] - counts[b]] for b in range(len(now)) if now[b] != counts[b] and b not in taken]
                decisions.setdefault(key, ["books", changes, [now[b] for b in taken],
                                           [b for b in after if b not in set(free)]])
            return result

        return call

    return type("RecordedBlockPool", (BlockPool,),
                {m: recorded(m) for m in ("allocate", "free", "fork", "prepare_write", *_ANSWERS)
                 if _METHOD_TASK[m] != task})


def _carry_out(pool, method: str, args: tuple, decision: list):
    """The reference's decision for this call, carried out on the learner's books."""
    from infra_lib.serving.errors import OutOfBlocks

    kind, *detail = decision
    if kind == "raise":
        name, message, numbers = detail
        raise OutOfBlocks(*numbers) if name == "OutOfBlocks" else {"ValueError": ValueError}.get(name, RuntimeError)(
            message)
    if kind == "return":
        return detail[0]
    changes, taken, joined = detail
    handed = [pool.free_queue.popleft() for _ in taken]  # the learner's own front: its order shows here
    for block_id, count in zip(handed, taken):
        pool.ref_counts[block_id] = count
    for block_id, change in changes:
        pool.ref_counts[block_id] += change
    pool.free_queue.extend(joined)
    if method == "allocate":
        return handed
    if method == "prepare_write":
        return (handed[0], args[0]) if handed else (args[0], None)
    return list(args[0]) if method == "fork" else None


def _stand_in(method: str, decisions: dict, passed_on: list):
    def call(self, *args):
        try:
            decision = decisions.get(_decision_key(method, args, self.ref_counts, len(self.free_queue)))
        except TypeError:  # books the learner's own methods filled with something unhashable
            decision = None
        if decision is not None:
            return _carry_out(self, method, args, decision)
        passed_on.append(method)
        try:
            return getattr(super(type(self), self), method)(*args)
        except NotImplementedError as exc:
            raise RuntimeError(f"the pool's books left the reference's before this {method} call, so the check "
                               f"needs your own {method} (task {_METHOD_TASK[method]}), which is not written yet: "
                               f"{exc}") from None

    call.__name__ = method
    return call


def _keeps_the_starting_books(pool) -> bool:
    """Whether a new pool keeps exactly the books the lab's ``__init__`` sets up (so that the stand-ins for
    the other tasks' methods can work on them)."""
    from collections import deque

    books = getattr(pool, "__dict__", None)
    return (type(books) is dict and set(books) == _BOOKS and type(books["ref_counts"]) is list
            and type(books["free_queue"]) is deque and books["ref_counts"] == [0] * pool.num_blocks
            and list(books["free_queue"]) == list(range(pool.num_blocks)))


def pool_for_task(pool_class, task: int, decisions=()):
    """``(class, isolated)``: the learner's class with the other tasks' methods replaced by stand-ins that carry
    out the reference's recorded ``decisions`` ([key, decision] pairs), when its books allow it (``isolated``
    True); else the learner's class itself."""
    if not isinstance(pool_class, type):
        return pool_class, False
    try:
        probe = pool_class(3, 4)
    except (NotImplementedError, MemoryError):
        raise
    except Exception:
        return pool_class, False  # the check's own construction reports it
    if not _keeps_the_starting_books(probe):
        return pool_class, False
    table, passed_on = {tuple(key): decision for key, decision in decisions}, []
    others = {name: _stand_in(name, table, passed_on) for name in _METHOD_TASK
              if _METHOD_TASK[name] != task and name != "num_free"}
    if task != 1:
        others["num_free"] = property(lambda self: len(self.free_queue))  # the books' own count
    return type(pool_class.__name__, (pool_class,), {**others, OWN_CALLS: passed_on,
                                                     "__module__": pool_class.__module__}), True


def _with_decisions(make, task: int):
    """``make``'s sessions, each with the reference's decisions for the other tasks' methods (``"decisions"``)."""

    def make_inputs(rng: random.Random) -> list[dict]:
        sessions = make(rng)
        for session in sessions:
            decisions: dict = {}
            replay = _Replay(_recording_pool(decisions, task)(session["num_blocks"], session["block_size"]),
                             session["num_blocks"])
            for kind, *args in session["ops"]:
                getattr(replay, kind)(*args)
            session["decisions"] = [[list(key), decision] for key, decision in decisions.items()]
        return sessions

    return make_inputs


def _drive_replays_for(task: int):
    def drive(pool_class, sessions):
        from infra_lib.serving.block_pool import BlockPool

        isolated, traces = False, []
        for session in sessions:
            cls = pool_class
            if pool_class is not BlockPool:
                cls, isolated = pool_for_task(pool_class, task, session.get("decisions", ()))
            replay = _Replay(_new_pool(cls, session["num_blocks"], session["block_size"]), session["num_blocks"],
                             books=isolated and task != 1)
            for kind, *args in session["ops"]:
                getattr(replay, kind)(*args)
            traces.append(replay.steps)
        return {"isolated": isolated, "traces": traces}

    return drive


# --- comparing traces -----------------------------------------------------------------------------

def _state_change(before: dict, after: dict) -> str:
    for block, (old, new) in enumerate(zip(before["counts"], after["counts"])):
        if old != new:
            return f"block {block}'s reference count went from {old} to {new}"
    return f"num_free went from {before['num_free']} to {after['num_free']}"


def _broken_invariant(step: dict) -> str | None:
    counts = step["counts"]
    if any(not _is_id(c) for c in counts) or not _is_id(step["num_free"]):
        return f"ref_count and num_free must return ints (num_free={step['num_free']}, counts={counts})"
    negative = [b for b, c in enumerate(counts) if c < 0]
    if negative:
        return f"block {negative[0]} has a negative reference count ({counts[negative[0]]})"
    zero = sum(1 for c in counts if c == 0)
    if step["num_free"] != zero:
        return f"num_free is {step['num_free']} but {zero} blocks have reference count 0 (counts {counts})"
    return None


# What a learner most likely missed, by the kind of difference found (and the method it was found in).
_MISSED = {
    "atomic":
        "a call that raises must leave the pool exactly as it was: every reason to refuse it (an id outside the "
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
    entry = _MISSED[kind]
    return entry.get(method, entry[""]) if isinstance(entry, dict) else entry


def _other_blocks_alike(method: str, got: str, expected: str) -> bool:
    """Whether two results differ only in which free blocks were handed out: the same number of blocks
    from allocate, or a copy from prepare_write of the same shared block."""
    if method == "allocate":
        return got.startswith("[") and expected.startswith("[") and got.count(",") == expected.count(",")
    if method == "prepare_write":
        return (got.startswith("(") and expected.startswith("(") and not expected.endswith("None)")
                and got.split(",")[-1] == expected.split(",")[-1])
    return False


def _step_difference(g: dict, e: dict, g_before: dict) -> tuple[str, str, str] | None:
    """(what, detail, hint) for the first way one step differs, else None; the hint is chosen by the
    kind of difference and the method it was found in."""
    method = e["call"].split("(")[0]
    expected_error = f"{e['error']} ({e['message']})" if e["error"] else None
    if g["call"] != e["call"]:
        return ("the check's operations went differently on your pool",
                f"the check called {g['call']} on your pool but {e['call']} on the reference",
                _missed("result", method))
    if e["error"] and not g["error"]:
        return (f"{method} did not raise where the reference pool raises",
                f"expected {expected_error}, but it returned {g['result']}", _missed("refuse", method))
    if g["error"] and not e["error"]:
        return (f"{method} raised where the reference pool does not",
                f"it raised {g['error']}: {g['message']}; expected it to return {e['result']}",
                _missed("accept", method))
    if g["error"] != e["error"]:
        return (f"{method} raised the wrong exception", f"expected {expected_error}, got {g['error']}: {g['message']}",
                _missed("exception", method))
    if e["error"] and (g["counts"], g["num_free"]) != (g_before["counts"], g_before["num_free"]):
        return (f"{method} raised but changed the pool first (a call that raises must change nothing)",
                f"it raised {g['error']} as expected, but {_state_change(g_before, g)}", _missed("atomic", method))
    if e["out_of_blocks"] is not None and g["out_of_blocks"] != e["out_of_blocks"]:
        return ("OutOfBlocks carries the wrong numbers",
                "expected OutOfBlocks(requested={}, free={}, total={}), got OutOfBlocks(requested={}, free={}, "
                "total={})".format(*e["out_of_blocks"], *g["out_of_blocks"]), _missed("out_of_blocks", method))
    if g["result"] != e["result"]:
        if g["result"] == "the very list it was given":
            return ("fork returned the list it was given instead of a new one",
                    f"expected a new list {e['result']}, got the caller's own list object", _missed("same_list", method))
        if _other_blocks_alike(method, g["result"], e["result"]):
            return (f"{method} handed out other blocks than the reference pool",
                    f"expected {e['result']}, got {g['result']}; with the same counts your pool took other free "
                    "blocks, so its free queue is in another order", _missed("order", method))
        return (f"{method} returned something different from the reference pool",
                f"expected {e['result']}, got {g['result']}", _missed("result", method))
    broken = _broken_invariant(g)
    if broken:
        return "the pool's books disagree with each other", f"afterwards {broken}", _missed("books", method)
    if g["counts"] != e["counts"]:
        block = next(b for b, (x, y) in enumerate(zip(g["counts"], e["counts"])) if x != y)
        return ("reference counts differ from the reference pool's",
                f"afterwards block {block} has reference count {g['counts'][block]}, expected {e['counts'][block]} "
                f"(all counts: expected {e['counts']}, got {g['counts']})", _missed("counts", method))
    if g["num_free"] != e["num_free"]:
        return ("num_free differs from the reference pool's", f"expected {e['num_free']}, got {g['num_free']}",
                _missed("books", method))
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


def _compare_replays_for(task: int):
    def compare(got, expected, sessions):
        if type(got) is not dict or type(got.get("traces")) is not list or len(got["traces"]) != len(expected["traces"]):
            return Mismatch("the check recorded the wrong number of pools")
        for session, g_steps, e_steps in zip(sessions, got["traces"], expected["traces"]):
            n = session["num_blocks"]
            before = {"counts": [0] * n, "num_free": n}
            for k, (g, e) in enumerate(zip(g_steps, e_steps)):
                problem = _step_difference(g, e, before)
                if problem:
                    what, detail, hint = problem
                    detail = (f"on BlockPool({n}, {session['block_size']}), call {k + 1}: {e['call']}: {detail}\n"
                              f"  {_history(e_steps, k)}")
                    owner = _METHOD_TASK.get(e["call"].split("(")[0], task)
                    own = [name for name in (g.get("own") or []) if name in _METHOD_TASK]
                    if own:
                        # The learner's books had left the reference's, or its method called another task's in
                        # a way the reference does not: the stand-ins handed those calls to its own methods.
                        named = " and ".join(f"{name} (task {_METHOD_TASK[name]})" for name in own)
                        what = f"{what}; your pool's own {named} ran in this call"
                        hint = (f"this check of task {task} puts the course's stand-ins in place of other tasks' "
                                f"methods, but in this call your pool's own {named} ran instead (a call the reference "
                                f"pool never makes from these books), so a mistake there shows here too: get those "
                                f"tasks' checks to pass first. {hint[:1].upper()}{hint[1:]}")
                    elif owner != task and not got["isolated"]:
                        # Only when the pool keeps other books: the stand-ins could not work on them.
                        what = f"in your {e['call'].split('(')[0]} (task {owner}): {what}"
                        hint = (f"this check of task {task} used your task {owner} method too, because your pool keeps "
                                "its books differently from the lab's __init__ (the checks put their stand-ins in "
                                "place of other tasks' methods only on those books); fix task "
                                f"{owner} first. {hint[:1].upper()}{hint[1:]}")
                    return Mismatch(what, detail, hint=hint)
                before = g
            if len(g_steps) != len(e_steps):
                return Mismatch("the check's operations went differently on your pool",
                                f"on BlockPool({n}, {session['block_size']}): {len(g_steps)} calls instead of "
                                f"{len(e_steps)}")
        return None

    return compare


# --- scripts: fixed shapes (visible checks) and random mixes (hidden checks) -----------------------

def _allocate_scripts(rng: random.Random) -> list[dict]:
    n = rng.randint(6, 10)
    return [
        {"num_blocks": n, "block_size": rng.choice([4, 16]), "ops": [
            ["allocate", rng.randint(1, 3)], ["can_allocate_free", 0], ["can_allocate_free", 1], ["allocate", 0],
            ["allocate", 2], ["allocate_free", rng.randint(1, 3)], ["allocate", -1], ["allocate", 2.0],
            ["allocate", True], ["ref_count_unknown", True], ["ref_count_unknown", False], ["allocate_free", 0],
            ["can_allocate", 1], ["can_allocate", 0], ["allocate", 0], ["allocate", 1]]},
        {"num_blocks": 1, "block_size": 8, "ops": [["allocate", 1], ["allocate", 1], ["can_allocate", 1]]},
    ]


def _free_scripts(rng: random.Random) -> list[dict]:
    n = rng.randint(7, 10)
    return [{"num_blocks": n, "block_size": 4, "ops": [
        ["free_bad", rng.randrange(n)],  # a block nobody holds
        ["allocate", 2], ["allocate", 3], ["allocate", 1],  # tables A, B, C
        ["free_bad", 1],  # B's blocks plus a free block: raises before freeing any of B
        ["free", 1, False],  # B in the given order
        ["free", 0, True],  # A tail first
        ["allocate_free", 0],  # everything free, in free-queue order: the LRU order shows here
        ["free_twice", 0], ["free_unknown", 0, False], ["free_unknown", 0, True],
        ["free", 1, True], ["free", 0, False], ["free", 0, True],
        ["allocate", 3]]}]


def _fork_scripts(rng: random.Random) -> list[dict]:
    n = rng.randint(6, 9)
    return [{"num_blocks": n, "block_size": 16, "ops": [
        ["fork_bad", rng.randrange(n)],  # sharing a block nobody holds
        ["allocate", 3], ["fork", 0], ["fork", 0],  # three tables hold the same 3 blocks
        ["fork_unknown", 0, True], ["fork_unknown", 0, False],  # an id outside the pool: nothing is shared
        ["fork_twice", rng.randrange(3)], ["free", 3, False],  # a block listed twice gains two holders, then loses them
        ["free", 0, True],  # one holder finishes: nothing is freed yet
        ["allocate", 1], ["fork_bad", 0],  # a held table plus a free block: nothing is shared
        ["fork", 2], ["free", 3, True], ["free_twice", 0],
        ["free", 0, True], ["free", 0, False],  # the last holders finish: the blocks join the free queue
        ["allocate_free", 0], ["free", 0, True], ["fork_bad", 0], ["free", 0, True], ["allocate_free", 0]]}]


def _cow_scripts(rng: random.Random) -> list[dict]:
    n = rng.randint(5, 8)
    return [{"num_blocks": n, "block_size": 4, "ops": [
        ["write_free", rng.randrange(n)],  # writing a block nobody holds
        ["write_unknown", True], ["write_unknown", False],  # writing an id outside the pool
        ["allocate", 2],  # table A
        ["write", 0, 1],  # A holds it alone: write in place
        ["fork", 0],  # table A' shares both blocks
        ["write_shared", 0],  # A's first block is shared: a private copy
        ["write", 0, 0],  # that copy is now private: in place
        ["write_shared", 0],  # the second block is still shared
        ["write", 1, 1],  # ... and A' now holds it alone
        ["fork", 1], ["allocate_free", 0],  # share again, then take every free block
        ["write_shared", 0],  # a copy is needed but nothing is free: OutOfBlocks, nothing changed
        ["free", 3, True],  # give the filler blocks back
        ["write_shared", 0], ["free", 0, True], ["free", 0, True], ["free", 0, True], ["allocate_free", 0]]}]


_RANDOM_KINDS = {
    1: {"allocate": 5, "allocate_free": 1, "can_allocate": 1, "can_allocate_free": 2, "ref_count_unknown": 1},
    2: {"allocate": 5, "allocate_free": 1, "can_allocate_free": 1, "free": 5, "free_bad": 1, "free_twice": 1,
        "free_unknown": 1},
    3: {"allocate": 4, "allocate_free": 1, "free": 5, "free_bad": 1, "free_twice": 1, "fork": 4, "fork_bad": 1,
        "fork_twice": 1, "fork_unknown": 1},
    4: {"allocate": 4, "allocate_free": 1, "can_allocate_free": 1, "free": 5, "free_bad": 1, "free_twice": 1,
        "free_unknown": 1, "fork": 3, "fork_bad": 1, "fork_twice": 1, "write": 3, "write_shared": 4, "write_free": 1,
        "write_unknown": 1},
}
_FIRST_OP = {1: "allocate", 2: "free_bad", 3: "fork_bad", 4: "write_free"}  # each task's own method first


def _random_op(rng: random.Random, kind: str) -> list:
    pick = rng.randrange(1000)
    arguments = {
        "allocate": [rng.choice([0, 1, 1, 2, 2, 3, 4, -1]) if rng.random() < 0.9 else rng.randint(5, 9)],
        "allocate_free": [rng.choice([0, 0, 1, 2])],
        "can_allocate": [rng.randint(0, 6)],
        "can_allocate_free": [rng.choice([-1, 0, 1])],
        "free": [pick, rng.random() < 0.7],
        "free_unknown": [pick, rng.random() < 0.5],
        "fork_unknown": [pick, rng.random() < 0.5],
        "ref_count_unknown": [rng.random() < 0.5],
        "write_unknown": [rng.random() < 0.5],
        "write": [pick, rng.randrange(1000)],
    }
    return [kind, *arguments.get(kind, [pick])]


def _random_scripts(task: int):
    kinds, weights = zip(*_RANDOM_KINDS[task].items())

    def make(rng: random.Random) -> list[dict]:
        sessions = []
        for num_blocks in (1, rng.randint(2, 4), rng.randint(5, 8), rng.randint(9, 14)):
            first = _random_op(rng, _FIRST_OP[task])
            if task == 1:
                first = ["allocate", rng.randint(0, num_blocks)]
            ops = [first] + [_random_op(rng, rng.choices(kinds, weights)[0]) for _ in range(rng.randint(25, 40))]
            sessions.append({"num_blocks": num_blocks, "block_size": rng.choice([1, 4, 16]), "ops": ops})
        return sessions

    return make


_TASKS = {1: "lab07 task 1: BlockPool.allocate", 2: "lab07 task 2: BlockPool.free", 3: "lab07 task 3: BlockPool.fork",
          4: "lab07 task 4: BlockPool.prepare_write"}

_POOL_SECTION = "chapter 07, section “2 · Blocks, block tables and the block pool”"
_SHARING_SECTION = "chapter 07, section “6 · Parallel sampling: one prompt, several answers, shared blocks”"

_HINTS = {  # check id -> the idea a learner failing it has most likely missed
    "lab07.allocate":
        "allocate hands out blocks from the front of the free queue, each then held by one table, and serves a "
        "request in full or not at all: asking for more blocks than are free raises OutOfBlocks (the number "
        "requested, the number free, the pool's size) before any block is taken. A negative count is a ValueError "
        "and asking for no blocks is valid; can_allocate says, for a count of 0 or more, whether allocate would "
        f"succeed, and num_free is always the number of blocks nobody holds ({_POOL_SECTION}).",
    "lab07.allocate_random":
        "if the fixed script passes, look at the edges: asking for exactly as many blocks as are free succeeds and "
        "empties the queue, asking for none succeeds even on an empty pool, and a pool of one block follows the "
        "same rules. A refused request changes nothing, neither a count nor the order of the free queue.",
    "lab07.free_lru":
        "free is all or nothing: an id outside the pool (negative ones included) or a double free (a block released "
        "in one call more times than tables hold it) raises ValueError before any count changes, so a call that "
        "raises leaves the pool exactly as it was. Blocks whose count reaches 0 join the back of the free queue in the "
        "order the call releases them, so the block freed longest ago is reused first (LRU), never the one just "
        f"freed ({_POOL_SECTION}).",
    "lab07.free_random":
        "over many calls the order of the free queue is what drifts first: blocks rejoin its back one at a time, in "
        "the order each call releases them, and a call that raises (an id outside the pool, or a block freed more "
        "times than it is held, even within one call) leaves every count and the queue's order untouched. num_free "
        "must always equal the number of blocks whose count is 0.",
    "lab07.fork":
        "fork shares blocks and copies nothing: each listed block gains one holder, and the caller gets a new list "
        "of the same ids, never the list it passed in, because the two tables change independently from then on. "
        "Sharing a free block is a ValueError raised before any count rises, and a shared block goes back to the "
        f"free queue only when its last holder frees it ({_SHARING_SECTION}).",
    "lab07.fork_random":
        "once blocks are shared, a block's count is the number of tables holding it: an id listed twice in one fork "
        "gains two holders, and a free may release a block as often as it is held and no more, so a double free "
        "is judged against the count, not against 1. A refused fork or free changes nothing.",
    "lab07.copy_on_write":
        "a block other tables also hold must never be written in place, or they would read the writer's tokens as "
        "their own: the writer gets a fresh block from the front of the free queue and gives up its own hold on "
        "the shared one, which the others keep, while a block the caller holds alone is written where it is. When "
        "a copy is needed and no block is free, OutOfBlocks is raised with nothing changed, and writing a free "
        f"block is a ValueError ({_SHARING_SECTION}).",
    "lab07.random_ops":
        "with every operation mixed, all of them keep one set of books: a block's count is the number of tables "
        "holding it, a block is free exactly when that count is 0, and the free queue holds exactly the free "
        "blocks, handed out from the front and rejoined at the back. A copy moves one holder off the shared block, "
        "so once a single table holds it again, that table writes into it in place.",
}

for check_id, task, make, note in (
        ("lab07.allocate", 1, _allocate_scripts, ""),
        ("lab07.allocate_random", 1, _random_scripts(1), " Random sequences, pools of 1 to 14 blocks."),
        ("lab07.free_lru", 2, _free_scripts, ""),
        ("lab07.free_random", 2, _random_scripts(2), " Random sequences with double frees."),
        ("lab07.fork", 3, _fork_scripts, ""),
        ("lab07.fork_random", 3, _random_scripts(3), " Random sequences of allocate, free and fork."),
        ("lab07.copy_on_write", 4, _cow_scripts, ""),
        ("lab07.random_ops", 4, _random_scripts(4), " Random sequences of every operation.")):
    register(Check(
        check_id=check_id,
        task=_TASKS[task],
        reference=_POOL,
        make_inputs=_with_decisions(make, task),
        drive=_drive_replays_for(task),
        compare=_compare_replays_for(task),
        hint=_HINTS[check_id] + note,
    ))


# --- the pool behind a paged KV cache ---------------------------------------------------------------

_QUESTIONS = ["What is a GPU?", "Name three planets.", "Why is the sky blue?", "What does a compiler do?"]


def _tiny_model_case(rng: random.Random) -> dict:
    block_size = rng.choice([2, 3, 4])
    lengths = [rng.randint(2, 14) for _ in range(2)]
    lengths = [n + 1 if n % block_size == 0 else n for n in lengths]  # a part-full last block is shared
    return {"model": "tiny", "seed": rng.randrange(10**6), "block_size": block_size, "new_tokens": 8, "samples": 3,
            "prompts": tiny_prompts(rng, lengths)}


def _smollm2_case(rng: random.Random) -> dict:
    return smollm2_case(rng, 5, _QUESTIONS, block_size=16, samples=2)


def _parallel_samples(model, store, pool, prompt: list[int], samples: int, new_tokens: int) -> dict:
    """Prefill a prompt once, fork its sequence ``samples - 1`` times, start sample i from the
    i-th most likely first token, and decode the samples in turn, one token each per round."""
    import torch

    from infra_lib.serving import PagedKVCache

    parent = PagedKVCache.for_prompt(store, pool, prompt)
    logits = model(torch.tensor([parent.pending_token_ids]), parent, last_only=True)
    firsts = [int(t) for t in logits[0, -1].topk(samples).indices]
    sequences = [parent] + [parent.fork() for _ in range(samples - 1)]
    shared_counts = [pool.ref_count(b) for b in parent.table.blocks]
    tokens, top_logits = [[t] for t in firsts], [[] for _ in firsts]
    for _ in range(new_tokens - 1):
        for sequence, out, tops in zip(sequences, tokens, top_logits):
            sequence.reserve([out[-1]])
            step = model(torch.tensor([[out[-1]]]), sequence, last_only=True)[0, -1]
            tops.append(float(step.max()))
            out.append(int(step.argmax()))
    for sequence in sequences:
        sequence.release()
    return {"shared_counts": shared_counts, "tokens": tokens, "top_logits": top_logits,
            "num_free_after": _plain_number(pool.num_free)}


def _pool_shape(case: dict, prompts: list[list[int]]) -> tuple[int, int]:
    """(num_blocks, block_size) of the case's pool."""
    block_size = case["block_size"]
    if any(len(p) % block_size == 0 for p in prompts):
        block_size += 1  # a part-full last prompt block, so that the samples copy it on write
    longest = max(len(p) for p in prompts) + case["new_tokens"]
    return case["samples"] * -(-longest // block_size) + 2, block_size


def _serve(model, store, pool, prompts: list[list[int]], case: dict, contiguous: bool) -> list[dict]:
    """Greedy tokens through the pool: whole requests (the small model), then forked samples of each prompt;
    with ``contiguous``, the same tokens from the contiguous cache beside them."""
    import torch

    from infra_lib.model.generation import greedy_decode
    from infra_lib.serving import paged_greedy_decode

    results = []
    with torch.inference_mode():
        for prompt in prompts:
            result = {"prompt_length": len(prompt), "num_blocks": store.num_blocks, "block_size": store.block_size}
            if case["model"] == "tiny":
                decoded = paged_greedy_decode(model, store, pool, prompt, case["new_tokens"])
                result["tokens"] = decoded.token_ids
                result["num_free_after"] = _plain_number(pool.num_free)
                if contiguous:
                    result["contiguous"] = greedy_decode(model, prompt, case["new_tokens"])
            sampled = _parallel_samples(model, store, pool, prompt, case["samples"], case["new_tokens"])
            if contiguous:
                sampled["contiguous"] = [[t[0]] + greedy_decode(model, prompt + [t[0]], case["new_tokens"] - 1)
                                         for t in sampled["tokens"]]
            result["samples"] = sampled
            results.append(result)
    return results


def _with_model_decisions(make):
    """``make``'s case with the reference's decisions for tasks 1-3's methods while the paged cache serves it
    (``"decisions"``). Which blocks the cache asks for, shares, copies and frees depends on the lengths alone,
    not on the tokens, so they are recorded on a model of one small layer."""

    def make_inputs(rng: random.Random) -> dict:
        import torch

        from infra_lib.model.config import LlamaConfig
        from infra_lib.model.model import Llama
        from infra_lib.serving import PagedKVStore

        case = make(rng)
        config = LlamaConfig(vocab_size=64, hidden_size=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8,
                             intermediate_size=8, max_position=4096, rope_theta=1000.0)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Llama(config).eval()
        prompts = [[t % config.vocab_size for t in p] for p in case_prompts(case)]
        num_blocks, block_size = _pool_shape(case, prompts)
        decisions: dict = {}
        pool = _recording_pool(decisions, 4)(num_blocks, block_size)
        _serve(model, PagedKVStore.for_model(config, num_blocks, block_size), pool, prompts, case, contiguous=False)
        case["decisions"] = [[list(key), decision] for key, decision in decisions.items()]
        return case

    return make_inputs


def _drive_in_model(pool_class, case):
    """Greedy tokens through the learner's pool: whole requests, then forked samples of one prompt;
    and, for comparison, the same tokens from the contiguous cache."""
    from infra_lib.serving import PagedKVStore
    from infra_lib.serving.block_pool import BlockPool

    if pool_class is not BlockPool:  # prepare_write is task 4's; the rest the stand-ins'
        pool_class, _ = pool_for_task(pool_class, 4, case.get("decisions", ()))
    model = case_model(case)
    prompts = case_prompts(case)
    num_blocks, block_size = _pool_shape(case, prompts)
    pool = _new_pool(pool_class, num_blocks, block_size)
    try:  # block 0 of a fresh pool is free (ValueError): an unwritten prepare_write names its task here
        pool.prepare_write(0)
    except NotImplementedError:
        raise
    except Exception:
        pass
    return _serve(model, PagedKVStore.for_model(model.config, num_blocks, block_size), pool, prompts, case,
                  contiguous=True)


def _compare_in_model(got, expected, case):
    model = "SmolLM2" if case["model"] == "smollm2" else "the small random model"
    for g, e in zip(got, expected):
        where = (f"{model}, a prompt of {e['prompt_length']} tokens, BlockPool({e['num_blocks']}, "
                 f"{e['block_size']})")
        if "tokens" in e:
            if g["tokens"] != e["contiguous"]:
                return Mismatch("greedy decoding through your pool gives other tokens than the contiguous cache",
                                f"on {where}, one request: {token_difference(g['tokens'], e['contiguous'])}")
            if g["num_free_after"] != e["num_free_after"]:
                return Mismatch("a finished request did not give all its blocks back",
                                f"on {where}: after the request released its blocks num_free is {g['num_free_after']}, "
                                f"expected {e['num_free_after']}")
        gs, es = g["samples"], e["samples"]
        samples = len(es["tokens"])
        if gs["shared_counts"] != es["shared_counts"]:
            return Mismatch("after forking, the prompt's blocks have the wrong reference counts",
                            f"on {where}, {samples} samples sharing the prompt: expected counts {es['shared_counts']} "
                            f"for the prompt's blocks, got {gs['shared_counts']}")
        for i, (g_tokens, e_tokens) in enumerate(zip(gs["tokens"], es["contiguous"])):
            if g_tokens != e_tokens:
                return Mismatch("a forked sample gives other tokens than the contiguous cache (copy-on-write?)",
                                f"on {where}, sample {i + 1} of {samples} (prompt shared, then its own tokens): "
                                f"{token_difference(g_tokens, e_tokens)}")
        problem = array_mismatch(gs["top_logits"], es["top_logits"], "a forked sample's logits differ",
                                 f"{where}, {samples} samples", atol=1e-3, rtol=1e-4)
        if problem:
            return problem
        if gs["num_free_after"] != es["num_free_after"]:
            return Mismatch("forked samples did not give all their blocks back",
                            f"on {where}: after every sample released its blocks num_free is {gs['num_free_after']}, "
                            f"expected {es['num_free_after']}")
    return None


for check_id, make, note in (
        ("lab07.pool_in_model", _tiny_model_case, ""),
        ("lab07.parallel_sampling_smollm2", _smollm2_case, " This one runs SmolLM2-135M-Instruct itself.")):
    register(Check(
        check_id=check_id,
        task=_TASKS[4],
        reference=_POOL,
        make_inputs=_with_model_decisions(make),
        drive=_drive_in_model,
        compare=_compare_in_model,
        hint="here a paged KV cache drives your pool, so a slip in its books shows up as other tokens: if the "
        "step-by-step checks pass but a forked sample's tokens differ, a block another sample still held was "
        "written in place instead of copied. If blocks are still held once every sequence has been released, some "
        "count rose more often than it fell: sharing, copying and freeing must balance "
        f"({_SHARING_SECTION})." + note,
    ))
