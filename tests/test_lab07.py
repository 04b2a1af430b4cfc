"""Lab 07's checks score each task on its own: a typical mistake in one method loses exactly that
task's checks, with the hint written for that mistake, while the other tasks' checks (which put stand-ins
carrying out the reference's recorded decisions in place of the other methods) still pass."""

from __future__ import annotations

from collections import Counter, deque

import pytest
from conftest import REPO, answer_cells, check_fails, solution_namespace

from grading import check
from grading.checks.lab07.pool_replay import Replay
from grading.checks.lab07.stand_ins import METHOD_TASK, pool_for_task, recording_pool
from grading.checks.lab07.traces import MISSED
from grading.registry import all_checks

SOLUTION = REPO / "solutions" / "lab07_paged_kv" / "lab07_paged_kv.ipynb"
# The step-by-step checks of each task (the model checks are task 4's too; see below).
TASK_CHECKS = {
    1: ["lab07.allocate", "lab07.allocate_random"],
    2: ["lab07.free_lru", "lab07.free_random"],
    3: ["lab07.fork", "lab07.fork_random"],
    4: ["lab07.copy_on_write", "lab07.random_ops"],
}


@pytest.fixture(scope="module")
def solution() -> type:
    return solution_namespace(SOLUTION, Counter=Counter, deque=deque)["BlockPool"]


def _scores(pool_class) -> dict[int, list[str]]:
    """The checks each task fails, and the message of each failure."""
    failed: dict[int, list[str]] = {}
    for task, ids in TASK_CHECKS.items():
        for check_id in ids:
            try:
                check(check_id, pool_class)
            except AssertionError as exc:
                failed.setdefault(task, []).append(str(exc))
    return failed


def _only_task_fails(pool_class, task: int, hint: str) -> list[str]:
    failed = _scores(pool_class)
    assert set(failed) == {task}, {t: [m.splitlines()[0] for m in ms] for t, ms in failed.items()}
    for message in failed[task]:
        assert f"[lab07 task {task}" in message and f"hint: {hint}" in message, message
    if task != 4:  # the pool in the tiny model (task 4's check) drives the stand-ins for tasks 1-3
        check("lab07.pool_in_model", pool_class)
    return failed[task]


def test_the_instructor_pool_passes_every_check_of_every_task(solution):
    assert _scores(solution) == {}
    check("lab07.pool_in_model", solution)


def test_allocating_from_the_back_of_the_queue_loses_task_1_only_with_the_order_hint(solution):
    class FromTheBack(solution):
        def allocate(self, n):
            if type(n) is not int or n < 0:
                raise ValueError(n)
            if n > self.num_free:
                raise OutOfBlocks(n, self.num_free, self.num_blocks)
            taken = [self.free_queue.pop() for _ in range(n)]
            for block_id in taken:
                self.ref_counts[block_id] = 1
            return taken

    from infra_lib.serving.errors import OutOfBlocks

    messages = _only_task_fails(FromTheBack, 1, MISSED["order"])
    assert "allocate handed out other blocks than the reference pool" in messages[0]


def test_a_free_that_changes_counts_before_finding_a_double_free_loses_task_2_only(solution):
    class NotAtomic(solution):
        def free(self, block_ids):
            for block_id in block_ids:
                self._check_id(block_id)
                if self.ref_counts[block_id] == 0:
                    raise ValueError(f"block {block_id} is already free")
                self.ref_counts[block_id] -= 1
                if self.ref_counts[block_id] == 0:
                    self.free_queue.append(block_id)

    messages = _only_task_fails(NotAtomic, 2, MISSED["atomic"])
    assert "free raised but changed the pool first" in messages[0]
    check("lab07.pool_in_model", NotAtomic)  # task 4's model check uses the stand-in for free


def test_a_free_that_puts_blocks_at_the_front_loses_task_2_only_with_the_order_hint(solution):
    class MostRecentFirst(solution):
        def free(self, block_ids):
            super().free(block_ids)
            # the blocks that just became free move to the front: the newest is reused first
            for block_id in reversed([b for b in block_ids if self.ref_counts[b] == 0]):
                if block_id in self.free_queue:
                    self.free_queue.remove(block_id)
                    self.free_queue.appendleft(block_id)

    _only_task_fails(MostRecentFirst, 2, MISSED["order"])


def test_a_fork_that_returns_its_argument_loses_task_3_only_with_its_own_hint(solution):
    class SameList(solution):
        def fork(self, block_ids):
            super().fork(block_ids)
            return block_ids

    messages = _only_task_fails(SameList, 3, MISSED["same_list"])
    assert "fork returned the list it was given instead of a new one" in messages[0]


def test_a_copy_that_keeps_the_writers_hold_loses_task_4_only_with_the_copy_hint(solution):
    class KeepsItsHold(solution):
        def prepare_write(self, block_id):
            block_id = self._check_id(block_id)
            if self.ref_counts[block_id] == 0:
                raise ValueError("free")
            if self.ref_counts[block_id] == 1:
                return block_id, None
            (new_id,) = self.allocate(1)
            return new_id, block_id  # the shared block keeps the writer as a holder too

    messages = _only_task_fails(KeepsItsHold, 4, MISSED["counts"]["prepare_write"])
    assert "reference counts differ" in messages[0]
    assert "pool_in_model failed [lab07 task 4" in check_fails("lab07.pool_in_model", KeepsItsHold)


def test_a_pool_that_keeps_other_books_is_driven_whole_and_a_sibling_is_named(solution):
    """With its own books the course's methods cannot stand in: task 3's check then runs the learner's
    free, and its failure names free and task 2 instead of blaming fork."""

    class OwnBooks(solution):
        def __init__(self, num_blocks, block_size):
            super().__init__(num_blocks, block_size)
            self.freed_calls = 0

        def free(self, block_ids):
            self.freed_calls += 1
            for block_id in block_ids:  # not all or nothing
                if self.ref_counts[self._check_id(block_id)] == 0:
                    raise ValueError(f"block {block_id} is already free")
                self.ref_counts[block_id] -= 1
                if self.ref_counts[block_id] == 0:
                    self.free_queue.append(block_id)

    assert pool_for_task(OwnBooks, 3) == (OwnBooks, False)
    assert pool_for_task(solution, 3)[1] is True
    message = check_fails("lab07.fork", OwnBooks)
    assert "in your free (task 2): free raised but changed the pool first" in message, message
    assert "fix task 2 first" in message


def _without_messages(traces: list) -> list:
    return [[{k: v for k, v in step.items() if k != "message"} for step in steps] for steps in traces]


def _unwritten(name: str):
    def method(self, *args):
        raise NotImplementedError(name)

    return method


class _Bare:
    """The lab's books, and every task's method unwritten."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_queue = deque(range(num_blocks))

    num_free = property(_unwritten("num_free"))
    ref_count, can_allocate, allocate = _unwritten("ref_count"), _unwritten("can_allocate"), _unwritten("allocate")
    free, fork, prepare_write = _unwritten("free"), _unwritten("fork"), _unwritten("prepare_write")


def test_the_stand_ins_carry_out_the_references_decisions_exactly():
    """The methods that stand in for other tasks' carry out what the reference pool decided on the same calls:
    given every method's decisions, a pool of stand-ins alone gives the reference's traces on every check."""
    for ids in TASK_CHECKS.values():
        for check_id in ids:
            registered = all_checks()[check_id]
            for seed in range(3):
                want = registered.drive(registered.reference(), registered.inputs(seed))["traces"]
                got = []
                for session in registered.inputs(seed):
                    decisions: dict = {}
                    recorder = recording_pool(decisions, task=0)  # no task's own: every method recorded
                    replay = Replay(recorder(session["num_blocks"], session["block_size"]), session["num_blocks"])
                    for kind, *args in session["ops"]:
                        getattr(replay, kind)(*args)
                    pool, isolated = pool_for_task(_Bare, 0, [[list(k), d] for k, d in decisions.items()])
                    assert isolated
                    replay = Replay(
                        pool(session["num_blocks"], session["block_size"]), session["num_blocks"], books=True
                    )
                    for kind, *args in session["ops"]:
                        getattr(replay, kind)(*args)
                    got.append(replay.steps)
                # Error messages are the reference's own words here too: everything must agree.
                assert got == want, (check_id, seed)


def test_the_stand_ins_hold_no_answer(solution):
    """A check's inputs carry the reference's decisions for the other tasks' methods only, and a stand-in answers
    nothing it was not given: a pool made of stand-ins fails every task's checks, and with another seed's
    decisions it cannot even get through the calls it was given."""
    for task, ids in TASK_CHECKS.items():
        for check_id in ids:
            registered = all_checks()[check_id]
            inputs = registered.inputs(0)
            own = [name for name, owner in METHOD_TASK.items() if owner == task and name != "num_free"]
            for session in inputs:
                assert not [key for key, _ in session["decisions"] if key[0] in own], (check_id, own)
            with pytest.raises((AssertionError, NotImplementedError)):
                check(check_id, _Bare)
    stale = all_checks()["lab07.random_ops"].inputs(1)[2]["decisions"]
    pool, _ = pool_for_task(_Bare, 0, stale)
    session = all_checks()["lab07.random_ops"].inputs(2)[2]
    replay = Replay(pool(session["num_blocks"], session["block_size"]), session["num_blocks"], books=True)
    for kind, *args in session["ops"]:
        getattr(replay, kind)(*args)
    unanswered = [step for step in replay.steps if step["error"] == "RuntimeError"]
    assert unanswered and all("books left the reference's" in step["message"] for step in unanswered)


def test_a_call_the_reference_never_met_runs_the_learners_own_method_and_is_named(solution):
    """A copy-on-write that gives up the writer's hold before taking the new block calls allocate from books the
    reference never has at that point: the learner's own allocate answers it, and a mistake there is named."""

    class ReleasesFirst(solution):
        def allocate(self, n):  # task 1, wrong: blocks from the back of the queue
            taken = [self.free_queue.pop() for _ in range(n)]
            for block_id in taken:
                self.ref_counts[block_id] = 1
            return taken

        def prepare_write(self, block_id):
            if block_id not in range(self.num_blocks) or self.ref_counts[block_id] < 2 or not self.free_queue:
                return super().prepare_write(block_id)
            self.ref_counts[block_id] -= 1  # gives up the writer's hold, then takes the new block
            (new_id,) = self.allocate(1)
            return new_id, block_id

    message = check_fails("lab07.copy_on_write", ReleasesFirst)
    assert "your pool's own allocate (task 1) ran in this call" in message, message
    assert "prepare_write handed out other blocks" in message, message


# --- task 5: the batched step ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def step():
    import torch

    return solution_namespace(SOLUTION, torch=torch)["forward_step"]


def test_the_step_checks_run_on_scheduler_plans_that_hold_every_case_the_lab_names():
    from grading.checks.lab07.step_plans import FEATURES, features

    for check_id in ("lab07.forward_step", "lab07.forward_step_scheduled"):
        for seed in range(2):
            for case in all_checks()[check_id].inputs(seed):
                assert features(case["steps"]) == set(FEATURES), (check_id, seed)
    plain, cached, tight = all_checks()["lab07.forward_step_scheduled"].inputs(0)
    parts = [part for case in (plain, cached, tight) for step in case["steps"] for part in step]
    assert all(p["num_tokens"] >= 1 and p["start"] + p["num_tokens"] <= len(p["prompt"] + p["output"]) for p in parts)
    admissions = [p for step in cached["steps"] for p in step if p["kind"] == "prefill" and not p["output"]]
    assert any(p["start"] > 0 and p["start"] % cached["block_size"] == 0 for p in admissions), "no prefix hit"


def test_the_step_checks_drive_the_learners_step_without_the_courses_pool_or_runner(step, monkeypatch):
    # in the graded kernel both are stubs: the plans come from the grader, and nothing else needs them
    from infra_lib.serving.block_pool import BlockPool
    from infra_lib.serving.model_runner import ModelRunner

    registered = all_checks()["lab07.forward_step_scheduled"]
    inputs = registered.inputs(5)

    def unavailable(*args, **kwargs):
        raise RuntimeError("the reference is not available in the graded kernel")

    for cls in (BlockPool, ModelRunner):
        for name in ("__init__", "allocate", "free", "forward"):
            if name in vars(cls):
                monkeypatch.setattr(cls, name, unavailable)
    got = registered.drive(step, inputs)
    monkeypatch.undo()
    assert registered.compare(got, registered.drive(registered.reference(), inputs), inputs) is None


def test_a_step_that_also_writes_a_slot_no_token_owns_fails_the_rule_that_nothing_else_changes(step):
    from grading.checks.lab07.step_judging import SLOT_HINT

    def and_the_spare_block(model, store, batch):
        logits = step(model, store, batch)
        store.v[-1][-1, 0] = 0.0  # the store's last block, which no table holds
        return logits

    message = check_fails("lab07.forward_step", and_the_spare_block)
    assert "layer 1 V: slot" in message and "is no scheduled token's slot" in message, message
    assert f"hint: {SLOT_HINT}" in message


def test_a_step_that_attends_before_writing_its_new_keys_fails_with_the_attention_hint():
    import torch

    from grading.checks.lab07.step_judging import ATTENTION_HINT

    source = answer_cells(SOLUTION)["forward_step"]
    writes = (
        "        k_rows[slots] = k[0].transpose(0, 1).to(k_rows.dtype)\n"
        "        v_rows[slots] = v[0].transpose(0, 1).to(v_rows.dtype)\n"
    )
    residual = "        x = x + attn.o_proj("
    assert source.count(writes) == 1 and source.count(residual) == 1
    namespace = {"torch": torch}
    exec(source.replace(writes, "").replace(residual, writes + residual), namespace)
    message = check_fails("lab07.forward_step", namespace["forward_step"])
    assert "the keys or values written differ" in message and "layer 1 " in message, message
    assert f"hint: {ATTENTION_HINT}" in message
