"""Lab 07's stand-ins for the other tasks' pool methods: the reference's recorded decisions carried out on
the learner's books, so that a slip in one task's method never costs another task's points."""

from __future__ import annotations

import random

from grading.checks.lab07.pool_replay import OWN_CALLS, Replay, new_pool

# --- one task at a time ------------------------------------------------------------------------------
#
# A task's checks call the learner's methods for that task and stand-ins for the other tasks' methods, so that
# a slip in one method never costs another task's points. The stand-ins solve no task. Where the inputs are
# made (in the grader's process when the kernel is sandboxed, where the reference is a stub), the reference
# pool runs the check's own calls, and each call of another task's method is recorded with the books it met
# (every block's count and the number free) and what the reference decided: the value it returned, the error
# it raised, or how its books changed (the counts of the blocks it was given, how many blocks it took from the
# front of the free queue and their counts, which blocks joined its back). In the kernel a stand-in looks its
# call up by the learner's books and carries
# that decision out on them: taken blocks come from the front of the learner's own free queue, so an order the
# learner's method left there shows as other blocks handed out. A call the reference never met in those books
# (the learner's books already differ, or its method calls another task's in a way the reference does not)
# goes to the learner's own method, and a failure it causes names that method and its task. The stand-ins work
# on the books the lab's __init__ starts (`ref_counts`, a list, and `free_queue`, a deque); a pool that keeps
# them some other way is driven with all its own methods, and a failure inside another task's method then names
# that method and its task.

METHOD_TASK = {
    "num_free": 1,
    "ref_count": 1,
    "can_allocate": 1,
    "allocate": 1,
    "free": 2,
    "fork": 3,
    "prepare_write": 4,
}
_BOOKS = {"num_blocks", "block_size", "ref_counts", "free_queue"}
_ANSWERS = ("ref_count", "can_allocate")  # the methods whose decision is the value they return


def _decision_key(method: str, args: tuple, counts, num_free) -> tuple:
    return method, repr(args), tuple(counts), num_free


def recording_pool(decisions: dict, task: int):
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
                decisions.setdefault(
                    key, ["books", changes, [now[b] for b in taken], [b for b in after if b not in set(free)]]
                )
            return result

        return call

    return type(
        "RecordedBlockPool",
        (BlockPool,),
        {m: recorded(m) for m in ("allocate", "free", "fork", "prepare_write", *_ANSWERS) if METHOD_TASK[m] != task},
    )


def _carry_out(pool, method: str, args: tuple, decision: list):
    """The reference's decision for this call, carried out on the learner's books."""
    from infra_lib.serving.errors import OutOfBlocks

    kind, *detail = decision
    if kind == "raise":
        name, message, numbers = detail
        raise (
            OutOfBlocks(*numbers)
            if name == "OutOfBlocks"
            else {"ValueError": ValueError}.get(name, RuntimeError)(message)
        )
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
            raise RuntimeError(
                f"the pool's books left the reference's before this {method} call, so the check "
                f"needs your own {method} (task {METHOD_TASK[method]}), which is not written yet: "
                f"{exc}"
            ) from None

    call.__name__ = method
    return call


def _keeps_the_starting_books(pool) -> bool:
    """Whether a new pool keeps exactly the books the lab's ``__init__`` sets up (so that the stand-ins for
    the other tasks' methods can work on them)."""
    from collections import deque

    books = getattr(pool, "__dict__", None)
    return (
        type(books) is dict
        and set(books) == _BOOKS
        and type(books["ref_counts"]) is list
        and type(books["free_queue"]) is deque
        and books["ref_counts"] == [0] * pool.num_blocks
        and list(books["free_queue"]) == list(range(pool.num_blocks))
    )


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
    others = {
        name: _stand_in(name, table, passed_on)
        for name in METHOD_TASK
        if METHOD_TASK[name] != task and name != "num_free"
    }
    if task != 1:
        others["num_free"] = property(lambda self: len(self.free_queue))  # the books' own count
    return type(
        pool_class.__name__, (pool_class,), {**others, OWN_CALLS: passed_on, "__module__": pool_class.__module__}
    ), True


def with_decisions(make, task: int):
    """``make``'s sessions, each with the reference's decisions for the other tasks' methods (``"decisions"``)."""

    def make_inputs(rng: random.Random) -> list[dict]:
        sessions = make(rng)
        for session in sessions:
            decisions: dict = {}
            replay = Replay(
                recording_pool(decisions, task)(session["num_blocks"], session["block_size"]), session["num_blocks"]
            )
            for kind, *args in session["ops"]:
                getattr(replay, kind)(*args)
            session["decisions"] = [[list(key), decision] for key, decision in decisions.items()]
        return sessions

    return make_inputs


def drive_replays_for(task: int):
    def drive(pool_class, sessions):
        from infra_lib.serving.block_pool import BlockPool

        isolated, traces = False, []
        for session in sessions:
            cls = pool_class
            if pool_class is not BlockPool:
                cls, isolated = pool_for_task(pool_class, task, session.get("decisions", ()))
            replay = Replay(
                new_pool(cls, session["num_blocks"], session["block_size"]),
                session["num_blocks"],
                books=isolated and task != 1,
            )
            for kind, *args in session["ops"]:
                getattr(replay, kind)(*args)
            traces.append(replay.steps)
        return {"isolated": isolated, "traces": traces}

    return drive
