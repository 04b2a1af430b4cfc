"""Lab 07 task 4 inside a model: the learner's pool behind a paged KV cache, serving a small random
model and SmolLM2 with forked sequences."""

from __future__ import annotations

import random

from grading.checks.common import array_mismatch, token_difference
from grading.checks.lab07.pool_replay import POOL, SHARING_SECTION, TASKS, new_pool, plain_number
from grading.checks.lab07.stand_ins import pool_for_task, recording_pool
from grading.checks.model_cases import case_model, case_prompts, smollm2_case, tiny_prompts
from grading.registry import Check, Mismatch, register

_QUESTIONS = ["What is a GPU?", "Name three planets.", "Why is the sky blue?", "What does a compiler do?"]


def _tiny_model_case(rng: random.Random) -> dict:
    block_size = rng.choice([2, 3, 4])
    lengths = [rng.randint(2, 14) for _ in range(2)]
    lengths = [n + 1 if n % block_size == 0 else n for n in lengths]  # a part-full last block is shared
    return {
        "model": "tiny",
        "seed": rng.randrange(10**6),
        "block_size": block_size,
        "new_tokens": 8,
        "samples": 3,
        "prompts": tiny_prompts(rng, lengths),
    }


def _smollm2_case(rng: random.Random) -> dict:
    return smollm2_case(rng, 5, _QUESTIONS, block_size=16, samples=2)


def _parallel_samples(model, store, pool, prompt: list[int], samples: int, new_tokens: int) -> dict:
    """Prefill a prompt once, fork its sequence ``samples - 1`` times, start sample i from the
    i-th most likely first token, and decode the samples in turn, one token each per round."""
    import torch

    from infra_lib.serving import PagedKVCache

    parent = PagedKVCache.for_prompt(store, pool, prompt)
    logits = model(torch.tensor([parent.pending_token_ids]), parent, last_only=True)
    firsts = [int(t) for t in logits[0, -1].topk(samples).indices]
    sequences = [parent] + [parent.fork() for _ in range(samples - 1)]
    shared_counts = [pool.ref_count(b) for b in parent.table.blocks]
    tokens, top_logits = [[t] for t in firsts], [[] for _ in firsts]
    for _ in range(new_tokens - 1):
        for sequence, out, tops in zip(sequences, tokens, top_logits):
            sequence.reserve([out[-1]])
            step = model(torch.tensor([[out[-1]]]), sequence, last_only=True)[0, -1]
            tops.append(float(step.max()))
            out.append(int(step.argmax()))
    for sequence in sequences:
        sequence.release()
    return {
        "shared_counts": shared_counts,
        "tokens": tokens,
        "top_logits": top_logits,
        "num_free_after": plain_number(pool.num_free),
    }


def _pool_shape(case: dict, prompts: list[list[int]]) -> tuple[int, int]:
    """(num_blocks, block_size) of the case's pool."""
    block_size = case["block_size"]
    if any(len(p) % block_size == 0 for p in prompts):
        block_size += 1  # a part-full last prompt block, so that the samples copy it on write
    longest = max(len(p) for p in prompts) + case["new_tokens"]
    return case["samples"] * -(-longest // block_size) + 2, block_size


def _serve(model, store, pool, prompts: list[list[int]], case: dict, contiguous: bool) -> list[dict]:
    """Greedy tokens through the pool: whole requests (the small model), then forked samples of each prompt;
    with ``contiguous``, the same tokens from the contiguous cache beside them."""
    import torch

    from infra_lib.model.generation import greedy_decode
    from infra_lib.serving import paged_greedy_decode

    results = []
    with torch.inference_mode():
        for prompt in prompts:
            result = {"prompt_length": len(prompt), "num_blocks": store.num_blocks, "block_size": store.block_size}
            if case["model"] == "tiny":
                decoded = paged_greedy_decode(model, store, pool, prompt, case["new_tokens"])
                result["tokens"] = decoded.token_ids
                result["num_free_after"] = plain_number(pool.num_free)
                if contiguous:
                    result["contiguous"] = greedy_decode(model, prompt, case["new_tokens"])
            sampled = _parallel_samples(model, store, pool, prompt, case["samples"], case["new_tokens"])
            if contiguous:
                sampled["contiguous"] = [
                    [t[0]] + greedy_decode(model, prompt + [t[0]], case["new_tokens"] - 1) for t in sampled["tokens"]
                ]
            result["samples"] = sampled
            results.append(result)
    return results


def _with_model_decisions(make):
    """``make``'s case with the reference's decisions for tasks 1-3's methods while the paged cache serves it
    (``"decisions"``). Which blocks the cache asks for, shares, copies and frees depends on the lengths alone,
    not on the tokens, so they are recorded on a model of one small layer."""

    def make_inputs(rng: random.Random) -> dict:
        import torch

        from infra_lib.model.config import LlamaConfig
        from infra_lib.model.model import Llama
        from infra_lib.serving import PagedKVStore

        case = make(rng)
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=8,
            n_layers=1,
            n_heads=1,
            n_kv_heads=1,
            head_dim=8,
            intermediate_size=8,
            max_position=4096,
            rope_theta=1000.0,
        )
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Llama(config).eval()
        prompts = [[t % config.vocab_size for t in p] for p in case_prompts(case)]
        num_blocks, block_size = _pool_shape(case, prompts)
        decisions: dict = {}
        pool = recording_pool(decisions, 4)(num_blocks, block_size)
        _serve(model, PagedKVStore.for_model(config, num_blocks, block_size), pool, prompts, case, contiguous=False)
        case["decisions"] = [[list(key), decision] for key, decision in decisions.items()]
        return case

    return make_inputs


def _drive_in_model(pool_class, case):
    """Greedy tokens through the learner's pool: whole requests, then forked samples of one prompt;
    and, for comparison, the same tokens from the contiguous cache."""
    from infra_lib.serving import PagedKVStore
    from infra_lib.serving.block_pool import BlockPool

    if pool_class is not BlockPool:  # prepare_write is task 4's; the rest the stand-ins'
        pool_class, _ = pool_for_task(pool_class, 4, case.get("decisions", ()))
    model = case_model(case)
    prompts = case_prompts(case)
    num_blocks, block_size = _pool_shape(case, prompts)
    pool = new_pool(pool_class, num_blocks, block_size)
    try:  # block 0 of a fresh pool is free (ValueError): an unwritten prepare_write names its task here
        pool.prepare_write(0)
    except NotImplementedError:
        raise
    except Exception:
        pass
    return _serve(
        model, PagedKVStore.for_model(model.config, num_blocks, block_size), pool, prompts, case, contiguous=True
    )


def _compare_in_model(got, expected, case):
    model = "SmolLM2" if case["model"] == "smollm2" else "the small random model"
    for g, e in zip(got, expected):
        where = f"{model}, a prompt of {e['prompt_length']} tokens, BlockPool({e['num_blocks']}, {e['block_size']})"
        if "tokens" in e:
            if g["tokens"] != e["contiguous"]:
                return Mismatch(
                    "greedy decoding through your pool gives other tokens than the contiguous cache",
                    f"on {where}, one request: {token_difference(g['tokens'], e['contiguous'])}",
                )
            if g["num_free_after"] != e["num_free_after"]:
                return Mismatch(
                    "a finished request did not give all its blocks back",
                    f"on {where}: after the request released its blocks num_free is {g['num_free_after']}, "
                    f"expected {e['num_free_after']}",
                )
        gs, es = g["samples"], e["samples"]
        samples = len(es["tokens"])
        if gs["shared_counts"] != es["shared_counts"]:
            return Mismatch(
                "after forking, the prompt's blocks have the wrong reference counts",
                f"on {where}, {samples} samples sharing the prompt: expected counts {es['shared_counts']} "
                f"for the prompt's blocks, got {gs['shared_counts']}",
            )
        for i, (g_tokens, e_tokens) in enumerate(zip(gs["tokens"], es["contiguous"])):
            if g_tokens != e_tokens:
                return Mismatch(
                    "a forked sample gives other tokens than the contiguous cache (copy-on-write?)",
                    f"on {where}, sample {i + 1} of {samples} (prompt shared, then its own tokens): "
                    f"{token_difference(g_tokens, e_tokens)}",
                )
        problem = array_mismatch(
            gs["top_logits"],
            es["top_logits"],
            "a forked sample's logits differ",
            f"{where}, {samples} samples",
            atol=1e-3,
            rtol=1e-4,
        )
        if problem:
            return problem
        if gs["num_free_after"] != es["num_free_after"]:
            return Mismatch(
                "forked samples did not give all their blocks back",
                f"on {where}: after every sample released its blocks num_free is {gs['num_free_after']}, "
                f"expected {es['num_free_after']}",
            )
    return None


def in_model_parts(make) -> dict:
    """The fields of task 4's checks inside a model, with the cases ``make`` draws."""
    return dict(
        task=TASKS[4],
        reference=POOL,
        make_inputs=_with_model_decisions(make),
        drive=_drive_in_model,
        compare=_compare_in_model,
    )


_IN_MODEL_HINT = (
    "here a paged KV cache drives your pool, so a slip in its books shows up as other tokens: if the "
    "step-by-step checks pass but a forked sample's tokens differ, a block another sample still held "
    "was written in place instead of copied. If blocks are still held once every sequence has been "
    "released, some count rose more often than it fell: sharing, copying and freeing must balance "
    f"({SHARING_SECTION})."
)

register(
    Check(
        check_id="lab07.pool_in_model",
        hint=_IN_MODEL_HINT,
        **in_model_parts(_tiny_model_case),
    )
)

register(
    Check(
        check_id="lab07.parallel_sampling_smollm2",
        hint=_IN_MODEL_HINT + " This one runs SmolLM2-135M-Instruct itself.",
        **in_model_parts(_smollm2_case),
    )
)
