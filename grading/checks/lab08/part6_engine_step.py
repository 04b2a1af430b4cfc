"""Lab 08 task 2: the learner's engine step, ``engine_step(engine) -> list[RequestOutput]``, run as the step of
``engine_class(engine_step)`` on the small random model, with a tokenizer over its token ids that gives it text.

Where the inputs are made, the reference engine serves each run and its scheduler's actions are recorded,
step by step, with the aborts the run makes mid-stream; the learner's engine replays the same plans
(``engines.replaying``) and the same aborts, so every step of theirs is compared with the reference's: the
tokens, the finish reasons, the text, the streamed deltas, the free blocks and the course's books.

The workloads are built so that each way a request ends happens: request 0 meets its end-of-turn token,
a stop string that begins in one token's text and ends in the next's stops another, one with a stop
string that never occurs runs to its length (its stream holds back text all along), and the rest end at
their length or their end-of-turn token. Where there are requests left, two endings meet in one step: one
request's own stop token is the last token it may hold, and another's stop string ends in its last token
("stop" wins over "length" in both).
"""

from __future__ import annotations

import random

from grading.checks.common import one_thread
from grading.checks.lab08.engines import LeftTheReference, recording, replaying
from grading.checks.lab08.forced_steps import TASKS, scheduler_config
from grading.checks.lab08.plans import describe_config
from grading.checks.model_cases import TINY, tiny_model
from grading.registry import Check, Mismatch, register

NEVER = "#@"  # a stop string no token's text contains: it never stops anything, its stream holds text back
END = "<|end|>"
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def engine_step_reference():
    """The reference's engine step, imported when a check needs it."""
    from infra_lib.serving.engine import engine_step

    return engine_step


def token_bytes(i: int) -> bytes:
    """The text of token ``i`` of the checks' tokenizer (as bytes): two letters, a word start (a space
    before them) for every fourth id, and two ids that are each one byte of the two-byte character "é"."""
    if i % 16 == 5:
        return b"\xc3"  # the first byte of "é": no text until the second byte follows
    if i % 16 == 13:
        return b"\xa9"
    return ((" " if i % 4 == 0 else "") + _LETTERS[i % 26] + _LETTERS[(7 * i + 3) % 26]).encode()


def tokenizer(eos: int):
    """A byte-level tokenizer over the small model's ids whose end-of-turn token is ``eos``."""
    from infra_lib.model.tokenizer import Tokenizer, byte_alphabet

    alphabet = byte_alphabet()
    tokens = ["".join(alphabet[b] for b in token_bytes(i)) for i in range(TINY["vocab_size"])]
    tokens[eos] = END
    return Tokenizer(tokens, [], [eos], eos, eos)


def stream_pieces(tok, ids: list[int]) -> list[str]:
    """The text each token adds when the ids are decoded one at a time."""
    decoder = tok.stream_decoder(skip_special=True)
    return [decoder.push(t) for t in ids]


def _spanning_stop(pieces: list[str], upto: int) -> str | None:
    """A two-character stop string whose first occurrence in the text begins in one token's text and ends in
    the next's, before token ``upto``; None if there is none."""
    text = ""
    for j in range(1, upto):
        text += pieces[j - 1]
        if pieces[j - 1] and pieces[j]:
            stop = pieces[j - 1][-1] + pieces[j][0]
            whole = "".join(pieces)
            if stop.strip() == stop and whole.find(stop) == len(text) - 1:
                return stop
    return None


def _greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens, all served at once by the reference engine (one forward pass a step)."""
    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving.engine import LLMEngine
    from infra_lib.serving.scheduler_output import SchedulerConfig

    config = SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=512, block_size=4, num_blocks=128)
    engine = LLMEngine.from_model(model, config=config)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=new_tokens, stop_ids=())) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.output(i).token_ids for i in ids]


def _stop_token_at(ids: list[int]) -> int | None:
    """The last index ``k >= 1`` whose token is not among those before it (a stop token sampled there ends the
    request there, not earlier); None if there is none."""
    fresh = [k for k in range(1, len(ids)) if ids[k] not in ids[:k]]
    return fresh[-1] if fresh else None


def _stop_string_at(pieces: list[str]) -> tuple[str, int] | None:
    """A two-character stop string whose first occurrence in the text ends with token ``k``'s text, and ``k``,
    for the last such ``k >= 1``; None if there is none."""
    for k in range(len(pieces) - 1, 0, -1):
        text = "".join(pieces[: k + 1])
        stop = text[-2:]
        if pieces[k] and len(stop) == 2 and stop.strip() == stop and text.find(stop) == len(text) - 2:
            return stop, k
    return None


def _endings_at_length(tok, greedy: list[list[int]], requests: list[dict], free: list[int]) -> bool:
    """Two endings in one step, on requests without stop strings (``greedy``: each one's tokens before any
    end-of-turn): the first of ``free`` that can gets a stop token of its own that is its last allowed token, the
    next that can a stop string that ends in its last token. True when both were placed."""
    at_token = next((i for i in free if _stop_token_at(greedy[i]) is not None), None)
    if at_token is not None:
        k = _stop_token_at(greedy[at_token])
        requests[at_token].update(new_tokens=k + 1, stop_ids=[greedy[at_token][k]])
    for i in free:
        found = _stop_string_at(stream_pieces(tok, greedy[i])) if i != at_token else None
        if found is not None:
            requests[i].update(new_tokens=found[1] + 1, stop=[found[0]])
            return at_token is not None
    return False


def _params(request: dict):
    """The request's sampling parameters: its new tokens, and its own stop tokens when it names some."""
    from infra_lib.model.sampling import SamplingParams

    stop_ids = request.get("stop_ids")
    return SamplingParams(max_new_tokens=request["new_tokens"], stop_ids=None if stop_ids is None else tuple(stop_ids))


def _requests(
    model, rng: random.Random, count: int, new_tokens: int, shared_len: int, keep: int
) -> tuple[int, list[dict]]:
    """The run's end-of-turn id and requests (prompt, new tokens, stop strings, stop tokens of their own), as
    described above; the last ``keep`` requests without stop strings keep the end-of-turn token and their
    length only (the run may abort them)."""
    vocab = TINY["vocab_size"]
    drawn = None
    for _ in range(20):  # prompts whose greedy outputs give each ending; almost always the first draw
        shared = [rng.randrange(vocab) for _ in range(shared_len)]
        prompts = [
            shared[: rng.randint(0, shared_len)] + [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
            for _ in range(count)
        ]
        greedy = _greedy(model, prompts, new_tokens)
        fresh = [k for k in range(2, 5) if greedy[0][k] not in greedy[0][:k]]
        eos = greedy[0][fresh[0] if fresh else 2]
        tok = tokenizer(eos)
        ends = [g.index(eos) if eos in g else len(g) for g in greedy]
        stops: list[list[str]] = [[] for _ in prompts]
        spanning = [(i, _spanning_stop(stream_pieces(tok, greedy[i]), ends[i])) for i in range(1, count)]
        spanning = [(i, stop) for i, stop in spanning if stop is not None]
        if spanning:
            stops[spanning[0][0]] = [NEVER, spanning[0][1]]
        long = [i for i in range(1, count) if ends[i] == len(greedy[i]) and not stops[i]]
        if long:
            stops[long[0]] = [NEVER]
        requests = [{"prompt": p, "new_tokens": new_tokens, "stop": s} for p, s in zip(prompts, stops)]
        free = [i for i in range(1, count) if not stops[i]]
        free = free[: max(0, len(free) - keep)]
        both = _endings_at_length(tok, [g[:end] for g, end in zip(greedy, ends)], requests, free)
        drawn = eos, requests
        if fresh and spanning and long and both:
            break
    return drawn


def _run(model, rng: random.Random, config: dict, count: int, new_tokens: int, shared_len: int, aborts: bool):
    """One run: the requests, the reference's recorded plans and the aborts it made (after which step, which
    request: a running one, that has streamed tokens when one has, and one still waiting when there is one;
    never request 0 nor one with stop strings or stop tokens of its own, whose endings the run must hold)."""
    from infra_lib.serving.engine import LLMEngine

    eos, requests = _requests(model, rng, count, new_tokens, shared_len, keep=1 if aborts else 0)
    full = {"enable_chunked_prefill": True, "enable_prefix_caching": False, **config}
    plans: list = []
    cfg = scheduler_config(full)
    engine = LLMEngine.from_model(model, tokenizer(eos), cfg, scheduler=recording(cfg, plans))
    ids = [engine.add_request(r["prompt"], _params(r), stop=tuple(r["stop"])) for r in requests]
    abort_at = rng.randint(2, 3) if aborts else -1
    made: list[list[int]] = []
    while engine.has_unfinished():
        engine.step()
        if len(engine.steps) - 1 == abort_at:  # requests 0 and those with stop strings keep their endings
            plain = {i for i in ids[1:] if not requests[i]["stop"] and requests[i].get("stop_ids") is None}
            streaming = [s.seq_id for s in engine.scheduler.running if s.seq_id in plain]
            streaming.sort(key=lambda i: not engine.sequences[i].output_ids)  # one that has streamed tokens first
            waiting = [s.seq_id for s in engine.scheduler.waiting if s.seq_id in plain]
            for seq_id in streaming[:1] + waiting[-1:]:
                engine.abort(seq_id)
                made.append([abort_at, seq_id])
    return {"config": full, "eos": eos, "requests": requests, "plans": plans, "aborts": made, "ids": ids}


def _make(rng: random.Random, specs: list[dict]) -> dict:
    seed = rng.randrange(10**6)
    model = tiny_model(seed)
    with one_thread():
        return {"seed": seed, "runs": [_run(model, rng, **spec) for spec in specs]}


def _loop_case(rng: random.Random) -> dict:
    config = {"max_num_seqs": 4, "max_num_batched_tokens": 16, "block_size": 4, "num_blocks": 64}
    return _make(rng, [dict(config=config, count=5, new_tokens=10, shared_len=0, aborts=False)])


def _abort_case(rng: random.Random) -> dict:
    config = {"max_num_seqs": 3, "max_num_batched_tokens": 12, "block_size": 4, "num_blocks": 64}
    return _make(rng, [dict(config=config, count=6, new_tokens=10, shared_len=0, aborts=True)])


def _preemption_case(rng: random.Random) -> dict:
    tight = {"max_num_seqs": 6, "max_num_batched_tokens": 8, "block_size": 2, "num_blocks": 14}
    return _make(
        rng,
        [
            dict(config=tight, count=6, new_tokens=10, shared_len=0, aborts=False),
            dict(config={**tight, "enable_prefix_caching": True}, count=6, new_tokens=8, shared_len=6, aborts=True),
        ],
    )


def _random_case(rng: random.Random) -> dict:
    specs = []
    for _ in range(2):
        config = {
            "max_num_seqs": rng.randint(2, 6),
            "max_num_batched_tokens": rng.choice([4, 8, 32]),
            "block_size": rng.choice([2, 4]),
            "num_blocks": rng.choice([16, 64]),
        }
        specs.append(
            dict(config=config, count=rng.randint(6, 7), new_tokens=rng.randint(6, 12), shared_len=4, aborts=True)
        )
    return _make(rng, specs)


# --- the learner's engine, replaying the reference's plans -------------------------------------------------


def _plain(out) -> dict:
    return {
        "id": out.request_id,
        "new_ids": list(out.new_token_ids),
        "new_text": out.new_text,
        "text": out.text,
        "tokens": list(out.token_ids),
        "finished": out.finished,
        "reason": out.finish_reason,
    }


def _books(engine) -> dict:
    """What the course books through the step's surface: per request, its token times against its tokens,
    its first-token and finish times; the events by kind; the steps recorded."""
    kinds: dict[str, int] = {}
    for event in engine.events.events():
        kinds[event.kind] = kinds.get(event.kind, 0) + 1
    return {
        "requests": [
            [
                len(seq.metrics.token_times) == len(seq.output_ids),
                seq.metrics.first_token_time is not None or not seq.output_ids,
                (seq.metrics.finish_time is not None) == seq.is_finished,
            ]
            for seq in engine.sequences.values()
        ],
        "events": kinds,
        "steps": len(engine.steps),
    }


def _drive(step, case):
    with one_thread():
        return _serve(step, case)


def _serve(step, case):
    from infra_lib.serving.engine import engine_class

    if not callable(step):
        raise TypeError(f"check(...) needs your engine_step function, got a {type(step).__name__}")
    cls = engine_class(step)
    model = tiny_model(case["seed"])
    results = []
    for run in case["runs"]:
        config = scheduler_config(run["config"])
        engine = cls.from_model(model, tokenizer(run["eos"]), config, scheduler=replaying(config, run["plans"]))
        ids = [engine.add_request(r["prompt"], _params(r), stop=tuple(r["stop"])) for r in run["requests"]]
        result = {"steps": [], "left": None}
        try:
            while engine.has_unfinished():
                outputs = engine.step()
                k = len(result["steps"])
                aborted = [engine.abort(i) for at, i in run["aborts"] if at == k]
                result["steps"].append(
                    {
                        "outputs": [_plain(o) for o in outputs],  # in the order returned: the batch's
                        "aborted": [None if o is None else _plain(o) for o in aborted],
                        "num_free": engine.scheduler.pool.num_free,
                    }
                )
        except LeftTheReference as exc:
            result["left"] = str(exc)
        result["final"] = [_plain(engine.output(i)) for i in ids]
        result["num_free"] = engine.scheduler.pool.num_free
        result["books"] = _books(engine)
        results.append(result)
    return results


# --- the comparison: the first difference, with the idea it most likely comes from ------------------------

HINT = {
    "tokens": "each token runner.run samples is appended to its own sequence, once, in the step that sampled "
    "it, and every request that got a token is in the step's outputs (once).",
    "eos": "a request whose new token is one of its stop tokens (seq.stop_ids: the tokenizer's end-of-turn "
    "token unless the request named others) finishes in that step, with reason 'stop'.",
    "stop_string": "a stop string is looked for in the request's decoded text, not in one token's text: it may "
    "begin in the text of an earlier token and end in this one's.",
    "cut": "the text of a request stopped by a stop string ends just before the stop string: the stop string is "
    "not part of the answer.",
    "length": "a request finishes with reason 'length' in the step its tokens (prompt and output) reach "
    "seq.max_tokens, unless it stopped.",
    "stop_wins": "when a request meets a stop token or a stop string in the step its tokens reach seq.max_tokens, "
    "'stop' wins: its finish reason is 'stop', not 'length'.",
    "order": "the step returns its outputs in batch order: the order of the plan, which is the order of "
    "runner.run's {seq_id: token}.",
    "early": "a request ends only on a stop token, a stop string in its text or its length: nothing else finishes it.",
    "delta": "new_text is only the text this step added to what the request had shown before: the deltas of a "
    "request, joined, are its text, and no delta repeats text already sent.",
    "held": "text a stop string could still take back is not streamed yet: engine.output(id).text is what may be "
    "shown (it holds back the last characters while the request runs), and a step's delta is what that text "
    "gained in the step.",
    "text": "a request's text is the concatenation of what its stream decoder gives for each of its tokens, in "
    "order (engine.decoder(id).push(token)); when it ends on a stop token or its length, flush() adds the "
    "bytes the decoder still holds.",
    "blocks": "a finished request gives every block back: finish it with engine.finish(seq, reason), which takes "
    "it out of its queue and frees its blocks (setting its status by hand leaves them held).",
    "books": "the course keeps the metrics and events through the step's surface: engine.begin_step(out) with "
    "the plan, engine.record_token(seq) once per appended token, engine.finish(seq, reason) to finish.",
}


def _where(run: dict) -> str:
    sizes = [len(r["prompt"]) for r in run["requests"]]
    stops = {i: r["stop"] for i, r in enumerate(run["requests"]) if r["stop"]}
    own = {i: r["stop_ids"] for i, r in enumerate(run["requests"]) if r.get("stop_ids") is not None}
    aborts = "; aborting " + ", ".join(f"request {i} after step {k}" for k, i in run["aborts"]) if run["aborts"] else ""
    return (
        f"the small random model, {describe_config(run['config'])}, {len(sizes)} requests with prompts of {sizes} "
        f"tokens, end-of-turn token {run['eos']}, stop strings {stops}"
        + (f", requests' own stop tokens {own}" if own else "")
        + aborts
    )


def _ending(e: dict, run: dict) -> str:
    """Which rule ended an expected output: "eos", "stop_string" or "length"."""
    if e["reason"] == "stop":
        own = run["requests"][e["id"]].get("stop_ids")
        stop_ids = [run["eos"]] if own is None else own
        return "eos" if e["tokens"] and e["tokens"][-1] in stop_ids else "stop_string"
    return "length"


def _output_difference(g: dict, e: dict, run: dict) -> tuple[str, str] | None:
    """(what, hint key) for two outputs of the same request in the same step, or None when equal."""
    if g == e:
        return None
    if g["new_ids"] != e["new_ids"] or g["tokens"] != e["tokens"]:
        return "the request's tokens differ", "tokens"
    if g["finished"] != e["finished"] or g["reason"] != e["reason"]:
        if e["finished"] and not g["finished"]:
            kind = _ending(e, run)
            return {
                "eos": ("the request did not stop on its end-of-turn token", "eos"),
                "stop_string": ("the request did not stop on a stop string that its text contains", "stop_string"),
                "length": ("the request did not finish at its length", "length"),
            }[kind]
        if g["finished"] and not e["finished"]:
            return f"the request finished ({g['reason']}) before the reference's", "early"
        if (g["reason"], e["reason"]) == ("length", "stop"):
            return "the request finished at its length where a stop ends it in the same step", "stop_wins"
        return "the request finished with another reason", _ending(e, run)
    if e["finished"] and g["text"] != e["text"]:
        stops = run["requests"][e["id"]]["stop"]
        if e["reason"] == "stop" and any(g["text"].startswith(e["text"] + s) for s in stops):
            return "the text of a request stopped by a stop string still holds the stop string", "cut"
    if g["new_text"] != e["new_text"]:
        if g["new_text"] == g["text"] and g["text"] != e["new_text"]:
            return "a streamed delta repeats the text sent before it (it is the whole text)", "delta"
        if run["requests"][e["id"]]["stop"]:
            return (
                "a streamed delta is not what the shown text gained in the step (for a request with stop strings)",
                "held",
            )
        return "a streamed delta is not what the request's text gained in the step", "delta"
    if g["text"] != e["text"]:
        return "the request's text differs", "text" if e["finished"] else "held"
    return "the request's output differs", "tokens"


def _step_text(step: dict) -> str:
    shown = [
        f"request {o['id']}: +{o['new_ids']} {o['new_text']!r}" + (f" ({o['reason']})" if o["finished"] else "")
        for o in step["outputs"]
    ]
    return "; ".join(shown) or "no outputs"


def _compare_run(g: dict, e: dict, run: dict) -> Mismatch | None:
    where = _where(run)
    for k, (gs, es) in enumerate(zip(g["steps"], e["steps"])):
        gout, eout = {o["id"]: o for o in gs["outputs"]}, {o["id"]: o for o in es["outputs"]}
        if len(gs["outputs"]) != len(gout):
            return Mismatch(
                "a request appears twice in one step's outputs", f"on {where}: at step {k}", hint=HINT["tokens"]
            )
        if set(gout) != set(eout):
            return Mismatch(
                "the step's outputs are for other requests than the reference's",
                f"on {where}: at step {k}, outputs for requests {sorted(gout)}, expected {sorted(eout)}",
                hint=HINT["tokens"],
            )
        for i in sorted(eout):
            found = _output_difference(gout[i], eout[i], run)
            if found:
                what, hint = found
                return Mismatch(
                    what,
                    f"on {where}: at step {k}, request {i}:\n  expected {eout[i]}\n  got      {gout[i]}\n"
                    f"  the reference's step {k}: {_step_text(es)}",
                    hint=HINT[hint],
                )
        order, expected_order = [o["id"] for o in gs["outputs"]], [o["id"] for o in es["outputs"]]
        if order != expected_order:
            return Mismatch(
                "the step's outputs are not in batch order",
                f"on {where}: at step {k}, outputs for requests {order}, expected {expected_order}",
                hint=HINT["order"],
            )
        for ga, ea in zip(gs["aborted"], es["aborted"]):
            if ga != ea:
                return Mismatch(
                    "a request aborted mid-stream gives another output than the reference's",
                    f"on {where}: aborted after step {k}:\n  expected {ea}\n  got      {ga}",
                    hint=HINT["delta"],
                )
        if gs["num_free"] != es["num_free"]:
            return Mismatch(
                "blocks are still held after the step"
                + (" that finished a request" if any(o["finished"] for o in es["outputs"]) else ""),
                f"on {where}: after step {k}: {gs['num_free']} blocks free, expected {es['num_free']}",
                hint=HINT["blocks"],
            )
    if g["left"] or len(g["steps"]) != len(e["steps"]):
        steps = f"{len(g['steps'])} steps, the reference's {len(e['steps'])}"
        return Mismatch(
            "the run took other steps than the reference's",
            f"on {where}: {g['left'] or steps}",
            hint=HINT["early"],
        )
    if g["final"] != e["final"]:
        i = next(n for n, (a, b) in enumerate(zip(g["final"], e["final"])) if a != b)
        return Mismatch(
            "a request's final output differs",
            f"on {where}: request {i}:\n  expected {e['final'][i]}\n  got      {g['final'][i]}",
            hint=HINT["text"],
        )
    if g["num_free"] != run["config"]["num_blocks"]:
        return Mismatch(
            "blocks are still held after every request finished",
            f"on {where}: {g['num_free']} of {run['config']['num_blocks']} blocks free",
            hint=HINT["blocks"],
        )
    if g["books"] != e["books"]:
        return Mismatch(
            "the course's books of the run differ (metrics, events or step records)",
            f"on {where}: expected {e['books']}\n  got      {g['books']}",
            hint=HINT["books"],
        )
    return None


def _compare(got, expected, case) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch("the check recorded the wrong number of runs")
    for run, g, e in zip(case["runs"], got, expected):
        found = _compare_run(g, e, run)
        if found:
            return found
    return None


def loop_parts(make) -> dict:
    """The fields of a check of the engine step whose cases ``make`` draws."""
    return dict(task=TASKS[2], reference=engine_step_reference, make_inputs=make, drive=_drive, compare=_compare)


register(
    Check(
        check_id="lab08.engine_loop",
        **loop_parts(_loop_case),
        hint="every request ends as the reference's does: on its end-of-turn token, on a stop string in its text "
        "(the text cut before it) or at its length; its streamed deltas join to its text; its blocks come back.",
    )
)

register(
    Check(
        check_id="lab08.engine_loop_aborts",
        **loop_parts(_abort_case),
        hint="a request aborted between two steps (engine.abort) is gone from the queues with its blocks: the "
        "next steps serve the others as before, and every block is free at the end.",
    )
)

register(
    Check(
        check_id="lab08.engine_loop_preemption",
        **loop_parts(_preemption_case),
        hint="on a pool this small requests are preempted and recomputed: a step appends only the tokens "
        "runner.run sampled (a sequence recomputing its tokens samples nothing until it has caught up). Tight "
        "pools with prefix caching, and aborts.",
    )
)

register(
    Check(
        check_id="lab08.engine_loop_random",
        **loop_parts(_random_case),
        hint="every request ends as the reference's does, its deltas join to its text, and its blocks come back. "
        "Random configurations, workloads and aborts.",
    )
)
