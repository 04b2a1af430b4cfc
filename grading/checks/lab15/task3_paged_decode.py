"""Lab 15 task 3: the paged decode attention kernel, on ragged batches over shuffled blocks, other
layouts and head counts, its traffic (blocks read in place), then inside the small decoder's paged
decoding."""

from __future__ import annotations

import math
import random

from grading.checks.common import reference
from grading.checks.lab15.kernel_checks import (
    CAUSAL_SECTION,
    LESSON,
    MODEL_SECTION,
    Failure,
    KernelSpec,
    as_values,
    attending_with,
    attention64,
    close,
    compare_in_model,
    compare_traffic,
    compare_values,
    draw_seed,
    gaps_hint,
    generator,
    launch,
    launch_in_a_model,
    not_a_multiple,
    require_kernel,
    task_parts,
    to_device,
)
from grading.checks.model_cases import tiny_model, tiny_prompts
from grading.checks.triton_cases import UNWRITTEN
from grading.registry import Check, register

REFERENCE = reference("infra_lib.kernels.paged_decode", "paged_decode_kernel")


def _paged_case(
    rng: random.Random,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    lengths: list[int],
    *,
    layout: str = "plain",
    special: str = "",
) -> dict:
    return {
        "seed": draw_seed(rng),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": block_size,
        "lengths": lengths,
        "layout": layout,
        "special": special,
    }


def _paged_ragged(rng):
    # in every case the first sequence is the longest, with a partial last block: most mistakes show on it
    return [
        _paged_case(rng, 4, 2, 16, 4, [not_a_multiple(rng, 9, 15, 4), 0, 1, 8]),
        _paged_case(rng, 2, 2, 8, 8, [not_a_multiple(rng, 17, 30, 8), rng.randint(2, 16), rng.randint(1, 16)]),
        _paged_case(rng, 3, 1, 20, 4, [not_a_multiple(rng, 9, 15, 4), rng.randint(1, 8)]),
    ]


def _paged_layouts(rng):
    return [
        _paged_case(rng, 4, 2, 16, 6, [not_a_multiple(rng, 13, 20, 6), 6, 0, 3]),
        _paged_case(rng, 9, 3, 64, 16, [not_a_multiple(rng, 20, 40, 16), rng.randint(1, 15)], layout="padded"),
        _paged_case(rng, 2, 1, 16, 4, [not_a_multiple(rng, 9, 15, 4), 2], special="huge"),
        _paged_case(rng, 2, 1, 8, 4, [0, 0]),
    ]


def _paged_traffic_cases(rng):
    return [
        _paged_case(rng, 4, 2, 16, 4, [not_a_multiple(rng, 20, 30, 4), rng.randint(1, 10), 0]),
        _paged_case(rng, 6, 2, 8, 8, [rng.randint(10, 20)]),
    ]


def _paged_tensors(case):
    """q [batch, heads, 1, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim] whose slots no
    sequence owns hold NaN; the block tables [batch, width] int32, blocks shuffled over the cache, the
    entries past a sequence's last block naming spare (NaN) blocks; the lengths, int32."""
    import torch

    lengths, size, kv, d = case["lengths"], case["block_size"], case["kv_heads"], case["head_dim"]
    seeded = generator(case["seed"])
    needed = [-(-n // size) for n in lengths]
    num_blocks = sum(needed) + 2
    order = torch.randperm(num_blocks, generator=seeded).tolist()
    spare = order[sum(needed) :]
    width = max(needed) + 2
    tables = torch.tensor(
        [
            order[sum(needed[:i]) : sum(needed[: i + 1])] + [spare[j % 2] for j in range(width - n)]
            for i, n in enumerate(needed)
        ],
        dtype=torch.int32,
    )
    pad = 3 if case["layout"] == "padded" else 0  # padded rows: the head dimension is not the row stride
    caches = []
    for _ in range(2):
        cache = torch.full((num_blocks, size, kv, d + pad), float("nan"))[..., :d]
        for row, n in zip(tables.tolist(), lengths):
            for position in range(n):
                cache[row[position // size], position % size] = torch.randn(kv, d, generator=seeded)
        caches.append(cache)
    q = torch.randn(len(lengths), case["heads"], 1, d + pad, generator=seeded)[..., :d]
    if case["special"] == "huge":  # scores of the order of 1e4
        q, caches = q * 60, [cache * 60 for cache in caches]
    return q, caches[0], caches[1], tables, torch.tensor(lengths, dtype=torch.int32)


def _paged_alternatives(case, q, k_cache, v_cache, tables) -> dict:
    """Per sequence, in float64: the output with query heads mapped by h % n_kv_heads, and the output
    over the context less its last token."""
    import torch

    h, kv, size = case["heads"], case["kv_heads"], case["block_size"]
    found = {"heads_modulo": [], "one_short": []}
    truth = []
    for b, n in enumerate(case["lengths"]):
        slots = [(tables[b, p // size].item(), p % size) for p in range(n)]
        keys = torch.stack([k_cache[block, slot] for block, slot in slots], 1)[None] if n else None  # [1, kv, n, d]
        values = torch.stack([v_cache[block, slot] for block, slot in slots], 1)[None] if n else None
        query = q[b : b + 1]

        def attend(mapping, length):
            if length == 0:
                return torch.zeros(1, h, 1, q.shape[-1], dtype=torch.float64)
            return attention64(
                query, keys[:, :, :length], values[:, :, :length], torch.ones(1, length, dtype=torch.bool), mapping
            )[1]

        grouped = [head // (h // kv) for head in range(h)]
        truth.append(attend(grouped, n))
        found["heads_modulo"].append(attend([head % kv for head in range(h)], n))
        found["one_short"].append(attend(grouped, max(n - 1, 0)))
    truth = torch.cat(truth)
    found = {name: torch.cat(outs) for name, outs in found.items()}
    return {name: out.tolist() for name, out in found.items() if not torch.allclose(out, truth, atol=1e-4)}


def paged_launch(kernel, out, q, k_cache, v_cache, tables, lengths):
    """(grid, args, meta) of ``kernel`` on these tensors, as task 3 states the launch."""
    from infra_lib.kernels.triton_env import next_power_of_2

    batch, heads, _, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    args = (
        out,
        q,
        k_cache,
        v_cache,
        tables,
        lengths,
        group,
        head_dim,
        1 / math.sqrt(head_dim),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        tables.stride(0),
    )
    meta = {
        "BLOCK_SIZE": block_size,
        "BLOCK_ROWS": next_power_of_2(block_size),
        "BLOCK_G": next_power_of_2(group),
        "BLOCK_D": next_power_of_2(head_dim),
    }
    return (batch, kv_heads), args, meta


def drive_paged(kernel, cases):
    """Task 3's driver: each case's sequences in one launch over shuffled blocks, with the usual mistakes' outputs."""
    import torch

    require_kernel(kernel, "paged_decode_kernel")
    results = []
    for case in cases:
        q, k_cache, v_cache, tables, lengths = _paged_tensors(case)
        alternatives = _paged_alternatives(case, q, k_cache, v_cache, tables)
        q, k_cache, v_cache, tables, lengths = to_device(q, k_cache, v_cache, tables, lengths)
        out = torch.full(q.shape, UNWRITTEN, device=q.device)
        if case["layout"] == "padded":  # out's rows padded too, by another amount than q's: its own strides
            out = torch.full((*q.shape[:3], q.shape[3] + 5), UNWRITTEN, device=q.device)[..., : q.shape[3]]
        grid, args, meta = paged_launch(kernel, out, q, k_cache, v_cache, tables, lengths)
        inputs = {
            "q_ptr": q,
            "k_cache_ptr": k_cache,
            "v_cache_ptr": v_cache,
            "tables_ptr": tables,
            "seq_lens_ptr": lengths,
        }
        result = launch(kernel, grid, args, meta, inputs)
        result.update(out=as_values(out), alternatives=alternatives)
        results.append(result)
    return results


def _describe_paged(case) -> str:
    h, kv, d, size = case["heads"], case["kv_heads"], case["head_dim"], case["block_size"]
    extra = {"huge": ", scores of the order of 1e4"}.get(case["special"], "")
    layout = (
        ", q, out and the caches with rows padded past head_dim (out by another amount than q)"
        if case["layout"] == "padded"
        else ""
    )
    return (
        f"{len(case['lengths'])} sequences of {case['lengths']} tokens, {h} query heads over {kv} KV heads, "
        f"head_dim {d}, blocks of {size} slots{layout}{extra}, grid ({len(case['lengths'])}, {kv})"
    )


_PAGED = f"{LESSON} “5 · Paged decode: reading blocks in place”"
PAGED_TABLE_HINT = (
    "the first sequence came out right and a later one did not: each sequence has its own row of "
    "block ids, and row b starts stride_table entries after the table's start (the table is wider "
    "than most sequences need); within the row, entry i names the block that holds positions "
    f"i * BLOCK_SIZE onwards ({_PAGED})."
)
PAGED_LAST_BLOCK_HINT = (
    "a slot past the sequence's last token was read: the last block is usually partial, so a "
    "sequence of n tokens owns slots 0 to n - 1 only, and the table entries past its last block "
    "name no block of it (in these checks those slots hold NaN, and the output shows it) "
    f"({_PAGED})."
)
PAGED_ONE_SHORT_HINT = (
    "the output matches attention over every token but the last: a sequence of n tokens covers "
    "positions 0 to n - 1, the new token's own key and value included, over cdiv(n, BLOCK_SIZE) "
    f"blocks ({_PAGED})."
)
PAGED_GQA_HINT = (
    "the query heads are mapped to the wrong KV heads: the program of KV head j serves query heads "
    "j * group to j * group + group - 1 (query head h reads KV head h // group), loading their "
    f"queries and storing their outputs at those heads' strides ({CAUSAL_SECTION}; {_PAGED})."
)
PAGED_STRIDES_HINT = (
    "only the case with padded rows differs: q, out and the caches each have rows longer than "
    "head_dim there, out's padded by another amount than q's. Every address comes from its own "
    "tensor's strides (stride_qb, stride_qh for q; stride_ob, stride_oh for out; the caches' own), "
    f"never from head_dim or another tensor's strides ({_PAGED})."
)
PAGED_EMPTY_HINT = (
    "an empty context (0 tokens) must give a row of zeros: there is nothing to attend to, so the "
    f"sum stays 0 and the output must not divide by it ({_PAGED})."
)


def _diagnose_paged(failure: Failure) -> str:
    if failure.matches("heads_modulo"):
        return PAGED_GQA_HINT
    if failure.matches("one_short"):
        return PAGED_ONE_SHORT_HINT
    lengths, size = failure.case["lengths"], failure.case["block_size"]
    wrong = [
        b for b in range(len(lengths)) if not close(failure.got["out"][b], failure.expected["out"][b], failure.atol)
    ]
    if wrong and all(lengths[b] == 0 for b in wrong):
        return PAGED_EMPTY_HINT
    if lengths[0] % size and 0 not in wrong and any(lengths[b] for b in wrong):
        return PAGED_TABLE_HINT  # the first sequence (the longest, its last block partial) shows most other mistakes
    if failure.non_finite():
        return PAGED_LAST_BLOCK_HINT
    if failure.only_where(lambda c: c["layout"] == "padded"):
        return PAGED_STRIDES_HINT
    if failure.only_where(lambda c: c["heads"] > c["kv_heads"]):
        return PAGED_GQA_HINT
    return ""


def _paged_access_hint(violation: dict) -> str:
    argument = violation["argument"]
    if violation["side"] == "between":
        return gaps_hint(argument, _PAGED)
    if argument in ("k_cache_ptr", "v_cache_ptr"):
        return (
            f"a load reached outside `{argument}`: a tile of BLOCK_ROWS rows covers a block of BLOCK_SIZE slots "
            "(BLOCK_ROWS is BLOCK_SIZE rounded up to a power of two), dims past head_dim must not be read, and "
            f"only the table entries of the sequence's own blocks name blocks to read ({_PAGED})."
        )
    return (
        f"an access reached outside `{argument}`: BLOCK_G lanes cover the group's query heads (group rounded up "
        "to a power of two) and BLOCK_D lanes the head dimension: lanes past the group or past head_dim must be "
        f"neither read nor stored ({_PAGED})."
    )


_PAGED_KERNEL = KernelSpec(
    "paged_decode_kernel", (("out", "out_ptr"),), _describe_paged, _paged_access_hint, _diagnose_paged
)

_PAGED_HINT = (
    "one program per (sequence, KV head) serves the group's query heads: it loads the sequence's length, then "
    "walks its blocks in table order, loading each block id from the table and that block's live rows of K and V "
    "in place, with a running max, sum and accumulator per query head (float32); an empty context gives zeros. "
    "Shapes here: ragged lengths in one launch (0, 1, a multiple of the block size, a partial last block), "
    f"shuffled blocks, tables wider than needed; MHA, GQA and MQA ({_PAGED})."
)

register(
    Check(
        check_id="lab15.paged_ragged",
        make_inputs=_paged_ragged,
        compare=compare_values(_PAGED_KERNEL),
        hint=_PAGED_HINT,
        **task_parts(3, REFERENCE, drive_paged),
    )
)

register(
    Check(
        check_id="lab15.paged_layouts",
        make_inputs=_paged_layouts,
        compare=compare_values(_PAGED_KERNEL),
        hint=_PAGED_HINT + " Here: blocks of 6 slots (BLOCK_ROWS 8), SmolLM2's 9 query heads over 3 KV heads with "
        "head_dim 64 and rows padded past head_dim (use the strides), scores of the order of 1e4, and a batch of empty "
        "contexts.",
        **task_parts(3, REFERENCE, drive_paged),
    )
)

register(
    Check(
        check_id="lab15.paged_in_place",
        make_inputs=_paged_traffic_cases,
        compare=compare_traffic(
            _PAGED_KERNEL,
            "per program its length, its group's queries, one block id per block and "
            "each live K and V row once; its group's outputs stored once",
        ),
        hint="decode attention reads the blocks where they are: no K or V row is copied anywhere, each live row of the "
        "program's KV head is loaded once for the whole group of query heads (not once per query head), each block "
        "id once, and nothing but the outputs is stored. Budget: per program its length, its group's queries, one "
        f"block id per block and each live K and V row once; its group's outputs stored once ({_PAGED}).",
        **task_parts(3, REFERENCE, drive_paged),
    )
)


# --- task 3 in a model ------------------------------------------------------------------------------------


def paged_cached_attention_with(kernel):
    """The model's attention step on a ``PagedLayerCache``: write this step's K/V into their slots; a
    decode step (t = 1) launches ``kernel`` through ``check_bounds``, a prefill uses the torch
    ``paged_attention``. The model stays on the CPU; with a GPU, the step's tensors go to it and back."""

    def attend(q, k_new, v_new, cache):
        import torch

        from infra_lib.serving.paged_attention import paged_attention

        cache.write(k_new, v_new)
        if q.shape[2] != 1:
            return paged_attention(q, cache.k_cache, cache.v_cache, [cache.block_table], [cache.length])
        tables = torch.tensor([cache.block_table], dtype=torch.int32)
        lengths = torch.tensor([cache.length], dtype=torch.int32)
        device_q, k_cache, v_cache, tables, lengths = to_device(q, cache.k_cache, cache.v_cache, tables, lengths)
        out = torch.full(q.shape, UNWRITTEN, dtype=q.dtype, device=k_cache.device)
        launch_in_a_model(
            kernel, "paged_decode_kernel", *paged_launch(kernel, out, device_q, k_cache, v_cache, tables, lengths)
        )
        return out.to(q.device)

    return attend


def _drive_paged_in_model(kernel, case):
    """Greedy tokens of the small random model decoding through ``kernel`` (the reference side: the
    model's own paged attention in torch)."""
    import torch

    from infra_lib.serving import BlockPool, PagedKVStore, paged_greedy_decode

    require_kernel(kernel, "paged_decode_kernel")
    own = kernel is REFERENCE()
    model = tiny_model(case["seed"])
    results = []
    with torch.inference_mode(), attending_with(model, None if own else paged_cached_attention_with(kernel)):
        for prompt in case["prompts"]:
            size = case["block_size"]
            pool, store = BlockPool(16, size), PagedKVStore.for_model(model.config, 16, size)
            pool.allocate(case["skip_blocks"])  # the sequence's blocks do not start at block 0
            results.append({"tokens": paged_greedy_decode(model, store, pool, prompt, case["new_tokens"]).token_ids})
    return results


def _paged_model_case(rng: random.Random) -> dict:
    return {
        "model": "tiny",
        "seed": draw_seed(rng),
        "new_tokens": 4,
        "block_size": rng.choice([3, 4]),
        "skip_blocks": rng.randint(1, 4),
        "prompts": tiny_prompts(rng, [rng.randint(2, 9)]),
    }


register(
    Check(
        check_id="lab15.paged_in_tiny_model",
        make_inputs=_paged_model_case,
        compare=compare_in_model,
        hint="the small random model decodes through your kernel: every decode step attends its one new query over the "
        "blocks the sequence owns in a paged store (6 query heads over 2 KV heads, head_dim 8), the new token's key "
        f"and value already written into their slot ({_PAGED}; {MODEL_SECTION}).",
        **task_parts(3, REFERENCE, _drive_paged_in_model),
    )
)
