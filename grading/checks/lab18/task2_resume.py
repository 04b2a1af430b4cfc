"""Lab 18 task 2: ``save_checkpoint(path, run)`` and ``load_checkpoint(path, run)``, the checkpoint and resume of
the course's training loop (``infra_lib.training.elastic.train_loop``), graded by killing a worker.

The check plays a small job as ``torchrun`` would: each rank a process forked from the kernel (so the learner's
functions travel with it), averaging their gradients through a file store (the sandbox has no network for gloo); the
loop calls the learner's
``load_checkpoint`` first and ``save_checkpoint`` after every ``every``-th step. A rank SIGKILLs itself in the
middle of a seeded step; the check then stops the other ranks and starts the whole group again, every rank
resuming from its checkpoint, until the job finishes. The reference side plays the same job with the course's
functions, whose records are the uninterrupted job's.

Every step leaves a record in a log that survives the kill: the step's number, its global batch of sample indices,
digests of the weights, of the optimizer's state and of torch's global generator as the step starts, and its loss.
The comparison walks the killed job's records against the uninterrupted job's, step by step: the first field that
differs names the state the checkpoint lost (the weights, the data position, the RNG, the optimizer's moments), a
life that starts at another step than the one after the last checkpoint names the step counter, and the final
parameters must be the same bits.
"""

from __future__ import annotations

import functools
import io
import os
import random
import signal
import tempfile
from pathlib import Path

from grading.checks.lab18.tasks import RESUME_SECTION, TASKS
from grading.registry import Check, Mismatch, register

TASK = TASKS[2]
CASE_TIMEOUT_S = 60.0  # one job, every life; a life of these runs takes well under a second of work
FIELDS = ("weights", "batch", "rng", "moments", "loss")

EXACT_HINT = (
    "a resumed run must continue exactly as if it had never stopped: the checkpoint holds everything the next step "
    f"depends on, and loading it brings all of that back ({RESUME_SECTION})"
)
HINTS = {
    "weights": "the weights are the first thing a checkpoint holds: load_checkpoint puts them back into run.model",
    "batch": (
        "the data position: the loader is part of the state. After a resume the next step must train on the samples "
        "the uninterrupted run would have reached (the same epoch's order, from the same place in it, and the same "
        "orders for the epochs after it), not restart the data from its beginning"
    ),
    "rng": (
        "the random number generator's state: the loop's dropout draws from torch's global generator, so a resumed "
        "rank must continue that generator's sequence where the checkpoint left it, not from the seed"
    ),
    "moments": (
        "the optimizer's state: AdamW keeps two running moments and a step count per parameter, and the next update "
        "depends on them as much as on the weights; restored weights with fresh moments take a different step"
    ),
    "loss": EXACT_HINT,
}
STEP_HINT = (
    "the step counter is state too: a resumed run continues with the step after the last one its checkpoint holds, so "
    "it neither repeats a step nor skips one; check what run.step means when you save it and when you load it"
)
RESTORE_HINT = (
    "when the checkpoint file exists, load_checkpoint brings the run back to the state it holds; the job only starts "
    "from scratch when no checkpoint was ever written"
)
SCRATCH_HINT = (
    "a job killed before its first checkpoint restarts with no file at path: load_checkpoint then leaves the run as "
    "it is, and training starts from scratch"
)
ATOMIC_HINT = (
    "a process can die in the middle of save_checkpoint: write the new checkpoint where a reader never looks and "
    "put it in place in one step, so that path always holds a whole checkpoint, the new one or the previous one"
)
TORCH_SAVE_HINT = "save_checkpoint writes its file with torch.save (the lab's contract), which this check watches"
SIDE_EFFECT_HINT = (
    "saving must not change what the run does next: save_checkpoint reads the state, it draws no random numbers and "
    "moves neither the loader nor the step"
)
ERROR_HINT = EXACT_HINT


def _case(rng: random.Random, world: int, steps: int, every: int, kills: list, kill_in_save=None) -> dict:
    """``kills``: (life, rank, step) triples, the rank SIGKILLing itself during that step of that life (life 0 is
    the first); ``kill_in_save``: the step after which rank 0's save in the first life dies halfway through its
    torch.save."""
    return {
        "world": world,
        "steps": steps,
        "every": every,
        "kills": [list(k) for k in kills],
        "kill_in_save": kill_in_save,
        "seed": rng.randrange(10**6),
    }


def exact_cases(rng: random.Random) -> list[dict]:
    """Two ranks, a checkpoint every 4 steps (an epoch is 5): one rank killed two or three steps past the
    checkpoint of step 8, in the loader's second epoch."""
    return [_case(rng, 2, 12, 4, [(0, rng.randrange(2), rng.choice([10, 11]))])]


def edge_cases(rng: random.Random) -> list[dict]:
    """A kill before the first checkpoint (no file yet), and a job killed twice: once in its first life and
    again after it resumed and saved anew."""
    return [
        _case(rng, 2, 7, 4, [(0, rng.randrange(2), rng.choice([2, 3]))]),
        _case(rng, 2, 13, 3, [(0, 0, rng.choice([5, 6])), (1, 1, rng.choice([11, 12]))]),
    ]


def atomic_cases(rng: random.Random) -> list[dict]:
    """One rank killed in the middle of writing its second checkpoint."""
    return [_case(rng, 1, 10, 3, [], kill_in_save=6)]


def describe(case: dict) -> str:
    kills = "; ".join(
        f"rank {rank} killed during step {step} of the {_life(life)} life" for life, rank, step in case["kills"]
    )
    if case["kill_in_save"]:
        kills = f"rank 0 killed while saving the checkpoint of step {case['kill_in_save']}"
    return (
        f"{case['world']} rank(s), {case['steps']} steps, a checkpoint every {case['every']} steps, {kills}, "
        f"seed={case['seed']}"
    )


def expected_starts(case: dict) -> dict[int, int]:
    """life -> the steps done when it starts: what the last whole checkpoint before the previous life died holds."""
    starts = {0: 0}
    for life, _, step in case["kills"]:
        starts[life + 1] = (step - 1) // case["every"] * case["every"]
    if case["kill_in_save"]:
        starts[1] = case["kill_in_save"] - case["every"]
    return starts


# --- the job: forked ranks, restarted as torchrun restarts them ---------------------------------------------------


def _life(n: int) -> str:
    return ("first", "second", "third", "fourth")[n] if 0 <= n < 4 else f"{n + 1}th"


def _log(path, run):
    from infra_lib.training.elastic import JsonlLog

    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return JsonlLog(Path(path).parent / f"rank{run.rank}.jsonl", rank=run.rank, life=life)


def _arm_torch_save(log, step: int):
    """Make the next torch.save write half its bytes and SIGKILL this process; returns the undo."""
    import torch
    import torch.serialization

    original = torch.save

    def dying_save(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        original(obj, buffer, *args, **kwargs)
        half = buffer.getvalue()[: buffer.tell() // 2]
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as out:
                out.write(half)
        else:
            f.write(half)
            f.flush()
        log({"event": "killed", "step": step, "in_save": True})
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = torch.serialization.save = dying_save

    def undo():
        torch.save = torch.serialization.save = original

    return undo


def _guarded(fn, name: str, kill_in_save: int | None):
    """The learner's function as the loop calls it in a rank: its error logged (and the job ended), and during
    the first life's save of step ``kill_in_save`` on rank 0, a torch.save that dies halfway."""
    from infra_lib.training.elastic_train import GiveUp

    def call(path, run):
        log, step, existed = _log(path, run), run.step, os.path.exists(path)
        armed = name == "save_checkpoint" and step == kill_in_save and run.rank == 0 and log.stamp["life"] == 0
        undo = _arm_torch_save(log, step) if armed else None
        try:
            fn(str(path), run)
        except BaseException as exc:  # noqa: BLE001 - the learner's code may raise anything
            text = f"{exc}"[:300]
            log({"event": "error", "where": name, "step": step, "type": type(exc).__name__, "text": text})
            log({"event": "error_context", "checkpoint_existed": existed})
            raise GiveUp from None
        finally:
            if undo is not None:
                undo()
        if armed:
            log({"event": "no_torch_save", "step": step})

    return call


def play_job(save, load, case: dict) -> dict:
    """Run the case's job with these two functions; per rank its step records, events and final digest."""
    from infra_lib.training.elastic import read_jsonl
    from infra_lib.training.elastic_train import run_forked

    job = {key: case[key] for key in ("world", "steps", "every", "seed", "kills")}
    if case["kill_in_save"]:
        job["kills"] = [[0, 0, None]]  # one planned death: one restart more
    with tempfile.TemporaryDirectory(prefix="lab18-resume-") as scratch:
        played = run_forked(
            job,
            scratch,
            _guarded(save, "save_checkpoint", case["kill_in_save"]),
            _guarded(load, "load_checkpoint", None),
            timeout_s=CASE_TIMEOUT_S,
        )
        ranks = []
        for rank in range(case["world"]):
            entries = read_jsonl(Path(scratch) / f"rank{rank}.jsonl")
            records = [{k: e[k] for k in ("life", "step", *FIELDS)} for e in entries if "event" not in e]
            events = [{k: v for k, v in e.items() if k != "t"} for e in entries if "event" in e]
            done = [e["digest"] for e in events if e["event"] == "done"]
            ranks.append({"records": records, "events": events, "digest": done[-1] if done else None})
    return {**played, "ranks": ranks}


@functools.cache
def course_resume() -> dict:
    """The course's save_checkpoint and load_checkpoint: the reference side."""
    from infra_lib.training.elastic import load_checkpoint, save_checkpoint

    return {"save_checkpoint": save_checkpoint, "load_checkpoint": load_checkpoint}


course_resume.target = "infra_lib.training.elastic:save_checkpoint"  # what a sandboxed kernel sees as a stub


def _functions(implementation) -> tuple:
    if type(implementation) is not dict or not all(
        callable(implementation.get(name)) for name in ("save_checkpoint", "load_checkpoint")
    ):
        raise TypeError(
            "check the pair as a dict: {'save_checkpoint': save_checkpoint, 'load_checkpoint': load_checkpoint}"
        )
    return implementation["save_checkpoint"], implementation["load_checkpoint"]


def drive_resume(implementation, cases: list[dict]) -> list[dict]:
    save, load = _functions(implementation)
    out = []
    for case in cases:
        # Both sides play the same job, kills included: the course's resume is exact (tests/test_elastic.py holds
        # its killed jobs to the uninterrupted one's bits), so its records are the uninterrupted run's, step by step.
        result = play_job(save, load, case)
        stub = next(
            (
                e
                for rank in result["ranks"]
                for e in rank["events"]
                if e["event"] == "error" and e["type"] == "NotImplementedError"
            ),
            None,
        )
        if stub is not None:
            raise NotImplementedError(stub["text"])
        out.append(result)
    return out


# --- the comparison -------------------------------------------------------------------------------------------


def _error_mismatch(rank: int, events: list[dict], case: dict, where: str) -> Mismatch | None:
    for i, e in enumerate(events):
        if e["event"] != "error":
            continue
        existed = next((x["checkpoint_existed"] for x in events[i + 1 :] if x["event"] == "error_context"), True)
        said = f"on {where}: rank {rank}, {_life(e['life'])} life, {e['step']} steps done: {e['type']}: {e['text']}"
        if e["where"] == "load_checkpoint" and not existed:
            return Mismatch("load_checkpoint raised when no checkpoint had been written yet", said, hint=SCRATCH_HINT)
        if e["where"] == "load_checkpoint" and case["kill_in_save"]:
            return Mismatch(
                "load_checkpoint raised on what a kill during save_checkpoint left at path", said, hint=ATOMIC_HINT
            )
        return Mismatch(f"your {e['where']} raised {e['type']}", said, hint=ERROR_HINT)
    return None


def _show(field: str, value) -> str:
    return f"samples {value}" if field == "batch" else f"{value!r}"


def _field_mismatch(rank: int, got: dict, want: dict, field: str, starts: dict, where: str) -> Mismatch:
    life, step = got["life"], got["step"]
    resumed = life > 0
    names = {
        "weights": "the weights",
        "batch": "the batch",
        "rng": "torch's global generator",
        "moments": "AdamW's state",
        "loss": "the loss",
    }
    detail = (
        f"on {where}: rank {rank}, step {step} ({_life(life)} life"
        + (f", resumed after step {starts.get(life, 0)}" if resumed else "")
        + f"): {names[field]} {_show(field, got[field])} where the uninterrupted run has {_show(field, want[field])}"
    )
    if not resumed:
        return Mismatch(
            f"{names[field]} of a step differ from the uninterrupted run's before any rank was killed",
            detail,
            hint=SIDE_EFFECT_HINT,
        )
    what = {
        "weights": "starts from other weights than",
        "batch": "trains on another batch than",
        "rng": "draws its dropout from another state of torch's global generator than",
        "moments": "starts from another optimizer state than",
        "loss": "has another loss than",
    }[field]
    what = f"after the resume, a step {what} the uninterrupted run's"
    return Mismatch(what, detail, hint=HINTS[field])


def _start_mismatch(rank: int, events: list, records: list, want: dict, case: dict, where: str) -> Mismatch | None:
    starts = expected_starts(case)
    for e in events:
        if e["event"] != "start" or e["life"] == 0 or e["life"] not in starts:
            continue
        should = starts[e["life"]]
        if e["step"] == should:
            continue
        detail = (
            f"on {where}: rank {rank}'s {_life(e['life'])} life resumed with run.step = {e['step']} (its next step "
            f"{e['step'] + 1}); the last whole checkpoint holds {should} steps done (the next step {should + 1})"
        )
        first = next((r for r in records if r["life"] == e["life"]), None)
        fresh = first is not None and first["weights"] == want[1]["weights"] and should > 0
        if case["kill_in_save"] and e["step"] < should:
            what = "the resume did not find the checkpoint written before the one cut short"
            return Mismatch(what, detail, hint=ATOMIC_HINT)
        if e["step"] == 0 and fresh:
            what = "the resumed run started from scratch although a checkpoint existed"
            return Mismatch(what, detail, hint=RESTORE_HINT)
        return Mismatch(
            f"the resumed run {'repeats' if e['step'] < should else 'skips'} a step", detail, hint=STEP_HINT
        )
    return None


def _judge_case(got: dict, expected: dict, case: dict) -> Mismatch | None:
    where = describe(case)
    if got["timed_out"]:
        return Mismatch(
            "the job did not finish", f"on {where}: still running after {CASE_TIMEOUT_S:g} s", hint=EXACT_HINT
        )
    for rank, mine in enumerate(got["ranks"]):
        found = _error_mismatch(rank, mine["events"], case, where)
        if found:
            return found
    if case["kill_in_save"] and not any(
        e["event"] == "killed" and e.get("in_save") for mine in got["ranks"] for e in mine["events"]
    ):
        return Mismatch(
            "the rank to be killed inside torch.save during save_checkpoint was not",
            f"on {where}: save_checkpoint of step {case['kill_in_save']} made no call of torch.save",
            hint=TORCH_SAVE_HINT,
        )
    for rank, (mine, theirs) in enumerate(zip(got["ranks"], expected["ranks"])):
        want = {r["step"]: r for r in theirs["records"]}
        found = _start_mismatch(rank, mine["events"], mine["records"], want, case, where)
        if found:
            return found
        for record in mine["records"]:
            other = want.get(record["step"])
            if other is None:
                return Mismatch(
                    f"rank {rank} trained a step past the last", f"on {where}: step {record['step']}", hint=STEP_HINT
                )
            field = next((f for f in FIELDS if record[f] != other[f]), None)
            if field:
                return _field_mismatch(rank, record, other, field, expected_starts(case), where)
        last = mine["records"][-1]["step"] if mine["records"] else 0
        if last != case["steps"] or mine["digest"] is None:
            crash = next((e["text"] for e in reversed(mine["events"]) if e["event"] == "crash"), "")
            return Mismatch(
                "the job did not finish",
                f"on {where}: rank {rank}'s last step was {last} of {case['steps']} after {len(got['codes'])} "
                f"lives (exit codes {got['codes']})" + (f"; its last error: {crash}" if crash else ""),
                hint=EXACT_HINT,
            )
        if mine["digest"] != theirs["digest"]:
            return Mismatch(
                "the final parameters differ from the uninterrupted run's",
                f"on {where}: rank {rank}'s digest {mine['digest']}, expected {theirs['digest']}",
                hint=EXACT_HINT,
            )
    return None


def compare_resume(got, expected, cases: list[dict]) -> Mismatch | None:
    if type(got) is not list or len(got) != len(cases):
        return Mismatch("the check recorded the wrong number of cases")
    for mine, theirs, case in zip(got, expected, cases):
        found = _judge_case(mine, theirs, case)
        if found:
            return found
    return None


register(
    Check(
        check_id="lab18.resume_exact",
        task=TASK,
        reference=course_resume,
        make_inputs=exact_cases,
        drive=drive_resume,
        compare=compare_resume,
        hint=EXACT_HINT,
    )
)

register(
    Check(
        check_id="lab18.resume_edges",
        task=TASK,
        reference=course_resume,
        make_inputs=edge_cases,
        drive=drive_resume,
        compare=compare_resume,
        hint=EXACT_HINT,
    )
)

register(
    Check(
        check_id="lab18.resume_atomic",
        task=TASK,
        reference=course_resume,
        make_inputs=atomic_cases,
        drive=drive_resume,
        compare=compare_resume,
        hint=ATOMIC_HINT,
    )
)
