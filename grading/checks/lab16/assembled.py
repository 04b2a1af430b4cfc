"""Capstone task 5: every engine piece of the learner's at once, the course's filling in for the rest."""

from __future__ import annotations

import threading

from grading.checks.common import token_difference
from grading.checks.lab16.engine import (
    QUESTIONS,
    TASKS,
    assembled_pieces,
    compare_engine,
    config,
    course,
    engine_case,
    fixed_case,
    model,
    one_thread,
    prompts,
    served,
    where,
)
from grading.registry import Check, Mismatch, register


def _drive_assembled(implementation, case):
    return served(implementation, assembled_pieces(implementation), case)


register(
    Check(
        check_id="lab16.engine_answers",
        task=TASKS[5],
        reference=course,
        make_inputs=fixed_case(True),
        drive=_drive_assembled,
        compare=compare_engine,
        hint="each piece passed alone in tasks 1-3 but together they differ: look at the first request that "
        "differs and run tasks 1-3's checks again; a piece that depends on another's private state "
        "(a pool field the scheduler reads directly) breaks only when both are yours.",
    )
)
register(
    Check(
        check_id="lab16.engine_under_load_random",
        task=TASKS[5],
        reference=course,
        make_inputs=lambda rng: engine_case(rng, n=4, tight=True, aborts=2),
        drive=_drive_assembled,
        compare=compare_engine,
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

    pieces = assembled_pieces(implementation)
    loaded = model()
    engine = AsyncLLMEngine(assemble(loaded.model, loaded.tokenizer, config(case["config"]), pieces)).start()

    async def one(prompt, n):
        streamed, last = [], None
        async for output in engine.generate(prompt, SamplingParams(max_new_tokens=n)):
            streamed.append(output.new_text)
            last = output
        return {"streamed": "".join(streamed), "text": last.text, "tokens": last.token_ids}

    async def all_of():
        return await asyncio.gather(
            *(one(p, n) for p, n in zip(prompts(loaded.tokenizer, case["questions"]), case["new_tokens"]))
        )

    box: dict = {}

    def on_a_thread():  # a notebook's kernel already runs an event loop on its main thread
        try:
            box["results"] = asyncio.run(all_of())
        except BaseException as exc:  # noqa: BLE001 - handed to the check's thread below
            box["error"] = exc

    thread = threading.Thread(target=on_a_thread, name="capstone-clients", daemon=True)
    try:
        with one_thread():
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
        at = f"{where(case)}, request {i} ({case['questions'][i]!r})"
        if g["streamed"] != g["text"]:
            return Mismatch(
                "the streamed pieces of text do not join up to the whole answer",
                f"on {at}: streamed {g['streamed']!r}, whole {g['text']!r}",
            )
        if g["tokens"] != e["tokens"]:
            return Mismatch(
                "streamed from your engine, a request got other tokens than from the course's",
                f"on {at}: {token_difference(g['tokens'], e['tokens'])}",
            )
    return None


def _stream_case(rng):
    return {
        "questions": rng.sample(QUESTIONS, 3),
        "new_tokens": [rng.randint(5, 8) for _ in range(3)],
        "config": {"max_num_seqs": 3, "budget": 32, "block_size": 8, "num_blocks": 64},
    }


register(
    Check(
        check_id="lab16.stream_equals_whole",
        task=TASKS[5],
        reference=course,
        make_inputs=_stream_case,
        drive=_drive_stream,
        compare=_compare_stream,
        hint="requests arrive while others run (the server's way): the answers must not depend on what else "
        "is in the batch, and each step's new text is what the step added, once (chapters 08 and 10).",
    )
)
