"""infra_lib.serving.LLMEngine on real models: one batched forward per step gives the same greedy
tokens as ``greedy_decode`` run per request, whether requests run batched, in prefill chunks,
through a tiny pool that forces preemptions, or with prefix caching; stop conditions, abort,
seeded sampling, metrics and the offline ``LLM.generate``."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import SMOLLM2

from grading.checks.model_cases import tiny_model
from infra_lib.model import SamplingParams, greedy_decode
from infra_lib.serving import (
    LLM,
    BlockPool,
    LLMEngine,
    ModelRunner,
    PagedKVStore,
    SchedulerConfig,
    Sequence,
)
from infra_lib.serving.engine import engine_class, engine_step
from infra_lib.serving.scheduler_output import ScheduledSeq

CONFIGS = {
    "batched": SchedulerConfig(block_size=4, num_blocks=64),
    "chunked prefill": SchedulerConfig(max_num_batched_tokens=3, block_size=4, num_blocks=64),
    "preemption": SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32, block_size=2, num_blocks=14),
    "prefix cache": SchedulerConfig(max_num_batched_tokens=5, block_size=2, num_blocks=16, enable_prefix_caching=True),
    "no chunking": SchedulerConfig(
        max_num_batched_tokens=24, block_size=4, num_blocks=64, enable_chunked_prefill=False
    ),
}


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(0)


def tiny_prompts(seed: int = 0, count: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(96) for _ in range(6)]
    return [shared[: rng.randint(0, 6)] + [rng.randrange(96) for _ in range(rng.randint(1, 10))] for _ in range(count)]


def run_to_end(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
        engine.scheduler.check_output(engine.steps[-1].output)


@pytest.mark.parametrize("name", CONFIGS)
def test_tiny_model_greedy_tokens_equal_greedy_decode_per_request(tiny, name):
    prompts = tiny_prompts()
    engine = LLMEngine.from_model(tiny, config=CONFIGS[name])
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    run_to_end(engine)
    assert [engine.output(i).token_ids for i in ids] == [greedy_decode(tiny, p, 10) for p in prompts]
    steps = [r.output for r in engine.steps]
    if name == "preemption":
        assert sum(len(o.preempted) for o in steps) > 0
    if name == "chunked prefill":
        assert max(o.num_batched_tokens for o in steps) == 3 and any(
            s.kind == "prefill" and not s.samples for o in steps for s in o.scheduled
        )
    if name == "prefix cache":
        assert sum(sum(o.num_cached_tokens.values()) for o in steps) > 0
    assert engine.scheduler.pool.num_free == engine.config.num_blocks


def test_runner_logits_equal_the_model_run_on_each_sequence_alone(tiny):
    """A mixed step (a chunk at an offset, a whole prompt, two decodes) against plain forwards."""
    pool = BlockPool(32, 4)
    runner = ModelRunner(tiny, PagedKVStore.for_model(tiny.config, 32, 4))
    rng = random.Random(1)
    full = [[rng.randrange(96) for _ in range(n)] for n in (13, 6, 9, 17)]
    parts = [(5, 8), (0, 6), (8, 1), (16, 1)]  # (start, num_tokens): positions before start are written first
    seqs = [Sequence(i, ids, block_size=4) for i, ids in enumerate(full)]
    warm = []
    for seq, (start, n) in zip(seqs, parts):
        seq.block_table.blocks = pool.allocate(-(-(start + n) // 4))
        if start:
            warm.append((seq, ScheduledSeq(seq.seq_id, start, 0, "prefill", False)))
    runner.forward(warm)
    batch = []
    for seq, (start, n) in zip(seqs, parts):
        seq.num_computed_tokens = start
        batch.append((seq, ScheduledSeq(seq.seq_id, n, start, "prefill" if n > 1 else "decode", True)))
    logits = runner.forward(batch)
    with torch.inference_mode():
        expected = torch.cat([tiny(torch.tensor([ids[: start + n]]))[0, -1:] for ids, (start, n) in zip(full, parts)])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@SMOLLM2
def test_smollm2_batched_chunked_and_preempted_equal_greedy_decode(smollm2):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    questions = [
        "What is the capital of France?",
        "What is Python?",
        "Name three primary colours.",
        "What is 12 times 12?",
    ]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    expected = [greedy_decode(model, p, 6, tokenizer.eos_id) for p in prompts]
    configs = [
        SchedulerConfig(block_size=8, num_blocks=32),
        SchedulerConfig(max_num_batched_tokens=24, block_size=8, num_blocks=32),
        SchedulerConfig(block_size=4, num_blocks=40),
    ]  # 4 prompts take 37 blocks: decodes preempt
    for config in configs:
        engine = LLMEngine.from_model(model, tokenizer, config)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=6)) for p in prompts]
        run_to_end(engine)
        assert [engine.output(i).token_ids for i in ids] == expected, config
    assert sum(engine.output(i).metrics.num_preemptions for i in ids) > 0
    out = LLM(model, tokenizer, SchedulerConfig(block_size=8, num_blocks=32)).generate(
        questions[0], SamplingParams(max_new_tokens=12), stop=(" Paris",), use_tqdm=False
    )[0]
    assert (out.text, out.finish_reason) == ("The capital of France is", "stop")


def letter(token_id: int) -> str:
    return "" if token_id == 0 else chr(97 + token_id % 26)


class LetterTokenizer:
    """Token i is the letter chr(97 + i % 26); token 0 ends a turn. Enough to test text handling."""

    eos_id = 0

    def encode_chat(self, messages):
        return [1 + (ord(c) - 97) % 25 for m in messages for c in m["content"]]

    def stream_decoder(self, skip_special=True):
        class Decoder:
            def push(self, token_id):
                return letter(token_id)

            def flush(self):
                return ""

        return Decoder()


def test_stop_token_max_new_tokens_stop_strings_and_context_limit(tiny):
    prompt = tiny_prompts(2, 1)[0]
    reference = greedy_decode(tiny, prompt, 12)
    engine = LLMEngine.from_model(tiny, LetterTokenizer(), SchedulerConfig(block_size=4, num_blocks=64))
    by_stop_id = engine.add_request(prompt, SamplingParams(max_new_tokens=12, stop_ids=(reference[4],)))
    by_length = engine.add_request(prompt, SamplingParams(max_new_tokens=5, stop_ids=()))
    text = "".join(letter(t) for t in reference)
    by_string = engine.add_request(prompt, SamplingParams(max_new_tokens=12, stop_ids=()), stop=(text[3:5],))
    by_context = engine.add_request([5] * 60, SamplingParams(max_new_tokens=12, stop_ids=()))  # context is 64
    run_to_end(engine)
    first = reference.index(reference[4])
    assert engine.output(by_stop_id).token_ids == reference[: first + 1]
    assert engine.output(by_stop_id).finish_reason == "stop"
    assert (engine.output(by_length).token_ids, engine.output(by_length).finish_reason) == (reference[:5], "length")
    cut = engine.output(by_string)
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(text[3:5])]
    assert len(engine.output(by_context).token_ids) == 4 and engine.output(by_context).finish_reason == "length"


def test_requests_the_engine_can_never_serve_are_refused_up_front(tiny):
    engine = LLMEngine.from_model(
        tiny, config=SchedulerConfig(max_num_batched_tokens=8, block_size=4, num_blocks=4, enable_chunked_prefill=False)
    )
    with pytest.raises(ValueError, match="context is 64"):
        engine.add_request([1] * 64)
    with pytest.raises(ValueError, match="more than the pool's 4 blocks"):
        engine.add_request([1] * 10, SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="enable chunked prefill"):
        engine.add_request([1] * 6, SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="without a tokenizer"):
        engine.add_request("What is Python?")
    assert not engine.has_unfinished()


def test_abort_frees_a_request_and_leaves_the_others_untouched(tiny):
    prompts = tiny_prompts(4, 3)
    engine = LLMEngine.from_model(tiny, config=SchedulerConfig(max_num_seqs=2, block_size=4, num_blocks=64))
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    engine.step()
    engine.step()
    running, waiting = engine.abort(ids[0]), engine.abort(ids[2])
    assert running.finish_reason == waiting.finish_reason == "abort" and len(running.token_ids) == 2
    assert waiting.token_ids == [] and engine.abort(ids[0]) is None and engine.abort(99) is None
    engine.check_invariants()
    run_to_end(engine)
    assert engine.output(ids[1]).token_ids == greedy_decode(tiny, prompts[1], 8)


def test_seeded_sampling_is_per_request_and_survives_batching_and_preemption(tiny):
    prompts = tiny_prompts(5, 5)
    params = [SamplingParams(temperature=1.0, top_k=20, seed=i, max_new_tokens=10) for i in range(5)]
    alone = []
    for p, sp in zip(prompts, params):
        engine = LLMEngine.from_model(tiny, config=SchedulerConfig(block_size=4, num_blocks=16))
        alone.append(LLM(engine=engine).generate(p, sp, use_tqdm=False)[0].token_ids)
    crowded = LLM(tiny, config=SchedulerConfig(max_num_batched_tokens=4, block_size=2, num_blocks=14))
    together = crowded.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in together] == alone
    assert sum(o.metrics.num_preemptions for o in together) > 0
    assert len({tuple(t) for t in alone}) > 1


def test_generate_returns_finished_outputs_in_prompt_order_with_metrics(tiny):
    prompts = tiny_prompts(6, 4)
    llm = LLM(tiny, config=SchedulerConfig(max_num_seqs=2, block_size=4, num_blocks=64))
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=4), use_tqdm=False)
    assert [o.prompt_ids for o in outputs] == prompts and all(o.finished for o in outputs)
    assert [o.token_ids for o in outputs] == [greedy_decode(tiny, p, 4) for p in prompts]
    for o in outputs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
        assert len(m.token_times) == 4 and m.ttft >= 0 and m.tpot >= 0
    with pytest.raises(ValueError, match="2 sampling params for 4 prompts"):
        llm.generate(prompts, [SamplingParams()] * 2, use_tqdm=False)


def streamed(engine: LLMEngine, ids: list[int]) -> dict[int, list]:
    """Run to the end; every request's outputs, step by step, checking after each that the deltas so far
    join to the output's text and tokens."""
    seen: dict[int, list] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
            so_far = seen[out.request_id]
            assert "".join(o.new_text for o in so_far) == out.text
            assert [t for o in so_far for t in o.new_token_ids] == out.token_ids
        engine.check_invariants()
    return seen


def test_a_stop_string_across_two_tokens_cuts_the_text_and_the_stream_never_shows_what_it_takes_back(tiny):
    prompt = tiny_prompts(2, 1)[0]
    reference = greedy_decode(tiny, prompt, 12)
    text = "".join(letter(t) for t in reference)
    stop = text[5:7]  # the 6th and 7th tokens' letters: the match spans two tokens
    engine = LLMEngine.from_model(tiny, LetterTokenizer(), SchedulerConfig(block_size=4, num_blocks=64))
    ids = [
        engine.add_request(prompt, SamplingParams(max_new_tokens=12, stop_ids=()), stop=(stop, "never seen")),
        engine.add_request(prompt, SamplingParams(max_new_tokens=12, stop_ids=())),
    ]
    seen = streamed(engine, ids)
    cut, whole = seen[ids[0]][-1], seen[ids[1]][-1]
    assert (cut.text, cut.finish_reason) == (text[: text.index(stop)], "stop")
    assert (whole.text, whole.finish_reason) == (text, "length")
    # while it ran, the last len("never seen") - 1 letters were held back: a stop string could begin there
    assert [len(o.text) for o in seen[ids[0]][:-1]] == [max(0, n - 9) for n in range(1, len(seen[ids[0]]))]
    assert [len(o.text) for o in seen[ids[1]]] == list(range(1, 13))  # no stop string: nothing held back
    assert engine.scheduler.pool.num_free == engine.config.num_blocks


def test_the_earliest_stop_string_cuts_the_text_whichever_is_listed_first(tiny):
    prompt = tiny_prompts(2, 1)[0]
    text = "".join(letter(t) for t in greedy_decode(tiny, prompt, 12))
    engine = LLMEngine.from_model(tiny, LetterTokenizer(), SchedulerConfig(block_size=4, num_blocks=64))
    i = engine.add_request(prompt, SamplingParams(max_new_tokens=12, stop_ids=()), stop=(text[4:6], text[3:6]))
    streamed(engine, [i])
    assert engine.output(i).text == text[: text.index(text[3:6])]


def test_an_abort_mid_stream_frees_every_block_and_releases_the_held_back_text(tiny):
    prompt = tiny_prompts(2, 1)[0]
    text = "".join(letter(t) for t in greedy_decode(tiny, prompt, 12))
    engine = LLMEngine.from_model(tiny, LetterTokenizer(), SchedulerConfig(block_size=4, num_blocks=64))
    i = engine.add_request(prompt, SamplingParams(max_new_tokens=12, stop_ids=()), stop=("zzzz",))
    outs = [o for _ in range(5) for o in engine.step()]
    assert outs[-1].text == text[:2]  # 5 letters, 3 held back
    aborted = engine.abort(i)
    assert (aborted.text, aborted.new_text, aborted.finish_reason) == (text[:5], text[2:5], "abort")
    assert "".join(o.new_text for o in outs + [aborted]) == aborted.text
    assert engine.scheduler.pool.num_free == engine.config.num_blocks and not engine.has_unfinished()


def test_an_engine_class_runs_a_step_of_its_own_with_the_same_books_as_the_course_step(tiny):
    prompts = tiny_prompts(7, 5)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6, block_size=2, num_blocks=14)
    runs = []
    for cls in (LLMEngine, engine_class(engine_step)):
        engine = cls.from_model(tiny, LetterTokenizer(), config)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=8, stop_ids=()), stop=("ab", "q")) for p in prompts]
        seen = streamed(engine, ids)
        runs.append(
            (
                {i: [(o.new_token_ids, o.new_text, o.text, o.finish_reason) for o in seen[i]] for i in ids},
                [(e.kind, e.request_id) for e in engine.events.events()],
                [r.output.as_dict() for r in engine.steps],
            )
        )
        assert sum(len(r.output.preempted) for r in engine.steps) > 0
    assert runs[0] == runs[1]
    assert type(engine).__mro__[1] is LLMEngine


def test_an_engine_step_that_breaks_the_contract_is_told_so_clearly(tiny):
    with pytest.raises(TypeError, match="must be a function"):
        engine_class("step")

    def returns_a_dict(engine):
        return {}

    def skips_begin_step(engine):
        engine.scheduler.schedule()
        return []

    for step, error, match in (
        (returns_a_dict, TypeError, "must return a list of RequestOutput, got dict"),
        (skips_begin_step, RuntimeError, r"never handed the plan to engine.begin_step\(out\)"),
    ):
        engine = engine_class(step).from_model(tiny, config=SchedulerConfig(block_size=4, num_blocks=16))
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
        with pytest.raises(error, match=match):
            engine.step()
    engine = LLMEngine.from_model(tiny, config=SchedulerConfig(block_size=4, num_blocks=16))
    i = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    seq = engine.sequences[i]
    with pytest.raises(RuntimeError, match="call begin_step"):
        engine.record_token(seq)
    with pytest.raises(ValueError, match="'stop' or 'length', got 'abort'"):
        engine.finish(seq, "abort")
    engine.step()
    with pytest.raises(ValueError, match="request 1 is unknown"):
        engine.decoder(1)


def test_the_async_engine_streams_an_engine_class_engine_as_the_course_engine_answers_whole(tiny):
    """An engine whose step is a function (``engine_class``) runs under ``AsyncLLMEngine`` unchanged: its
    streamed deltas join to the course engine's whole answers, stop strings across two tokens included,
    and every block is free once the streams end."""
    import asyncio

    from infra_lib.serving.async_engine import AsyncLLMEngine

    prompts = tiny_prompts(8, 4)
    texts = ["".join(letter(t) for t in greedy_decode(tiny, p, 10)) for p in prompts]
    stops = [(t[4:6],) for t in texts]
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, block_size=4, num_blocks=64)
    params = SamplingParams(max_new_tokens=10, stop_ids=())
    whole = LLM(engine=LLMEngine.from_model(tiny, LetterTokenizer(), config))
    expected = [whole.generate(p, params, stop=s, use_tqdm=False)[0] for p, s in zip(prompts, stops)]

    async def stream_all(served: AsyncLLMEngine):
        async def one(prompt, stop):
            return [out async for out in served.generate(prompt, params, stop)]

        return await asyncio.gather(*(one(p, s) for p, s in zip(prompts, stops)))

    served = AsyncLLMEngine(engine_class(engine_step).from_model(tiny, LetterTokenizer(), config)).start()
    try:
        streams = asyncio.run(stream_all(served))
    finally:
        served.stop()
    for stream, want in zip(streams, expected):
        assert "".join(o.new_text for o in stream) == stream[-1].text == want.text
        assert (stream[-1].token_ids, stream[-1].finish_reason) == (want.token_ids, want.finish_reason)
    assert all(want.finish_reason == "stop" for want in expected)
    assert served.engine.scheduler.pool.num_free == config.num_blocks
