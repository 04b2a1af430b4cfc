"""Lab 18 task 2's checks: the course's answer resumes a killed job exactly, each usual mistake of a checkpoint fails
with the hint written for it, an untouched answer fails cleanly, and no process outlives a check.

Each mistake is the course's answer with one idea taken out (its source with lines replaced), run against the check
that should catch it. The answer is read from the lab's cell file until the lab notebook is assembled."""

from __future__ import annotations

import functools
import random

import psutil
import pytest
from conftest import REPO, answer_cells

from grading import check
from grading.check import INTERACTIVE_SEED, drive, judge
from grading.checks.lab18 import task2_resume as resume
from grading.registry import get_check

SOLUTION = REPO / "solutions" / "lab18_resilient_training" / "lab18_resilient_training.ipynb"


def _answer_source() -> str:
    return answer_cells(SOLUTION)["task2_checkpoint"]


def variant(*replacements: tuple[str, str]) -> dict:
    """The answer's two functions with each (old, new) replacement made, as a check receives them."""
    source = _answer_source()
    for old, new in replacements:
        assert source.count(old) == 1, f"the answer no longer holds {old!r}"
        source = source.replace(old, new)
    namespace: dict = {}
    exec(compile(source, "<task2_checkpoint>", "exec"), namespace)  # noqa: S102 - the course's own answer, changed
    return {"save_checkpoint": namespace["save_checkpoint"], "load_checkpoint": namespace["load_checkpoint"]}


@functools.cache
def _expected(check_id: str):
    """The reference's outcome on the interactive inputs: played once for all the mistakes run against a check."""
    registered = get_check(check_id)
    return drive(registered, registered.reference(), registered.inputs(INTERACTIVE_SEED))


def verdict(check_id: str, pair):
    """What ``check(check_id, pair)`` decides, the reference's side played once per check."""
    registered = get_check(check_id)
    inputs = registered.inputs(INTERACTIVE_SEED)
    return judge(registered, drive(registered, pair, inputs), _expected(check_id), inputs)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_task2_the_answer_resumes_every_job_exactly_and_leaves_no_process():
    before = _children()
    pair = variant()
    for check_id in ("lab18.resume_exact", "lab18.resume_edges", "lab18.resume_atomic"):
        check(check_id, pair)
    assert _children() <= before


def test_task2_the_killed_job_really_lost_steps_and_resumed_from_its_checkpoint():
    case = resume.exact_cases(random.Random(3))[0]
    played = resume.play_job(*variant().values(), case)
    ((life, rank, step),) = case["kills"]
    killed = [e for e in played["ranks"][rank]["events"] if e["event"] == "killed"]
    assert [e["step"] for e in killed] == [step]
    starts = [e["step"] for e in played["ranks"][0]["events"] if e["event"] == "start"]
    assert starts == [0, 8]  # the second life resumed after the checkpoint of step 8
    steps = [r["step"] for r in played["ranks"][0]["records"]]
    assert steps == list(range(1, step)) + list(range(9, 13))  # the killed step and those before it, again
    assert played["codes"][0][rank] == -9 and played["codes"][-1] == [0, 0]


_SAVE_DATA = ('        "data": run.loader.state_dict(),\n', "")
_LOAD_DATA = ('    run.loader.load_state_dict(snapshot["data"])\n', "")
_SAVE_RNG = ('        "torch_rng": torch.get_rng_state(),\n', "")
_LOAD_RNG = ('    torch.set_rng_state(snapshot["torch_rng"])\n', "")
_SAVE_ADAMW = ('        "adamw": run.optimizer.state_dict(),\n', "")
_LOAD_ADAMW = ('    run.optimizer.load_state_dict(snapshot["adamw"])\n', "")
_STEP = '    run.step = snapshot["steps_done"]\n'

MISTAKES = {
    "the data position not saved": ((_SAVE_DATA, _LOAD_DATA), "lab18.resume_exact", resume.HINTS["batch"]),
    "the RNG state not saved": ((_SAVE_RNG, _LOAD_RNG), "lab18.resume_exact", resume.HINTS["rng"]),
    "the optimizer state not saved": ((_SAVE_ADAMW, _LOAD_ADAMW), "lab18.resume_exact", resume.HINTS["moments"]),
    "the weights not restored": (
        (('    run.model.load_state_dict(snapshot["weights"])\n', ""),),
        "lab18.resume_exact",
        resume.HINTS["weights"],
    ),
    "the step counter one ahead (a step skipped)": (
        ((_STEP, '    run.step = snapshot["steps_done"] + 1\n'),),
        "lab18.resume_exact",
        resume.STEP_HINT,
    ),
    "the step counter not restored (steps repeated)": (((_STEP, ""),), "lab18.resume_exact", resume.STEP_HINT),
    "a save that draws from the RNG": (
        (("    os.replace(partial, path)", "    torch.rand(1)\n    os.replace(partial, path)"),),
        "lab18.resume_exact",
        resume.SIDE_EFFECT_HINT,
    ),
    "no file taken for a checkpoint": (
        (("    if not os.path.isfile(path):\n        return  # no checkpoint yet: the job starts from scratch\n", ""),),
        "lab18.resume_edges",
        resume.SCRATCH_HINT,
    ),
    "written in place, not atomically": (
        (
            (
                'fd, partial = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".partial-")',
                "fd, partial = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), path",
            ),
        ),
        "lab18.resume_atomic",
        resume.ATOMIC_HINT,
    ),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_task2_each_mistake_fails_with_its_hint(mistake):
    replacements, check_id, hint = MISTAKES[mistake]
    before = _children()
    found = verdict(check_id, variant(*replacements))
    assert not found.passed and found.hint == hint, (found.what, found.detail, found.hint)
    assert _children() <= before


def test_task2_an_untouched_answer_fails_cleanly():
    def save_checkpoint(path, run):
        raise NotImplementedError("lab18 task 2: the checkpoint and resume of a training loop")

    def load_checkpoint(path, run):
        raise NotImplementedError("lab18 task 2: the checkpoint and resume of a training loop")

    before = _children()
    found = verdict("lab18.resume_exact", {"save_checkpoint": save_checkpoint, "load_checkpoint": load_checkpoint})
    assert found.kind == "error" and found.what == f"your code raised NotImplementedError: {resume.TASK}", found.what
    assert _children() <= before


def test_task2_a_pair_that_is_not_a_dict_is_refused_by_name():
    found = verdict("lab18.resume_exact", variant()["save_checkpoint"])
    assert found.kind == "error" and "check the pair as a dict" in found.what
