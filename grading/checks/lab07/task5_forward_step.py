"""Lab 07 task 5: the batched step over the paged store, ``forward_step(model, store, batch)``. The
course's scheduler plans real steps (prefill chunks, continued chunks, decodes, sequences that do not
sample, blocks anywhere in the pool); the learner's step and the course's runner replay them in order,
each on its own store filled with stale values, and every step's logits and every slot each layer's K
and V changed are compared (``step_judging``)."""

from __future__ import annotations

import random

from grading.checks.lab07.step_judging import STEP_HINT, compare_steps
from grading.checks.lab07.step_plans import step_case, token_slots
from grading.checks.model_cases import tiny_model
from grading.registry import Check, register

TASK = "lab07 task 5: forward_step"
UNWRITTEN = 1e4  # what a slot holds until the step writes it: a key read before it is written stands out


def _reference():
    """The course's step: ``ModelRunner.forward`` on a runner over the same model and store."""
    from infra_lib.serving.model_runner import ModelRunner

    def forward_step(model, store, batch):
        return ModelRunner(model, store).forward(batch)

    return forward_step


def _batch(step: list[dict], block_size: int) -> list:
    """One plan's ``[(Sequence, ScheduledSeq)]``, rebuilt from its plain record."""
    from infra_lib.serving.scheduler_output import ScheduledSeq
    from infra_lib.serving.sequence import Sequence, SequenceStatus

    batch = []
    for part in step:
        seq = Sequence(part["seq_id"], part["prompt"], block_size=block_size)
        seq.output_ids = list(part["output"])
        seq.block_table.blocks = list(part["blocks"])
        seq.num_computed_tokens, seq.status = part["start"], SequenceStatus.RUNNING
        scheduled = ScheduledSeq(part["seq_id"], part["num_tokens"], part["start"], part["kind"], part["samples"])
        batch.append((seq, scheduled))
    return batch


def _changed(before, after) -> dict:
    """The slots whose row differs between two of one layer's K (or V) tensors, and their new rows."""
    old, new = before.reshape(-1, *before.shape[2:]), after.reshape(-1, *after.shape[2:])
    slots = (old != new).flatten(1).any(1).nonzero().flatten().tolist()
    return {"slots": slots, "rows": new[slots].double().tolist()}


def _drive(forward_step, cases: list[dict]) -> list[list[dict]]:
    """Every case's steps in order on one store per case, filled with stale values first: per step, the
    logits and, per layer, the slots whose K or V changed with their new rows."""
    import torch

    from infra_lib.serving.kv_store import PagedKVStore

    results = []
    for case in cases:
        model = tiny_model(case["model_seed"])
        # one spare block past the scheduler's pool, which no block table holds: a write past a table's
        # last slot lands there, where the comparison sees it
        store = PagedKVStore.for_model(model.config, case["num_blocks"] + 1, case["block_size"])
        generator = torch.Generator().manual_seed(case["seed"])
        for cache in store.k + store.v:  # what earlier sequences left in the blocks
            cache.copy_(torch.randn(cache.shape, generator=generator))
        steps = []
        with torch.inference_mode():
            for step in case["steps"]:
                # the slots this step writes hold a marker first, so that every write there shows, even one
                # of the value the slot held (a sequence recomputed into the block it had before)
                planned = torch.tensor([slot for *_, slot in token_slots(step, case["block_size"])])
                for cache in store.k + store.v:
                    cache.view(-1, *cache.shape[2:])[planned] = UNWRITTEN
                before = [(k.clone(), v.clone()) for k, v in zip(store.k, store.v)]
                logits = forward_step(model, store, _batch(step, case["block_size"]))
                if not isinstance(logits, torch.Tensor):
                    raise TypeError(f"forward_step returned a {type(logits).__name__}, not a tensor of logits")
                written = [
                    {"k": _changed(k0, k), "v": _changed(v0, v)} for (k0, v0), k, v in zip(before, store.k, store.v)
                ]
                steps.append(
                    {"logits": logits.detach().double().cpu().tolist(), "shape": list(logits.shape), "written": written}
                )
        results.append(steps)
    return results


def _visible(rng: random.Random) -> list[dict]:
    return [step_case(rng, [4], prefix_caching=False, tight=False)]


def _hidden(rng: random.Random) -> list[dict]:
    """Block sizes from 1 to 5; a pool with a prefix cache (an admission starts after its cached
    blocks); a pool small enough to preempt (a sequence recomputed from position 0)."""
    return [
        step_case(rng, [1, 2, 3, 5], prefix_caching=False, tight=False),
        step_case(rng, [2, 3, 4], prefix_caching=True, tight=False),
        step_case(rng, [2, 3], prefix_caching=False, tight=True),
    ]


_PARTS = dict(task=TASK, reference=_reference, drive=_drive, compare=compare_steps, hint=STEP_HINT)

register(Check(check_id="lab07.forward_step", make_inputs=_visible, **_PARTS))

register(Check(check_id="lab07.forward_step_scheduled", make_inputs=_hidden, **_PARTS))
