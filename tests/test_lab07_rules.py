"""Lab 07's stated rules that a check must hold: each pool below is the instructor's with one rule of the
lab's text broken; the task's check fails it at the call that shows the rule, with the hint for it, and
the instructor's pool passes. The same for task 5's step: the instructor's ``forward_step`` with one of
the usual slips fails both step checks with the hint that names it."""

from __future__ import annotations

from collections import Counter, deque

import pytest
import torch
from conftest import REPO, answer_cells, check_fails, solution_namespace

from grading import check
from grading.checks.lab07.step_judging import POSITIONS_HINT, ROPE_HINT, SAMPLING_HINT, SHAPE_HINT, SLOT_HINT
from grading.checks.lab07.traces import MISSED

SOLUTION = REPO / "solutions" / "lab07_paged_kv" / "lab07_paged_kv.ipynb"


@pytest.fixture(scope="module")
def pool() -> type:
    return solution_namespace(SOLUTION, Counter=Counter, deque=deque)["BlockPool"]


def test_the_instructor_pool_passes_the_checks_that_hold_these_rules(pool):
    for check_id in (
        "lab07.allocate",
        "lab07.allocate_random",
        "lab07.fork",
        "lab07.fork_random",
        "lab07.copy_on_write",
        "lab07.random_ops",
    ):
        check(check_id, pool)


def test_a_ref_count_that_reads_any_index_fails_the_rule_that_a_bad_id_raises(pool):
    class FromTheEnd(pool):
        def ref_count(self, block_id):
            return self.ref_counts[block_id]  # -1 reads the last block's count

    message = check_fails("lab07.allocate", FromTheEnd)
    assert "[lab07 task 1" in message and "ref_count did not raise where the reference pool raises" in message, message
    assert "ref_count(-1): expected ValueError" in message
    assert f"hint: {MISSED['refuse']['ref_count']}" in message


def test_an_allocate_that_takes_a_float_or_a_bool_fails_the_rule_that_n_is_an_int(pool):
    class AnyNumber(pool):
        def allocate(self, n):
            if n < 0:
                raise ValueError(n)
            return super().allocate(int(n))  # 2.0 and True served as 2 and 1

    message = check_fails("lab07.allocate", AnyNumber)
    assert "allocate did not raise where the reference pool raises" in message, message
    assert "allocate(2.0): expected ValueError" in message
    assert "not an int (a float such as 2.0, or a bool) is a ValueError" in message


def test_a_fork_without_the_id_check_fails_the_rule_that_an_id_outside_the_pool_raises(pool):
    class Unchecked(pool):
        def fork(self, block_ids):
            if any(self.ref_counts[b] == 0 for b in block_ids):
                raise ValueError("free")
            for b in block_ids:
                self.ref_counts[b] += 1
            return list(block_ids)

    message = check_fails("lab07.fork", Unchecked)
    assert "[lab07 task 3" in message and "fork raised the wrong exception" in message, message
    assert "got IndexError" in message and f"hint: {MISSED['exception']}" in message


def test_a_fork_that_counts_a_repeated_id_once_fails_the_rule_that_it_counts_twice(pool):
    class Distinct(pool):
        def fork(self, block_ids):
            shared = super().fork(sorted(set(block_ids)))  # a block listed twice gains one holder
            return list(block_ids) if shared is not None else shared

    message = check_fails("lab07.fork", Distinct)
    assert "reference counts differ from the reference pool's" in message, message
    assert f"hint: {MISSED['counts']['fork']}" in message and "twice for a block listed twice" in message


def test_a_prepare_write_without_the_id_check_fails_the_rule_that_a_bad_id_raises(pool):
    class Unchecked(pool):
        def prepare_write(self, block_id):
            if self.ref_counts[block_id] == 0:
                raise ValueError("free")
            if self.ref_counts[block_id] == 1:
                return block_id, None
            (new_id,) = self.allocate(1)
            self.ref_counts[block_id] -= 1
            return new_id, block_id

    message = check_fails("lab07.copy_on_write", Unchecked)
    assert "[lab07 task 4" in message and "prepare_write raised the wrong exception" in message, message
    assert "got IndexError" in message


STEP_CHECKS = ("lab07.forward_step", "lab07.forward_step_scheduled")


def _forward_step(old: str, new: str):
    """The instructor's forward_step with one line of its source replaced (the edit must apply once)."""
    source = answer_cells(SOLUTION)["forward_step"]
    assert source.count(old) == 1, old
    namespace = {"torch": torch}
    exec(source.replace(old, new), namespace)
    return namespace["forward_step"]


def test_the_instructor_step_passes_both_step_checks():
    step = solution_namespace(SOLUTION, Counter=Counter, deque=deque)["forward_step"]
    for check_id in STEP_CHECKS:
        check(check_id, step)


@pytest.mark.parametrize(
    "old, new, what, hint",
    [
        pytest.param(
            "* block_size + p % block_size for p",
            "* block_size + p % block_size + 1 for p",
            "the step wrote keys or values into other slots than its tokens' own",
            SLOT_HINT,
            id="a slot mapping one offset too far",
        ),
        pytest.param(
            "        positions += range(first, last)\n",
            "        positions += range(last - first)\n",
            "the keys or values written differ",
            POSITIONS_HINT,
            id="positions that restart at 0 for a continued chunk",
        ),
        pytest.param(
            "        k_rows[slots] = k[0].transpose(0, 1).to(k_rows.dtype)\n",
            "        k_rows[slots] = attn.k_proj(h).view(1, total, config.n_kv_heads, hd)[0].to(k_rows.dtype)\n",
            "the keys or values written differ",
            ROPE_HINT,
            id="keys stored before RoPE",
        ),
        pytest.param(
            "    last_rows = [row + n - 1 for (row, n, _), (_, scheduled) in zip(parts, batch) if scheduled.samples]\n",
            "    last_rows = list(range(total))\n",
            "the step returned another number of rows of logits than sequences that sample",
            SAMPLING_HINT,
            id="logits for every token",
        ),
        pytest.param(
            "    last_rows = [row + n - 1 for (row, n, _), (_, scheduled) in zip(parts, batch) if scheduled.samples]\n",
            "    last_rows = [row + n - 1 for (row, n, _), (_, scheduled) in zip(parts, batch) if scheduled.samples]\n"
            "    if not last_rows:\n"
            "        return torch.empty(0)\n",
            "the step returned logits of another shape",
            SHAPE_HINT,
            id="no logits of vocab columns where no sequence samples",
        ),
    ],
)
def test_a_usual_slip_in_the_step_fails_both_step_checks_with_its_own_hint(old, new, what, hint):
    step = _forward_step(old, new)
    for check_id in STEP_CHECKS:
        message = check_fails(check_id, step)
        assert f"{check_id} failed [lab07 task 5: forward_step]" in message, message
        assert what in message and f"hint: {hint}" in message, message
