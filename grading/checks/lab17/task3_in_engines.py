"""Lab 17 tasks 2 and 3 together: prefill and decode on two engines in one process, the KV handed over by the
learner's ``pack_kv`` and ``install_kv``.

The prefill engine is the course's engine whose step is ``prefill_step``: every request that samples its first
token is handed off (the learner's ``pack_kv`` on the prefill engine's store; between its steps the decode engine
takes each waiting request that fits, a free row of its batch and blocks for the prompt, with the learner's
``install_kv`` into its store and pool, then ``adopt``) and finished there. The decode engine is an ordinary engine
that continues each adopted request. The two engines step in turn, as two workers would, on the small random
decoder. Every request's greedy tokens must be those of one ordinary engine serving the same requests, and at
the end every block must be back in both pools.
"""

from __future__ import annotations

import functools
import random
from collections import deque

from grading.checks.common import one_thread, token_difference
from grading.checks.lab17.tasks import SPLIT_SECTION, TASKS
from grading.checks.model_cases import tiny_model, tiny_prompts
from grading.registry import Check, Mismatch, ReferenceFailed, register

MAX_STEPS = 500
TOKENS_HINT = (
    "the decode engine reads exactly what your install_kv wrote, at the positions the table says: if the pack and "
    "install checks pass, compare what your pack_kv is given with what a sequence holds (its block table in "
    "position order, seq.num_computed_tokens prompt tokens) and what install_kv returns with what adopt needs (one "
    f"block per started block of the prompt, in order) ({SPLIT_SECTION})"
)
ENGINE_HINT = (
    "the course's engines run on what your functions return: the decode engine frees the table install_kv returned "
    "when its request finishes (so each of its blocks must be held in the decode pool, taken with allocate), and "
    "adopt needs one block per started block of the prompt, in position order"
)
POOLS_HINT = (
    "every block must come back: the prefill engine frees a request's blocks once it is handed off (pack_kv only "
    "reads them), and the decode engine frees the blocks install_kv took from its pool when the request finishes "
    "(so install_kv takes them with the pool's allocate, once each)"
)


def _case(rng: random.Random, count: int, config: dict, lengths: tuple[int, int]) -> dict:
    return {
        "seed": rng.randrange(10**6),
        "config": config,
        "prompts": tiny_prompts(rng, [rng.randint(*lengths) for _ in range(count)]),
        "new_tokens": [rng.randint(3, 7) for _ in range(count - 1)] + [1],  # the last: its first token is its last
        "held": rng.randint(2, 4),
    }


def engines_case(rng: random.Random) -> dict:
    config = {"block_size": 4, "num_blocks": 24, "max_num_seqs": 4, "max_num_batched_tokens": 64}
    return _case(rng, 3, config, (3, 14))


def chunked_engines_case(rng: random.Random) -> dict:
    """Longer prompts, a token budget that chunks them, blocks of 3 slots and a pool only just large enough."""
    config = {"block_size": 3, "num_blocks": 40, "max_num_seqs": 3, "max_num_batched_tokens": 10}
    return _case(rng, 4, config, (9, 26))


class _Watch:
    """Which of the learner's functions is running, so that an error raised after it returned (inside the
    course's engine, caused by what it returned) is told apart from the learner's own."""

    def __init__(self):
        self.inside: str | None = None
        self.last: str | None = None

    def call(self, name: str, fn, *args):
        self.inside = name
        result = fn(*args)
        self.inside, self.last = None, name
        return result


def _serve_one_engine(model, case: dict) -> list[list[int]]:
    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving.engine import LLMEngine
    from infra_lib.serving.scheduler_output import SchedulerConfig

    engine = LLMEngine.from_model(model, None, SchedulerConfig(**case["config"]))
    ids = [
        engine.add_request(list(p), SamplingParams(max_new_tokens=n, stop_ids=()))
        for p, n in zip(case["prompts"], case["new_tokens"])
    ]
    while engine.has_unfinished():
        engine.step()
    return [list(engine.sequences[i].output_ids) for i in ids]


def _scatter(engine, seed: int, held: int = 0) -> list[int]:
    """Put the engine's free blocks in a seeded order (as frees leave them on a server that has run a while), fill
    its store with stale bytes, and hold ``held`` blocks for other requests; returns those."""
    import torch

    pool, store = engine.scheduler.pool, engine.runner.store
    blocks = pool.allocate(pool.num_blocks)
    pool.free(random.Random(seed).sample(blocks, len(blocks)))
    generator = torch.Generator().manual_seed(seed)
    for cache in store.k + store.v:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    return pool.allocate(held)


def _serve_two_engines(answers: dict, model, case: dict) -> dict:
    from functools import partial

    import torch

    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving.block_table import blocks_needed
    from infra_lib.serving.disaggregated import Handoff, adopt, prefill_step
    from infra_lib.serving.engine import LLMEngine, engine_class
    from infra_lib.serving.scheduler_output import SchedulerConfig

    config = SchedulerConfig(**case["config"])
    decode = LLMEngine.from_model(model, None, config)
    held = _scatter(decode, case["seed"] + 1, held=case["held"])  # the decode worker serves others too
    watch, adopted, tables, pending = _Watch(), {}, {}, deque()

    def ship(engine, seq) -> None:
        """The prefill side: pack the request's KV and send it (the wire copies the bytes)."""
        payload, metadata = watch.call(
            "pack_kv", answers["pack_kv"], engine.runner.store, list(seq.block_table.blocks), seq.num_computed_tokens
        )
        if isinstance(payload, torch.Tensor):
            payload = payload.clone()
        handoff = Handoff(
            seq.seq_id, tuple(seq.prompt_ids), seq.output_ids[0], seq.params.max_new_tokens, seq.metrics.arrival_time
        )
        pending.append((handoff, payload, metadata, list(seq.block_table.blocks)))

    def receive() -> None:
        """The decode side, between its steps: install each waiting request that fits (a free row of the batch and
        enough free blocks for its prompt), as the decode worker does."""
        while pending and len(decode.scheduler.running) < config.max_num_seqs:
            handoff, payload, metadata, sent_table = pending[0]
            if not decode.scheduler.pool.can_allocate(blocks_needed(len(handoff.prompt_ids), config.block_size)):
                return
            pending.popleft()
            table = watch.call(
                "install_kv", answers["install_kv"], decode.runner.store, decode.scheduler.pool, payload, metadata
            )
            tables[str(handoff.request_id)] = {"prefill": sent_table, "decode": table}
            adopted[handoff.request_id] = adopt(decode, handoff, table)

    prefill = engine_class(partial(prefill_step, handoff=ship)).from_model(model, None, config)
    _scatter(prefill, case["seed"])
    ids = [
        prefill.add_request(list(p), SamplingParams(max_new_tokens=n, stop_ids=()))
        for p, n in zip(case["prompts"], case["new_tokens"])
    ]
    record = {"violation": None, "tokens": None, "pools": None, "tables": tables, "waited": 0}
    try:
        for _ in range(MAX_STEPS):
            if not (prefill.has_unfinished() or decode.has_unfinished() or pending):
                break
            if prefill.has_unfinished():
                prefill.step()
            receive()
            record["waited"] += bool(pending)
            if decode.has_unfinished():
                decode.step()
            elif pending and not prefill.has_unfinished():
                raise RuntimeError("the idle decode engine has too few free blocks for the next handed-off request")
        else:
            raise RuntimeError(f"the requests did not finish within {MAX_STEPS} steps of each engine")
        record["tokens"] = [list(decode.sequences[adopted[i]].output_ids) if i in adopted else [] for i in ids]
        record["pools"] = {
            "prefill": [prefill.scheduler.pool.num_free, config.num_blocks],
            "decode": [decode.scheduler.pool.num_free + len(held), config.num_blocks],
        }
    except (NotImplementedError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - whose error it is decides how it is reported
        if watch.inside is not None:
            raise  # raised by the learner's own function: reported as the learner's error
        after = f" after your {watch.last} returned" if watch.last else ""
        record["violation"] = f"the course's engine failed{after}: {type(exc).__name__}: {exc}"[:400]
    return record


def drive_engines(answers, case: dict) -> dict:
    if not isinstance(answers, dict) or not all(callable(answers.get(k)) for k in ("pack_kv", "install_kv")):
        raise TypeError('check(...) needs {"pack_kv": pack_kv, "install_kv": install_kv}')
    with one_thread():
        model = tiny_model(case["seed"])
        return {"one_engine": _serve_one_engine(model, case), **_serve_two_engines(answers, model, case)}


def _describe(case: dict) -> str:
    config = case["config"]
    return (
        f"the small random decoder (seed {case['seed']}), {len(case['prompts'])} prompts of "
        f"{[len(p) for p in case['prompts']]} tokens, {case['new_tokens']} new tokens, blocks of "
        f"{config['block_size']} slots, {config['num_blocks']} blocks per pool, a step budget of "
        f"{config['max_num_batched_tokens']} tokens"
    )


def compare_engines(got: dict, expected: dict, case: dict) -> Mismatch | None:
    where = _describe(case)
    if expected["violation"] or expected["tokens"] != expected["one_engine"]:
        raise ReferenceFailed(f"the course's handoff does not give one engine's tokens on {where}")
    if got["violation"]:
        return Mismatch(
            "the two engines could not serve the requests", f"on {where}: {got['violation']}", hint=ENGINE_HINT
        )
    for i, (mine, want) in enumerate(zip(got["tokens"], expected["one_engine"])):
        if mine != want:
            tables = got["tables"].get(str(i))
            moved = f"; its blocks, prefill {tables['prefill']} -> decode {tables['decode']}" if tables else ""
            return Mismatch(
                "prefill and decode on two engines give other tokens than one engine",
                f"on {where}: request {i}: {token_difference(mine, want)}{moved}",
                hint=TOKENS_HINT,
            )
    for name, (free, total) in got["pools"].items():
        if free != total:
            return Mismatch(
                f"blocks of the {name} engine's pool were not returned",
                f"on {where}: {free} of {total} blocks free once every request finished (the decode engine's count "
                "includes the blocks its other requests hold)",
                hint=POOLS_HINT,
            )
    return None


@functools.cache
def course_handoff() -> dict:
    """The course's pack_kv and install_kv: the reference side of the checks."""
    from infra_lib.serving.disaggregated import install_kv, pack_kv

    return {"pack_kv": pack_kv, "install_kv": install_kv}


course_handoff.target = "infra_lib.serving.disaggregated:install_kv"  # what a sandboxed kernel sees as a stub


def _parts(make) -> dict:
    return dict(
        task=TASKS[3],
        reference=course_handoff,
        make_inputs=make,
        drive=drive_engines,
        compare=compare_engines,
    )


register(
    Check(
        check_id="lab17.handoff_in_engines",
        **_parts(engines_case),
        hint=TOKENS_HINT,
    )
)

register(
    Check(
        check_id="lab17.handoff_chunked",
        **_parts(chunked_engines_case),
        hint=TOKENS_HINT + "; here prompts are prefilled in chunks over several steps, in blocks of 3 slots",
    )
)
