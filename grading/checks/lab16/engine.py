"""What every capstone check shares: the learner's pieces taken from their lab functions, the
course's pieces filling in, and SmolLM2 served by the assembled engine on seeded requests."""

from __future__ import annotations

import random

from grading.checks.common import one_thread, token_difference
from grading.registry import Mismatch

# lab -> its pieces, in the engine's order: the seams of infra_lib.serving.pieces.PIECES (a test holds them
# equal), spelled out here because registering the checks must not import torch
LABS: dict[str, tuple[str, ...]] = {
    "lab06_kv_cache": ("Llama", "cached_attention"),
    "lab07_paged_kv": ("BlockPool", "forward_step"),
    "lab08_scheduler": ("schedule", "engine_step"),
    "lab09_spec_quant": ("accept_or_resample",),
}
LAB_OF = {name: lab for lab, names in LABS.items() for name in names}
ENGINE_PIECES = tuple(name for name in LAB_OF if name != "accept_or_resample")  # the engine does not speculate

TASKS = {
    1: "lab16 task 1: lab06_kv_cache",
    2: "lab16 task 2: lab07_paged_kv",
    3: "lab16 task 3: lab08_scheduler",
    4: "lab16 task 4: lab09_spec_quant",
    5: "lab16 task 5: the assembled engine",
}
TASK_OF = {lab: TASKS[i] for i, lab in enumerate(LABS, start=1)}


def _course_lab(lab):
    def pieces():
        raise RuntimeError(f"the course's side of a capstone check takes the course's {LABS[lab]}, not a function's")

    pieces.__name__ = lab
    return pieces


# The reference side: the same four names, standing for the course's pieces (pieces_of knows this dict).
COURSE = {lab: _course_lab(lab) for lab in LABS}


def course():
    return COURSE


QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "What is Python?",
    "Give me a word that rhymes with cat.",
    "What colour is the sky on a clear day?",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Name a planet in the solar system.",
    "Write a short title for a story about the sea.",
    "What is the opposite of cold?",
]


def model():
    from infra_lib.model.loaders import load_default

    return load_default()


def _course_pieces() -> dict:
    """Each piece's course objects: a learner's piece that is one of them (or a subclass of the course's
    class) is the course's own."""
    from infra_lib.model.attention import attention, cached_attention
    from infra_lib.model.model import Llama
    from infra_lib.serving.block_pool import BlockPool
    from infra_lib.serving.engine import LLMEngine, engine_step
    from infra_lib.serving.model_runner import ModelRunner
    from infra_lib.serving.scheduler import Scheduler
    from infra_lib.serving.speculative import accept_or_resample

    return {
        "Llama": (Llama,),
        "cached_attention": (cached_attention, attention),
        "BlockPool": (BlockPool,),
        "forward_step": (ModelRunner.forward,),
        "schedule": (Scheduler.schedule,),
        "engine_step": (LLMEngine.step, engine_step),
        "accept_or_resample": (accept_or_resample,),
    }


def _is_course(name: str, piece, course: dict) -> bool:
    if any(piece is c for c in course[name]):
        return True
    return isinstance(piece, type) and any(isinstance(c, type) and issubclass(piece, c) for c in course[name])


def pieces_of(implementation, names, *, fill: bool = False) -> dict:
    """The learner's pieces ``names`` from their lab functions (``{}`` for the course's side).

    Without ``fill`` every piece asked for must be there: a blank cell raises its stub's
    NotImplementedError, which the check reports as that task not started. With ``fill`` (the assembled
    engine) a lab not started, or a piece whose task is not written yet, is left out: the course's
    piece fills in for it, as it does in ``infra-lab capstone build`` and ``infra-lab serve``.
    """
    from infra_lib.serving.pieces import probe

    if implementation is COURSE:
        return {}
    if type(implementation) is not dict:
        raise TypeError(
            f"check(...) needs the dict of your lab functions (engine_labs), got a {type(implementation).__name__}"
        )
    course, pieces = _course_pieces(), {}
    for lab in dict.fromkeys(LAB_OF[name] for name in names):
        fn = implementation.get(lab)
        if fn is None and fill:
            continue
        if not callable(fn):
            raise TypeError(f"engine_labs[{lab!r}] must be your {lab} function, got {type(fn).__name__}")
        try:
            got = fn()
        except NotImplementedError:
            if fill:
                continue
            raise
        if type(got) is not dict:
            raise ValueError(f"{lab}() must return a dict of your pieces, got a {type(got).__name__}")
        for name in (n for n in names if LAB_OF[n] == lab):
            piece = got.get(name)
            if piece is None:
                if fill:
                    continue
                raise ValueError(f"{lab}() must return a dict with your {name}, got {sorted(got)}")
            if _is_course(name, piece, course):
                raise ValueError(f"{lab}()'s {name} is the course's own; the capstone runs yours")
            if fill and probe(name, piece) is not None:
                continue  # not written yet: the course's fills in
            pieces[name] = piece
    return pieces


def assembled_pieces(implementation) -> dict:
    """Task 5's pieces: every engine piece of the learner's that is written, the course's for the rest;
    at least one must be the learner's (else the engine is the course's and there is nothing to grade: the
    task is reported as not started)."""
    pieces = pieces_of(implementation, ENGINE_PIECES, fill=True)
    if implementation is not COURSE and not pieces:
        raise NotImplementedError(TASKS[5])  # as a stub says it: the grader reports the task not started
    return pieces


def config(c: dict):
    from infra_lib.serving.scheduler_output import SchedulerConfig

    return SchedulerConfig(
        max_num_seqs=c["max_num_seqs"],
        max_num_batched_tokens=c["budget"],
        block_size=c["block_size"],
        num_blocks=c["num_blocks"],
        enable_prefix_caching=False,
    )


def prompts(tokenizer, questions):
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]


_COURSE_RUNS: dict[str, dict] = {}  # the course's engine's results by case: several checks draw the same case


def served(implementation, pieces: dict, case) -> dict:
    """``run_engine(pieces, case)``; on the course's side (``implementation is COURSE``) the result of an
    earlier run of the same case when there was one (the course's engine is deterministic on a case, and
    tasks 1-5 share their fixed cases)."""
    if implementation is not COURSE:
        return run_engine(pieces, case)
    import json

    key = json.dumps(case, sort_keys=True)
    if key not in _COURSE_RUNS:
        _COURSE_RUNS[key] = run_engine({}, case)
    return dict(_COURSE_RUNS[key])


def run_engine(pieces, case, *, invariants=True) -> dict:
    """Every request of ``case`` through the engine, on one torch thread; aborts at the given steps; books
    checked each step."""
    with one_thread():
        return _served(pieces, case, invariants)


def _served(pieces, case, invariants: bool) -> dict:
    import torch

    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving.pieces import assemble

    loaded = model()
    engine = assemble(loaded.model, loaded.tokenizer, config(case["config"]), pieces)
    ids = [
        engine.add_request(p, SamplingParams(max_new_tokens=n))
        for p, n in zip(prompts(loaded.tokenizer, case["questions"]), case["new_tokens"])
    ]
    aborts = {step: rid for rid, step in case.get("aborts", {}).items()}
    violation, steps = "", 0
    with torch.inference_mode():
        while engine.has_unfinished():
            if steps in aborts:
                engine.abort(ids[int(aborts[steps])])
            engine.step()
            steps += 1
            if invariants and not violation:
                try:
                    engine.check_invariants()
                except AssertionError as exc:
                    violation = f"after step {steps}: {exc}"[:300]
            if steps > 2000:
                raise RuntimeError("the engine ran 2000 steps without finishing every request")
    pool = engine.scheduler.pool
    return {
        "tokens": [engine.output(i).token_ids if engine.output(i).finish_reason != "abort" else None for i in ids],
        "texts": [engine.output(i).text for i in ids],
        "num_free": pool.num_free,
        "num_blocks": pool.num_blocks,
        "violation": violation,
        "held": sorted(b for b in range(pool.num_blocks) if pool.ref_count(b) != 0),
        "preemptions": sum(engine.output(i).metrics.num_preemptions for i in ids),
    }


def where(case) -> str:
    c = case["config"]
    return (
        f"SmolLM2 with max_num_seqs={c['max_num_seqs']}, a budget of {c['budget']} tokens, {c['num_blocks']} "
        f"blocks of {c['block_size']}, {len(case['questions'])} requests"
    )


def compare_engine(got, expected, case):
    at = where(case)
    if got["violation"]:
        return Mismatch(
            "the engine's books broke during the run",
            f"on {at}: {got['violation']}",
            hint="the engine checks the scheduler's and the pool's books after every step: a block "
            "counted by the pool but held by no table (or the reverse) is a leak or a double free.",
        )
    if got["num_free"] != got["num_blocks"] or got["held"]:
        return Mismatch(
            "blocks are still held once every request has finished or been aborted",
            f"on {at}: {got['num_blocks'] - got['num_free']} of {got['num_blocks']} blocks not free, "
            f"held: {got['held'][:12]}",
            hint="every way a request ends (finished, stopped, aborted, preempted and recomputed) must "
            "give each of its blocks back exactly once.",
        )
    for i, (g, e) in enumerate(zip(got["tokens"], expected["tokens"])):
        if g != e:
            if g is None or e is None:
                return Mismatch("a request was aborted in one engine and not in the other", f"on {at}: request {i}")
            return Mismatch(
                "your engine answered a request with other tokens than the course's engine",
                f"on {at}: request {i} ({case['questions'][i]!r}): {token_difference(g, e)}",
            )
    return None


def engine_case(rng: random.Random, *, n: int, tight: bool = False, aborts: int = 0) -> dict:
    questions = rng.sample(QUESTIONS, n)
    new_tokens = [rng.randint(4, 9) for _ in questions]
    c = {
        "max_num_seqs": rng.choice((2, 3, 4)),
        "budget": rng.choice((24, 32, 48)),
        "block_size": 8,
        "num_blocks": rng.randint(14, 18) if tight else 64,
    }
    case = {"questions": questions, "new_tokens": new_tokens, "config": c}
    if aborts:
        case["aborts"] = {str(i): rng.randint(1, 12) for i in rng.sample(range(n), aborts)}
    return case


def fixed_case(tight: bool = False):
    def make(rng):
        return {
            "questions": QUESTIONS[:3],
            "new_tokens": [7, 5, 8],
            "config": {"max_num_seqs": 3, "budget": 32, "block_size": 8, "num_blocks": 16 if tight else 64},
        }

    return make
