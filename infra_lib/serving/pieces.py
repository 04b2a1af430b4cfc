"""An engine assembled from pieces: the course's engine with any learner-writable piece swapped in.

Each piece a lab writes enters the engine through one seam, and only there:

    piece               lab   what it is                        where it enters
    Llama               06    the model, a class                the engine's model: SmolLM2's weights loaded
                                                                into it (the runner uses its named modules
                                                                and its rope)
    cached_attention    06    cached GQA attention step         the runner's attention, per sequence, over the
                                                                sequence's K/V gathered from its blocks
    BlockPool           07    the reference-counted block pool  the scheduler's pool (no prefix caching: the
                                                                lab's pool has no prefix cache)
    forward_step        07    the batched step                  the runner's forward: one pass over a plan's
                                                                tokens and the paged store
    schedule            08    the scheduler step                ``Scheduler.schedule``
    engine_step         08    the engine loop's step            ``LLMEngine.step``
    accept_or_resample  09    speculative decoding's rule       ``speculative_decode``'s acceptance rule

A piece that is missing (None) is the course's own. ``assemble`` builds the ``LLMEngine``;
``owners`` says which pieces are whose; ``probe`` tries a piece on a tiny input so that a task
not written yet (``NotImplementedError``) falls back to the course's piece instead of failing in
the middle of a request. The course never reads the pieces' source: a piece is whatever object
the caller hands in (``infra-lab capstone build`` makes them from a learner's lab notebooks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infra_lib.serving.block_table import blocks_needed
from infra_lib.serving.paged_attention import gather_kv
from infra_lib.serving.scheduler import Scheduler
from infra_lib.serving.scheduler_output import SchedulerConfig, SchedulerOutput


@dataclass(frozen=True)
class Piece:
    name: str
    lab: str  # the lab notebook that writes it
    what: str
    seam: str
    lesson: str  # where the course shows how to make it fast


PIECES: dict[str, Piece] = {
    p.name: p
    for p in (
        Piece(
            "Llama",
            "lab06_kv_cache",
            "the model",
            "the engine's model: SmolLM2's weights loaded into your class",
            "chapter 06 (the decoder) and chapter 16 (the C step: one token's whole model in native code)",
        ),
        Piece(
            "cached_attention",
            "lab06_kv_cache",
            "cached GQA attention",
            "the runner's attention, one sequence at a time over its gathered K/V",
            "chapter 06 (the KV cache) and chapter 15 (paged decode attention: all sequences in one call)",
        ),
        Piece(
            "BlockPool",
            "lab07_paged_kv",
            "the block pool",
            "the scheduler's pool",
            "chapter 07 (the free queue: every operation O(blocks touched))",
        ),
        Piece(
            "forward_step",
            "lab07_paged_kv",
            "the batched step",
            "the runner's forward: one pass over a plan's tokens and the paged store",
            "chapter 08 (one flattened pass per step) and chapter 15 (paged decode attention in one call)",
        ),
        Piece(
            "schedule",
            "lab08_scheduler",
            "the scheduler step",
            "Scheduler.schedule",
            "chapter 08 (a step plans in O(running + admitted); no work per waiting request)",
        ),
        Piece(
            "engine_step",
            "lab08_scheduler",
            "the engine loop's step",
            "LLMEngine.step",
            "chapter 08 (a step's bookkeeping is per scheduled sequence, never per waiting request)",
        ),
        Piece(
            "accept_or_resample",
            "lab09_spec_quant",
            "the speculative acceptance rule",
            "speculative_decode's acceptance rule",
            "chapter 09 (speculative decoding)",
        ),
    )
}


def owners(pieces: dict | None) -> dict[str, str]:
    """``{piece: "yours" | "course"}`` for every piece."""
    pieces = pieces or {}
    return {name: "yours" if pieces.get(name) is not None else "course" for name in PIECES}


def _unknown(pieces: dict) -> None:
    extra = sorted(set(pieces) - set(PIECES))
    if extra:
        raise ValueError(f"unknown piece(s) {extra}; the pieces are {sorted(PIECES)}")


# --- the block pool: the scheduler's calls on top of the lab's six operations ---------------------


class PoolForScheduler:
    """A lab 07 pool (``num_free``, ``ref_count``, ``allocate``, ``free``, ``fork``, ``prepare_write``)
    with what the scheduler asks of a pool besides: whole-prompt allocation, no prefix cache, and
    invariants read only through the pool's own answers (its counts and its free-block count)."""

    prefix_cache = None

    def __init__(self, pool):
        self.inner = pool
        self.num_blocks, self.block_size = pool.num_blocks, pool.block_size

    @property
    def num_free(self) -> int:
        return self.inner.num_free

    def ref_count(self, block_id: int) -> int:
        return self.inner.ref_count(block_id)

    def allocate(self, n: int) -> list[int]:
        return self.inner.allocate(n)

    def free(self, block_ids) -> None:
        self.inner.free(list(block_ids))

    def fork(self, block_ids) -> list[int]:
        return self.inner.fork(list(block_ids))

    def prepare_write(self, block_id: int):
        return self.inner.prepare_write(block_id)

    def can_allocate_prompt(self, token_ids) -> bool:
        return blocks_needed(len(token_ids), self.block_size) <= self.num_free

    def allocate_prompt(self, token_ids) -> tuple[list[int], int]:
        return self.allocate(blocks_needed(len(token_ids), self.block_size)), 0

    def cached_prefix(self, token_ids) -> list[int]:
        return []

    def cache_blocks(self, token_ids, block_ids) -> None:
        return None

    def check_invariants(self) -> None:
        counts = [self.inner.ref_count(b) for b in range(self.num_blocks)]
        if any(type(c) is not int or c < 0 for c in counts):
            raise AssertionError(f"the pool's reference counts are not all non-negative integers: {counts[:16]}")
        zero = sum(c == 0 for c in counts)
        if self.num_free != zero:
            raise AssertionError(f"the pool says {self.num_free} blocks are free but {zero} have reference count 0")


# --- the scheduler step --------------------------------------------------------------------------


def scheduler_class(schedule):
    """``Scheduler`` whose ``schedule`` is the lab 08 function ``schedule(self) -> SchedulerOutput``."""
    if not callable(schedule):
        raise TypeError(f"the schedule piece must be a function, got a {type(schedule).__name__}")

    class LearnerScheduler(Scheduler):
        def schedule(self):
            out = schedule(self)
            if not isinstance(out, SchedulerOutput):
                raise TypeError(f"schedule must return a SchedulerOutput, got a {type(out).__name__}")
            return out

    return LearnerScheduler


# --- attention -------------------------------------------------------------------------------------


class GatheredCache:
    """The lab 06 ``LayerCache`` a learner's ``cached_attention`` expects, over one sequence's K/V that
    the runner already wrote into its blocks: ``append`` hands back all of them."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v, self.appends = k, v, 0

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.appends += 1
        return self.k, self.v

    @property
    def length(self) -> int:
        return self.k.shape[2]


def attention_from(cached_attention):
    """The runner's attention ``(q, k_cache, v_cache, block_tables, seq_lens)`` made of a lab 06
    ``cached_attention(q, k_new, v_new, cache)``: one call per sequence, each over its gathered K/V."""
    if not callable(cached_attention):
        raise TypeError(f"the cached_attention piece must be a function, got a {type(cached_attention).__name__}")

    def attend(q, k_cache, v_cache, block_tables, seq_lens):
        t, outs = q.shape[2], []
        for b, (table, length) in enumerate(zip(block_tables, seq_lens)):
            k, v = gather_kv(k_cache, [table], [length]), gather_kv(v_cache, [table], [length])
            out = cached_attention(q[b : b + 1], k[:, :, -t:], v[:, :, -t:], GatheredCache(k, v))
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(q[b : b + 1].shape):
                got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(
                    f"cached_attention returned {got} for queries {list(q[b : b + 1].shape)}; "
                    "it must return [batch, n_heads, t, head_dim]"
                )
            outs.append(out.to(q.dtype))
        return torch.cat(outs)

    return attend


# --- the model and the batched step ---------------------------------------------------------------


_LAST_BUILT: list = []  # [(cls, model, built)]: the last model_from, so that engines built in turn share it


def model_from(cls, model):
    """``cls(model.config)`` (a lab 06 ``Llama``) holding ``model``'s weights, in eval mode, on its device
    and dtype. The class must take exactly the course's parameter names and shapes.

    The last one built is kept: several engines assembled in turn from the same class and model (a throughput
    measurement's rounds) share one copy of the weights, as the course's engines share the course's model,
    so that no round times the building of a model."""
    if not isinstance(cls, type):
        raise TypeError(f"the Llama piece must be a class, got a {type(cls).__name__}")
    if _LAST_BUILT and _LAST_BUILT[0][0] is cls and _LAST_BUILT[0][1] is model:
        return _LAST_BUILT[0][2]
    _LAST_BUILT.clear()
    mine = _built(cls, model)
    _LAST_BUILT.append((cls, model, mine))
    return mine


def _built(cls, model):
    from infra_lib.model.loaders import without_init

    weight = model.embed_tokens.weight
    with without_init():  # the weights are loaded at once: drawing random ones first would only cost time
        mine = cls(model.config)
    if not isinstance(mine, torch.nn.Module):
        raise TypeError(f"Llama(config) must be a torch.nn.Module, got a {type(mine).__name__}")
    try:
        mine.load_state_dict(model.state_dict(), strict=True)
    except RuntimeError as exc:
        raise ValueError(f"SmolLM2's weights do not load into your Llama: {str(exc)[:400]}") from None
    mine = mine.to(device=weight.device, dtype=weight.dtype).eval()
    if getattr(mine, "config", None) is None:
        mine.config = model.config
    return mine


def runner_with_step(runner, forward_step):
    """``runner`` whose ``forward(batch)`` is the lab 07 ``forward_step(model, store, batch)``, checked
    for the shape the runner samples from (``[num_sampling, vocab]``)."""
    if not callable(forward_step):
        raise TypeError(f"the forward_step piece must be a function, got a {type(forward_step).__name__}")

    def forward(batch):
        with torch.inference_mode():
            logits = forward_step(runner.model, runner.store, batch)
        want = (sum(1 for _, s in batch if s.samples), runner.model.config.vocab_size)
        if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != want:
            got = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"forward_step returned {got}; the step's sampling tokens need logits {list(want)}")
        return logits

    runner.forward = forward
    return runner


def engine_class_of(engine_step):
    """``LLMEngine`` whose ``step`` is the lab 08 ``engine_step(engine)``."""
    from infra_lib.serving.engine import engine_class

    if not callable(engine_step):
        raise TypeError(f"the engine_step piece must be a function, got a {type(engine_step).__name__}")
    return engine_class(engine_step)


# --- assembling ------------------------------------------------------------------------------------


def assemble(
    model, tokenizer=None, config: SchedulerConfig = SchedulerConfig(), pieces: dict | None = None, **engine_kwargs
):
    """An ``LLMEngine`` on ``model`` with the given pieces in place of the course's.

    Args:
        pieces: ``{"Llama": cls, "cached_attention": fn, "BlockPool": cls, "forward_step": fn, "schedule": fn,
            "engine_step": fn, "accept_or_resample": fn}``, any subset; missing or None: the course's piece.
            ``accept_or_resample`` is not used by the engine (it does not speculate); ``speculate`` uses it.
        config: the scheduler's limits; with a learner's pool, prefix caching must be off.
    """
    from infra_lib.serving.engine import LLMEngine
    from infra_lib.serving.kv_store import PagedKVStore
    from infra_lib.serving.model_runner import ModelRunner

    pieces = dict(pieces or {})
    _unknown(pieces)
    if pieces.get("BlockPool") is not None:
        if config.enable_prefix_caching:
            raise ValueError("a lab 07 pool has no prefix cache: build the engine with enable_prefix_caching=False")
        pool = PoolForScheduler(pieces["BlockPool"](config.num_blocks, config.block_size))
    else:
        pool = None
    cls = scheduler_class(pieces["schedule"]) if pieces.get("schedule") is not None else Scheduler
    scheduler = cls(config, pool)
    if pieces.get("Llama") is not None:
        model = model_from(pieces["Llama"], model)
    weight = model.embed_tokens.weight
    store = PagedKVStore.for_model(model.config, config.num_blocks, config.block_size, weight.dtype, weight.device)
    runner = ModelRunner(model, store)
    if pieces.get("cached_attention") is not None:
        runner.decode_attention = runner.chunk_attention = attention_from(pieces["cached_attention"])
        runner.attention_backend = "cached_attention (yours)"
    if pieces.get("forward_step") is not None:
        runner_with_step(runner, pieces["forward_step"])
    engine_cls = engine_class_of(pieces["engine_step"]) if pieces.get("engine_step") is not None else LLMEngine
    engine = engine_cls(runner, config, tokenizer, scheduler=scheduler, **engine_kwargs)
    engine.pieces = owners(pieces)
    return engine


def speculate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    accept_or_resample=None,
    gamma: int = 4,
    stop_ids: tuple[int, ...] = (),
):
    """Greedy speculative decoding of one prompt with a prompt-lookup draft, through the given
    acceptance rule (None: the course's); returns the ``SpeculativeResult``."""
    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving.speculative import NgramDraft, speculative_decode

    return speculative_decode(
        model,
        prompt_ids,
        NgramDraft(model.config.vocab_size),
        gamma,
        SamplingParams(max_new_tokens=max_new_tokens),
        stop_ids=stop_ids,
        accept=accept_or_resample,
    )


# --- where one decode step's time goes -----------------------------------------------------------------

STEP_PARTS = ("scheduler", "attention", "model", "loop")


def decode_step_profile(engine, prompts, steps: int, max_new_tokens: int | None = None) -> dict[str, float]:
    """One decode step of ``engine`` split into its parts, in ms: the fastest (least disturbed) of ``steps``.

    ``prompts`` (token ids, text or chat messages) are added and prefilled first, then one warm-up decode
    step runs; the parts are timed by wrapping the engine's own calls: ``scheduler`` (``schedule``, the pool
    inside it), ``attention`` (the runner's attention calls, when its forward is the course's), ``model``
    (the runner's forward less attention: your model and batched step where they are yours) and ``loop``
    (the rest of the step: sampling and the step's bookkeeping). Returns those and ``total``.
    """
    import time

    from infra_lib.model.sampling import SamplingParams

    spent = dict.fromkeys(("scheduler", "attention", "forward"), 0.0)

    def timed(part, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - t0

        return wrapper

    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens or steps + 8))
    with torch.inference_mode():
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
            engine.step()  # the prefills, not profiled
        engine.step()  # one warm-up decode step
        engine.scheduler.schedule = timed("scheduler", engine.scheduler.schedule)
        runner = engine.runner
        runner.forward = timed("forward", runner.forward)
        runner.decode_attention = timed("attention", runner.decode_attention)
        runner.chunk_attention = timed("attention", runner.chunk_attention)
        best = None
        for _ in range(steps):
            spent.update(scheduler=0.0, attention=0.0, forward=0.0)
            t0 = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t0
            parts = {
                "scheduler": spent["scheduler"],
                "attention": spent["attention"],
                "model": spent["forward"] - spent["attention"],
                "loop": total - spent["scheduler"] - spent["forward"],
                "total": total,
            }
            best = parts if best is None or total < best["total"] else best
    return {k: v * 1000 for k, v in best.items()}


# --- probing: is a piece written at all? ---------------------------------------------------------------


def _probe_pool(cls) -> None:
    pool = cls(4, 2)
    blocks = pool.allocate(2)
    pool.fork(blocks[:1])
    pool.prepare_write(blocks[0])
    pool.free(blocks)
    int(pool.num_free), pool.ref_count(0)


def _probe_schedule(fn) -> None:
    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving.sequence import Sequence

    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, block_size=4, num_blocks=8)
    scheduler = scheduler_class(fn)(config)
    scheduler.add(Sequence(0, [1, 2, 3], SamplingParams(max_new_tokens=2), config.block_size))
    scheduler.schedule()


def _probe_attention(fn) -> None:
    q, k = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 3, 4)
    fn(q, k[:, :, -1:], k[:, :, -1:], GatheredCache(k, k.clone()))


def _tiny_model():
    from infra_lib.model.config import LlamaConfig
    from infra_lib.model.model import Llama

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        intermediate_size=24,
        max_position=64,
    )
    return Llama(config).eval()


def _probe_model(cls) -> None:
    if not isinstance(cls, type):
        raise TypeError(f"the Llama piece must be a class, got a {type(cls).__name__}")
    mine = _built(cls, _tiny_model())  # not model_from: a probe must not replace the copy an engine shares
    with torch.inference_mode():
        mine(torch.tensor([[1, 2, 3]]))


def _probe_step(fn) -> None:
    from infra_lib.model.sampling import SamplingParams
    from infra_lib.serving.kv_store import PagedKVStore
    from infra_lib.serving.scheduler_output import ScheduledSeq
    from infra_lib.serving.sequence import Sequence

    model = _tiny_model()
    store = PagedKVStore.for_model(model.config, num_blocks=2, block_size=4)
    seq = Sequence(0, [1, 2, 3], SamplingParams(max_new_tokens=2), 4)
    seq.block_table.blocks.append(0)
    fn(model, store, [(seq, ScheduledSeq(0, 3, 0, "prefill", True))])


def _probe_loop(fn) -> None:
    from infra_lib.model.sampling import SamplingParams

    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, block_size=4, num_blocks=8)
    engine = assemble(_tiny_model(), config=config, pieces={"engine_step": fn})
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    engine.step()


def _probe_accept(fn) -> None:
    p, q = torch.full((2, 3), 1 / 3), torch.tensor([[0.0, 1.0, 0.0]])
    fn(p, q, [1], torch.Generator().manual_seed(0))


_PROBES = {
    "Llama": _probe_model,
    "forward_step": _probe_step,
    "engine_step": _probe_loop,
    "BlockPool": _probe_pool,
    "schedule": _probe_schedule,
    "cached_attention": _probe_attention,
    "accept_or_resample": _probe_accept,
}


def probe(name: str, piece) -> str | None:
    """None when ``piece`` runs on a tiny input; else why it cannot be used yet: the message of the
    ``NotImplementedError`` a task not written raises (other errors are the checks' business)."""
    try:
        _PROBES[name](piece)
    except NotImplementedError as exc:
        return str(exc) or f"{name} raised NotImplementedError"
    except Exception:  # noqa: BLE001 - a wrong piece is still the learner's: the checks say what is wrong
        return None
    return None
