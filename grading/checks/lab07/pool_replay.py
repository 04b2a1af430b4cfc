"""The block pool a lab 07 check drives, and the operations it replays on it: each names what to do, not
the block ids, so the learner's pool and the reference run the same script on their own state."""

from __future__ import annotations

import os
import random

from grading.checks.common import reference

# the lab's tasks, as the checks name them
TASKS = {
    1: "lab07 task 1: BlockPool.allocate",
    2: "lab07 task 2: BlockPool.free",
    3: "lab07 task 3: BlockPool.fork",
    4: "lab07 task 4: BlockPool.prepare_write",
}

POOL_SECTION = "chapter 07, section “2 · Blocks, block tables and the block pool”"
SHARING_SECTION = "chapter 07, section “6 · Parallel sampling: one prompt, several answers, shared blocks”"
OWN_CALLS = "_course_stand_ins_passed_on"  # on an isolated class: the learner's methods a stand-in called

# the reference pool, loaded when a check needs it
POOL = reference("infra_lib.serving.block_pool", "BlockPool")


def new_pool(pool_class, num_blocks: int, block_size: int):
    """The pool a check drives. One that is, extends or wraps the course's BlockPool is refused
    (except the reference itself, driven for the expected data outside the grader's kernel)."""
    from grading.check import RECORD_ENV
    from infra_lib.serving.block_pool import BlockPool

    pool = pool_class(num_blocks, block_size)
    if pool_class is BlockPool and not os.environ.get(RECORD_ENV):
        return pool
    if any(isinstance(held, BlockPool) for held in [pool, *getattr(pool, "__dict__", {}).values()]):
        raise RuntimeError(
            "your BlockPool is built on the course's reference pool "
            "(infra_lib.serving.block_pool.BlockPool): keep the books yourself"
        )
    return pool


# --- replaying operations -------------------------------------------------------------------------
#
# An operation names what to do, not the block ids: ids come from what the pool under test
# returned earlier ("free the second live table"), so the learner's pool and the reference each
# run the same script on their own state, and their traces agree step by step when they behave
# alike. Each op is a list: [kind, *arguments]; `pick` chooses among candidates modulo their count.


def is_id(value) -> bool:
    return type(value) is int


def _shown(value, method: str) -> str:
    """A call's result as text: "[3, 1]", "(4, None)", "True", or the type it had."""
    if value is None or type(value) is bool:
        return repr(value)
    if type(value) in (list, tuple) and all(is_id(v) or v is None for v in value):
        if method == "prepare_write" and len(value) == 2:
            return repr(tuple(value))
        return repr(list(value) if type(value) is list else tuple(value))
    return f"a {type(value).__name__}"


def plain_number(value):
    return value if is_id(value) else f"a {type(value).__name__}"


class Replay:
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
        step = {
            "call": text,
            "result": None,
            "error": None,
            "out_of_blocks": None,
            "message": None,
            "num_free": plain_number(num_free),
            "counts": [plain_number(c) for c in counts],
        }
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
                step["out_of_blocks"] = [
                    plain_number(getattr(error, name, None)) for name in ("requested", "free", "total")
                ]
        self.steps.append(step)
        self.num_free = num_free if is_id(num_free) else 0
        self.counts = [c if is_id(c) else 0 for c in counts]
        if error is None and step["result"].startswith(("[", "(")):
            ids = list(result)
            if method == "prepare_write":  # (block to write, block copied from or None)
                return (
                    ids
                    if len(ids) == 2 and self._is_block(ids[0]) and (ids[1] is None or self._is_block(ids[1]))
                    else None
                )
            return ids if all(self._is_block(b) for b in ids) else None
        return None

    def _is_block(self, value) -> bool:
        return is_id(value) and 0 <= value < self.num_blocks

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
        if got is not None and len(got) == 2 and got[1] is not None and is_id(got[0]):
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


# random mixes of operations, for the hidden checks

_RANDOM_KINDS = {
    1: {"allocate": 5, "allocate_free": 1, "can_allocate": 1, "can_allocate_free": 2, "ref_count_unknown": 1},
    2: {
        "allocate": 5,
        "allocate_free": 1,
        "can_allocate_free": 1,
        "free": 5,
        "free_bad": 1,
        "free_twice": 1,
        "free_unknown": 1,
    },
    3: {
        "allocate": 4,
        "allocate_free": 1,
        "free": 5,
        "free_bad": 1,
        "free_twice": 1,
        "fork": 4,
        "fork_bad": 1,
        "fork_twice": 1,
        "fork_unknown": 1,
    },
    4: {
        "allocate": 4,
        "allocate_free": 1,
        "can_allocate_free": 1,
        "free": 5,
        "free_bad": 1,
        "free_twice": 1,
        "free_unknown": 1,
        "fork": 3,
        "fork_bad": 1,
        "fork_twice": 1,
        "write": 3,
        "write_shared": 4,
        "write_free": 1,
        "write_unknown": 1,
    },
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


def random_scripts(task: int):
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
