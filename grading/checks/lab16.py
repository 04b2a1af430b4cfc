"""Capstone checks: the learner's engine, assembled from their labs' pieces, against the course's.

The implementation a check receives is ``{lab id: function}``: the capstone notebook's answer
cells, each returning its lab's pieces (``infra-lab capstone build`` writes them from the lab
notebooks). A check calls the functions it needs, so a blank cell raises its own task's stub, and
runs SmolLM2-135M-Instruct through ``infra_lib.serving.pieces.assemble``. The course's side is the
same driver with the course's pieces, run (under the grader) in the grader's own process.

Tasks 1-4 put one lab's piece into the course's engine at a time, so that a failure names the
piece; task 5 runs all of them together: the same answers, streaming, aborts under load, a
seeded workload, and throughput as a ratio to the course's engine (best of several short runs).
"""

from __future__ import annotations

import random
import threading
import time

from grading.checks.common import token_difference
from grading.registry import Check, Mismatch, register, register_answer_labs, register_shortcuts

_clock = time.perf_counter  # taken before any answer runs: a learner rebinding time.perf_counter changes nothing

LABS = {
    "lab06_kv_cache": "cached_attention",
    "lab07_paged_kv": "BlockPool",
    "lab08_scheduler": "schedule",
    "lab09_spec_quant": "accept_or_resample",
}
_TASKS = {
    1: "lab16 task 1: lab06_kv_cache",
    2: "lab16 task 2: lab07_paged_kv",
    3: "lab16 task 3: lab08_scheduler",
    4: "lab16 task 4: lab09_spec_quant",
    5: "lab16 task 5: the assembled engine",
}
_TASK_OF = {lab: _TASKS[i] for i, lab in enumerate(LABS, start=1)}


def _course_lab(lab):
    def pieces():
        raise RuntimeError(f"the course's side of a capstone check takes the course's {LABS[lab]}, not a function's")

    pieces.__name__ = lab
    return pieces


# The reference side: the same four names, standing for the course's pieces (pieces_of knows this dict).
COURSE = {lab: _course_lab(lab) for lab in LABS}

# The course's engine runs around one learner piece in tasks 1-4, so its pool, scheduler and attention
# cannot be shortcuts while the checks run (pieces_of refuses a piece that is the course's own). Each
# answer cell is scanned with its own lab's rules (ANSWER_LABS); only the acceptance rule, which no
# course code calls while the learner's is in place, is watched as a call.
register_shortcuts("lab16", ["infra_lib.serving.speculative:accept_or_resample"])
register_answer_labs("lab16", {lab: lab for lab in LABS})

_QUESTIONS = [
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


def _course():
    return COURSE


def _model():
    from infra_lib.model.loaders import load_default

    return load_default()


def pieces_of(implementation, labs) -> dict:
    """The pieces of ``labs`` from the learner's functions (``{}`` for the course's side). A blank
    cell raises its stub's NotImplementedError, which the check reports as that task not started."""
    if implementation is COURSE:
        return {}
    if type(implementation) is not dict:
        raise TypeError(
            f"check(...) needs the dict of your lab functions (engine_labs), got a {type(implementation).__name__}"
        )
    from infra_lib.model.attention import attention, cached_attention
    from infra_lib.serving.block_pool import BlockPool
    from infra_lib.serving.scheduler import Scheduler
    from infra_lib.serving.speculative import accept_or_resample

    course = {
        "cached_attention": (cached_attention, attention),
        "BlockPool": (BlockPool,),
        "schedule": (Scheduler.schedule,),
        "accept_or_resample": (accept_or_resample,),
    }
    pieces = {}
    for lab in labs:
        name, fn = LABS[lab], implementation.get(lab)
        if not callable(fn):
            raise TypeError(f"engine_labs[{lab!r}] must be your {lab} function, got {type(fn).__name__}")
        got = fn()
        if type(got) is not dict or got.get(name) is None:
            raise ValueError(
                f"{lab}() must return a dict with your {name}, got "
                f"{sorted(got) if type(got) is dict else type(got).__name__}"
            )
        piece = got[name]
        if any(piece is c for c in course[name]) or (isinstance(piece, type) and issubclass(piece, BlockPool)):
            raise ValueError(f"{lab}()'s {name} is the course's own; the capstone runs yours")
        pieces[name] = piece
    return pieces


def _config(c: dict):
    from infra_lib.serving.scheduler_output import SchedulerConfig

    return SchedulerConfig(
        max_num_seqs=c["max_num_seqs"],
        max_num_batched_tokens=c["budget"],
        block_size=c["block_size"],
        num_blocks=c["num_blocks"],
        enable_prefix_caching=False,
    )


def _prompts(tokenizer, questions):
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]


def _run_engine(pieces, case, *, invariants=True) -> dict:
    """Every request of ``case`` through the engine; aborts at the given steps; books checked each step."""
    import torch

    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving.pieces import assemble

    loaded = _model()
    engine = assemble(loaded.model, loaded.tokenizer, _config(case["config"]), pieces)
    ids = [
        engine.add_request(p, SamplingParams(max_new_tokens=n))
        for p, n in zip(_prompts(loaded.tokenizer, case["questions"]), case["new_tokens"])
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


def _where(case) -> str:
    c = case["config"]
    return (
        f"SmolLM2 with max_num_seqs={c['max_num_seqs']}, a budget of {c['budget']} tokens, {c['num_blocks']} "
        f"blocks of {c['block_size']}, {len(case['questions'])} requests"
    )


def _compare_engine(got, expected, case):
    where = _where(case)
    if got["violation"]:
        return Mismatch(
            "the engine's books broke during the run",
            f"on {where}: {got['violation']}",
            hint="the engine checks the scheduler's and the pool's books after every step: a block "
            "counted by the pool but held by no table (or the reverse) is a leak or a double free.",
        )
    if got["num_free"] != got["num_blocks"] or got["held"]:
        return Mismatch(
            "blocks are still held once every request has finished or been aborted",
            f"on {where}: {got['num_blocks'] - got['num_free']} of {got['num_blocks']} blocks not free, "
            f"held: {got['held'][:12]}",
            hint="every way a request ends (finished, stopped, aborted, preempted and recomputed) must "
            "give each of its blocks back exactly once.",
        )
    for i, (g, e) in enumerate(zip(got["tokens"], expected["tokens"])):
        if g != e:
            if g is None or e is None:
                return Mismatch("a request was aborted in one engine and not in the other", f"on {where}: request {i}")
            return Mismatch(
                "your engine answered a request with other tokens than the course's engine",
                f"on {where}: request {i} ({case['questions'][i]!r}): {token_difference(g, e)}",
            )
    return None


def _engine_case(rng: random.Random, *, n: int, tight: bool = False, aborts: int = 0) -> dict:
    questions = rng.sample(_QUESTIONS, n)
    new_tokens = [rng.randint(4, 9) for _ in questions]
    config = {
        "max_num_seqs": rng.choice((2, 3, 4)),
        "budget": rng.choice((24, 32, 48)),
        "block_size": 8,
        "num_blocks": rng.randint(14, 18) if tight else 64,
    }
    case = {"questions": questions, "new_tokens": new_tokens, "config": config}
    if aborts:
        case["aborts"] = {str(i): rng.randint(1, 12) for i in rng.sample(range(n), aborts)}
    return case


def _drive_for(labs, **options):
    def drive(implementation, case):
        return _run_engine(pieces_of(implementation, labs), case, **options)

    return drive


def _fixed_case(tight: bool = False):
    def make(rng):
        return {
            "questions": _QUESTIONS[:3],
            "new_tokens": [7, 5, 8],
            "config": {"max_num_seqs": 3, "budget": 32, "block_size": 8, "num_blocks": 16 if tight else 64},
        }

    return make


_PIECE_HINTS = {
    "lab06_kv_cache": "the runner calls your cached_attention once per sequence with that sequence's queries (t = its "
    "chunk or 1) and a cache whose append hands back every key and value so far; the mask must place "
    "the t queries at the end of those s positions (chapter 06).",
    "lab07_paged_kv": "the engine allocates, frees and recomputes through your pool under preemption: a pool that "
    "passes "
    "lab 07's checks but fails here usually loses a block when one is freed in the middle of the "
    "free queue (chapter 07).",
    "lab08_scheduler": "the engine runs your plan as it is: each running sequence's blocks must cover exactly its "
    "computed "
    "plus scheduled tokens, and a preempted sequence must not be scheduled in the same step "
    "(chapter 08).",
}


def piece_parts(lab: str) -> dict:
    """The fields of the checks of one lab's piece in the course's engine (tasks 1-3)."""
    return dict(
        task=_TASK_OF[lab], reference=_course, drive=_drive_for((lab,)), compare=_compare_engine, hint=_PIECE_HINTS[lab]
    )


register(Check(check_id="lab16.attention_in_engine", make_inputs=_fixed_case(False), **piece_parts("lab06_kv_cache")))
register(
    Check(
        check_id="lab16.attention_in_engine_random",
        make_inputs=lambda rng: _engine_case(rng, n=3),
        **piece_parts("lab06_kv_cache"),
    )
)
register(Check(check_id="lab16.pool_in_engine", make_inputs=_fixed_case(True), **piece_parts("lab07_paged_kv")))
register(
    Check(
        check_id="lab16.pool_aborts_random",
        make_inputs=lambda rng: _engine_case(rng, n=3, tight=True, aborts=2),
        **piece_parts("lab07_paged_kv"),
    )
)
register(Check(check_id="lab16.scheduler_in_engine", make_inputs=_fixed_case(True), **piece_parts("lab08_scheduler")))
register(
    Check(
        check_id="lab16.scheduler_in_engine_random",
        make_inputs=lambda rng: _engine_case(rng, n=3, tight=True),
        **piece_parts("lab08_scheduler"),
    )
)


# --- task 4: the acceptance rule in speculative decoding ---------------------------------------------


def _drive_speculative(implementation, case):
    import torch

    from infra_lib.serving.pieces import speculate

    rule = pieces_of(implementation, ("lab09_spec_quant",)).get("accept_or_resample")
    loaded = _model()
    out = []
    with torch.inference_mode():
        for prompt in _prompts(loaded.tokenizer, case["questions"]):
            result = speculate(loaded.model, prompt, case["new_tokens"], rule, gamma=case["gamma"])
            out.append({"tokens": result.token_ids, "accepted": result.accepted})
    return out


def _compare_speculative(got, expected, case):
    for i, (g, e) in enumerate(zip(got, expected)):
        where = f"SmolLM2, greedy, prompt lookup draft, gamma={case['gamma']}, {case['questions'][i]!r}"
        if g["tokens"] != e["tokens"]:
            return Mismatch(
                "speculative decoding with your acceptance rule answered with other tokens",
                f"on {where}: {token_difference(g['tokens'], e['tokens'])}",
            )
        if g["accepted"] != e["accepted"]:
            return Mismatch(
                "your rule accepted a different number of draft tokens than the course's",
                f"on {where}: {g['accepted']} accepted, expected {e['accepted']}",
            )
    return None


_SPECULATIVE_HINT = (
    "greedy drafts and targets are one-hot: a draft token is kept exactly when the target's "
    "probability of it is 1, and the first token not kept is replaced by the target's choice "
    "(chapter 09)."
)

register(
    Check(
        check_id="lab16.speculative_answers",
        task=_TASKS[4],
        reference=_course,
        make_inputs=lambda rng: {"questions": [rng.choice(_QUESTIONS)], "new_tokens": 12, "gamma": 4},
        drive=_drive_speculative,
        compare=_compare_speculative,
        hint=_SPECULATIVE_HINT,
    )
)
register(
    Check(
        check_id="lab16.speculative_answers_random",
        task=_TASKS[4],
        reference=_course,
        make_inputs=lambda rng: {
            "questions": rng.sample(_QUESTIONS, 1),
            "new_tokens": rng.randint(8, 14),
            "gamma": rng.randint(2, 5),
        },
        drive=_drive_speculative,
        compare=_compare_speculative,
        hint=_SPECULATIVE_HINT,
    )
)


# --- task 5: the whole engine -------------------------------------------------------------------------

_ALL = tuple(LABS)[:3]  # the engine's pieces (the acceptance rule is task 4's: the engine does not speculate)

register(
    Check(
        check_id="lab16.engine_answers",
        task=_TASKS[5],
        reference=_course,
        make_inputs=_fixed_case(True),
        drive=_drive_for(_ALL),
        compare=_compare_engine,
        hint="each piece passed alone in tasks 1-3 but together they differ: look at the first request that "
        "differs and run tasks 1-3's checks again; a piece that depends on another's private state "
        "(a pool field the scheduler reads directly) breaks only when both are yours.",
    )
)
register(
    Check(
        check_id="lab16.engine_under_load_random",
        task=_TASKS[5],
        reference=_course,
        make_inputs=lambda rng: _engine_case(rng, n=4, tight=True, aborts=2),
        drive=_drive_for(_ALL),
        compare=_compare_engine,
        hint="a seeded workload with preemptions and aborts: every request that is not aborted must get the "
        "same answer as from the course's engine, and every block must come back (chapters 07 and 08).",
    )
)


def _drive_stream(implementation, case):
    """Each request through ``AsyncLLMEngine.generate`` (what the HTTP server streams from): the
    streamed pieces of text joined, the final text, the final tokens."""
    import asyncio

    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving.async_engine import AsyncLLMEngine
    from infra_lib.serving.pieces import assemble

    pieces = pieces_of(implementation, _ALL)
    loaded = _model()
    engine = AsyncLLMEngine(assemble(loaded.model, loaded.tokenizer, _config(case["config"]), pieces)).start()

    async def one(prompt, n):
        streamed, last = [], None
        async for output in engine.generate(prompt, SamplingParams(max_new_tokens=n)):
            streamed.append(output.new_text)
            last = output
        return {"streamed": "".join(streamed), "text": last.text, "tokens": last.token_ids}

    async def all_of():
        return await asyncio.gather(
            *(one(p, n) for p, n in zip(_prompts(loaded.tokenizer, case["questions"]), case["new_tokens"]))
        )

    box: dict = {}

    def on_a_thread():  # a notebook's kernel already runs an event loop on its main thread
        try:
            box["results"] = asyncio.run(all_of())
        except BaseException as exc:  # noqa: BLE001 - handed to the check's thread below
            box["error"] = exc

    thread = threading.Thread(target=on_a_thread, name="capstone-clients", daemon=True)
    try:
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
    finally:
        engine.stop()
    if "error" in box:
        raise box["error"]
    results = box["results"]
    if engine.error is not None:
        raise engine.error
    return results


def _compare_stream(got, expected, case):
    for i, (g, e) in enumerate(zip(got, expected)):
        where = f"{_where(case)}, request {i} ({case['questions'][i]!r})"
        if g["streamed"] != g["text"]:
            return Mismatch(
                "the streamed pieces of text do not join up to the whole answer",
                f"on {where}: streamed {g['streamed']!r}, whole {g['text']!r}",
            )
        if g["tokens"] != e["tokens"]:
            return Mismatch(
                "streamed from your engine, a request got other tokens than from the course's",
                f"on {where}: {token_difference(g['tokens'], e['tokens'])}",
            )
    return None


def _stream_case(rng):
    return {
        "questions": rng.sample(_QUESTIONS, 3),
        "new_tokens": [rng.randint(5, 8) for _ in range(3)],
        "config": {"max_num_seqs": 3, "budget": 32, "block_size": 8, "num_blocks": 64},
    }


register(
    Check(
        check_id="lab16.stream_equals_whole",
        task=_TASKS[5],
        reference=_course,
        make_inputs=_stream_case,
        drive=_drive_stream,
        compare=_compare_stream,
        hint="requests arrive while others run (the server's way): the answers must not depend on what else "
        "is in the batch (chapter 10).",
    )
)


# --- throughput, as a ratio to the course's engine -------------------------------------------------------

_MEASURED: list = []  # (implementation, case, result) of this process's throughput runs


def _drive_throughput(implementation, case):
    """Output tokens per second of the best of ``case['runs']`` short offline runs.

    Both throughput tiers judge one measurement: they draw the same case for a seed (one inputs_group),
    and a second check with the same functions and the same case reuses the first one's runs (the entry keeps
    the functions alive, so their ids stay theirs).
    """
    if type(implementation) is not dict:
        return _measure_throughput(implementation, case)  # pieces_of says what it needs
    key = sorted((lab, id(function)) for lab, function in implementation.items())
    for functions, measured_case, result in _MEASURED:
        if measured_case == case and sorted((lab, id(f)) for lab, f in functions.items()) == key:
            return dict(result)
    result = _measure_throughput(implementation, case)
    _MEASURED.append((dict(implementation), case, result))
    return dict(result)


def _measure_throughput(implementation, case):
    pieces = pieces_of(implementation, _ALL)
    best = 0.0
    _run_engine(pieces, {**case, "new_tokens": [2] * len(case["questions"])}, invariants=False)  # warm up
    for _ in range(case["runs"]):
        start = _clock()
        out = _run_engine(pieces, case, invariants=False)
        seconds = _clock() - start
        best = max(best, sum(len(t) for t in out["tokens"] if t) / seconds)
    return {"tokens_per_s": round(best, 3), "tokens": out["tokens"]}


def throughput_ratio(got, expected) -> float:
    return got["tokens_per_s"] / expected["tokens_per_s"] if expected["tokens_per_s"] > 0 else 0.0


def _compare_throughput(threshold):
    def compare(got, expected, case):
        if type(got) is not dict or type(got.get("tokens_per_s")) not in (int, float):
            return Mismatch("the throughput run returned no measurement")
        if got.get("tokens") != expected.get("tokens"):  # speed counts only for the course's answers
            return Mismatch(
                "the throughput run's answers differ from the course's engine's",
                f"on {_where(case)}: the engine must give the same greedy tokens while it is timed",
            )
        ratio = throughput_ratio(got, expected)
        if ratio < threshold:
            return Mismatch(
                f"your engine's throughput is {ratio:.2f}x the course's engine's; this check needs {threshold:.2f}x",
                f"on {_where(case)}: {got['tokens_per_s']:.1f} against {expected['tokens_per_s']:.1f} "
                "output tokens/s (best of several runs each)",
            )
        return None

    return compare


def _throughput_case(rng):
    return {
        "questions": rng.sample(_QUESTIONS, 4),
        "new_tokens": [8] * 4,
        "runs": 2,
        "config": {"max_num_seqs": 4, "budget": 64, "block_size": 16, "num_blocks": 64},
    }


THROUGHPUT_TIERS = {"lab16.throughput_a_quarter": 1 / 4, "lab16.throughput_half": 1 / 2}


def throughput_parts(check_id: str) -> dict:
    """The fields of a throughput tier's check: both tiers judge one measurement (one inputs_group)."""
    return dict(
        task=_TASKS[5],
        reference=_course,
        make_inputs=_throughput_case,
        drive=_drive_throughput,
        compare=_compare_throughput(THROUGHPUT_TIERS[check_id]),
        inputs_group="lab16.throughput",
        measure=lambda got, expected: {"throughput_ratio": round(throughput_ratio(got, expected), 3)},
        hint="measure where your engine's step spends its time (chapter 16's profile of one step): "
        "work per waiting request in the scheduler, a pool operation that walks every block, or Python "
        "loops per token in attention are the usual places (chapters 07, 08 and 15).",
    )


register(Check(check_id="lab16.throughput_a_quarter", **throughput_parts("lab16.throughput_a_quarter")))
register(Check(check_id="lab16.throughput_half", **throughput_parts("lab16.throughput_half")))
