"""Lab 15 task 2: the FlashAttention forward kernel, on odd shapes (prefill, chunk, decode step; MHA,
GQA, MQA), extreme scores, unequal tiles and its traffic, then inside the small decoder and SmolLM2,
every layer attending through it."""

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
from grading.checks.model_cases import case_model, case_prompts, greedy_through, smollm2_case, tiny_model_case
from grading.checks.triton_cases import UNWRITTEN
from grading.registry import Check, register

REFERENCE = reference("infra_lib.kernels.flash_attention", "flash_attention_kernel")


def _flash_case(
    rng: random.Random,
    batch: int,
    heads: int,
    kv_heads: int,
    t: int,
    s: int,
    head_dim: int,
    *,
    causal: bool = True,
    blocks=(16, 16),
    layout: str = "contiguous",
    special: str = "",
) -> dict:
    return {
        "seed": draw_seed(rng),
        "batch": batch,
        "heads": heads,
        "kv_heads": kv_heads,
        "t": t,
        "s": s,
        "head_dim": head_dim,
        "causal": causal,
        "blocks": list(blocks),
        "layout": layout,
        "special": special,
    }


def _flash_odd_shapes(rng):
    chunk = rng.randint(3, 9)
    return [
        _flash_case(rng, 1, 1, 1, 1, 1, 8),
        _flash_case(rng, 2, 4, 2, *[not_a_multiple(rng, 17, 40)] * 2, 16, layout="model"),
        _flash_case(rng, 1, 3, 1, chunk, not_a_multiple(rng, 33, 45), 20, special="rising"),
        _flash_case(rng, 1, 2, 2, 1, not_a_multiple(rng, 30, 50), 16),
        _flash_case(rng, 2, 2, 1, rng.randint(5, 15), not_a_multiple(rng, 17, 40), 8, causal=False),
    ]


def _flash_extremes(rng):
    t = rng.randint(5, 15)
    # "huge" has no masked key (not causal, s a multiple of BLOCK_N): only a missing shift fails it
    return [
        _flash_case(rng, 1, 2, 1, rng.randint(10, 32), rng.choice([32, 48]), 16, causal=False, special="huge"),
        _flash_case(rng, 1, 2, 2, t, not_a_multiple(rng, t + 17, 50), 16, special="negative"),
        _flash_case(rng, 1, 3, 1, rng.randint(5, 15), not_a_multiple(rng, 40, 60), 16, causal=False, special="rising"),
    ]


def _flash_block_shapes(rng):
    return [
        _flash_case(rng, 1, 3, 1, *[not_a_multiple(rng, 33, 50)] * 2, 64, blocks=(32, 16), layout="model"),
        _flash_case(rng, 1, 2, 1, rng.randint(10, 20), not_a_multiple(rng, 40, 70, 32), 24, blocks=(16, 32)),
        _flash_case(
            rng, 2, 4, 2, rng.randint(5, 20), not_a_multiple(rng, 30, 60), 24, blocks=(32, 16), layout="strided"
        ),
    ]


def _flash_traffic_cases(rng):
    # The last two make a causal query block's last visible key fall inside a key block that also holds keys
    # past it (a chunk of more than one query block after cached keys; BLOCK_N > BLOCK_M): reading that key
    # block up to s instead of up to the block's end shows in the bytes. With t = s and square tiles it cannot.
    chunk = rng.randint(17, 30)
    return [
        _flash_case(rng, 1, 2, 1, *[not_a_multiple(rng, 33, 50)] * 2, 16),
        _flash_case(rng, 1, 2, 2, rng.randint(5, 15), not_a_multiple(rng, 30, 50), 8),
        _flash_case(rng, 1, 1, 1, rng.randint(17, 30), not_a_multiple(rng, 31, 45), 16, causal=False),
        _flash_case(rng, 1, 2, 1, chunk, chunk + not_a_multiple(rng, 20, 60), 16),
        _flash_case(rng, 1, 2, 1, *[not_a_multiple(rng, 33, 50)] * 2, 16, blocks=(16, 32)),
    ]


def _flash_tensors(case):
    """q [batch, heads, t, head_dim] and k, v [batch, kv_heads, s, head_dim], float32."""
    import torch

    b, h, kv, t, s, d = (case[key] for key in ("batch", "heads", "kv_heads", "t", "s", "head_dim"))
    seeded = generator(case["seed"])
    if case["layout"] == "model":  # as the model makes them: [batch, positions, heads, head_dim] transposed
        q, k, v = (
            torch.randn(b, n, heads, d, generator=seeded).transpose(1, 2) for n, heads in ((t, h), (s, kv), (s, kv))
        )
    elif case["layout"] == "strided":  # the head dimension is not the contiguous one: stride_*d is the length
        q, k, v = (
            torch.randn(b, heads, d, n, generator=seeded).transpose(2, 3) for n, heads in ((t, h), (s, kv), (s, kv))
        )
    else:
        q = torch.randn(b, h, t, d, generator=seeded)
        k, v = torch.randn(b, kv, s, d, generator=seeded), torch.randn(b, kv, s, d, generator=seeded)
    direction = torch.nn.functional.normalize(torch.randn(d, generator=seeded), dim=0)
    size = math.sqrt(300 * math.sqrt(d))  # size * size / sqrt(d) = 300
    if case["special"] == "huge":  # scores of the order of 1e4
        q, k = q * 60, k * 60
    elif case["special"] == "negative":  # every score near -300: exp of any of them underflows against 0
        q = q * 0.05 + size * direction
        k = k * 0.05 - size * direction
    elif case["special"] == "rising":  # later keys score higher: the running max grows block after block
        k = k + (torch.arange(s, dtype=torch.float32) / s * 8)[None, None, :, None] * direction
        q = q + 2 * direction
    return q, k, v


def _visible(t: int, s: int, causal: bool, offset: int | None = None):
    """[t, s] keys each query sees; causal: query i sees keys 0 .. offset + i (offset s - t by default)."""
    import torch

    if not causal:
        return torch.ones(t, s, dtype=torch.bool)
    offset = s - t if offset is None else offset
    return torch.arange(s)[None, :] <= torch.arange(t)[:, None] + offset


def _flash_alternatives(case, q, k, v) -> dict:
    """What the usual mistakes would give, in float64: an accumulator (or accumulator and sum) not
    rescaled when the max grows, the causal mask on another diagonal, query heads mapped to KV heads
    by h % n_kv_heads."""
    import torch

    h, kv, t, s = case["heads"], case["kv_heads"], case["t"], case["s"]
    grouped = [head // (h // kv) for head in range(h)]
    scores, truth = attention64(q, k, v, _visible(t, s, case["causal"]), grouped)
    values = v.double()[:, grouped]
    block = case["blocks"][1]
    block_max = torch.stack([scores[..., i : i + block].amax(-1) for i in range(0, s, block)], -1)
    running = torch.cummax(block_max, -1).values
    weights = torch.exp(scores - running.repeat_interleave(block, -1)[..., :s])  # each key against its block's max
    found = {
        "acc_not_rescaled": (weights @ values) / torch.exp(scores - running[..., -1:]).sum(-1, keepdim=True),
        "neither_rescaled": (weights @ values) / weights.sum(-1, keepdim=True),
    }
    if case["causal"] and t < s:
        found["diagonal_at_i"] = attention64(q, k, v, _visible(t, s, True, 0), grouped)[1]
    if case["causal"]:
        found["diagonal_one_late"] = attention64(q, k, v, _visible(t, s, True, s - t + 1), grouped)[1]
    if 1 < kv < h:
        modulo = [head % kv for head in range(h)]
        found["heads_modulo"] = attention64(q, k, v, _visible(t, s, case["causal"]), modulo)[1]
    return {name: out.tolist() for name, out in found.items() if not torch.allclose(out, truth, atol=1e-4)}


def flash_launch(kernel, q, k, v, out, lse, *, causal: bool, blocks=(16, 16)):
    """(grid, args, meta) of ``kernel`` on these tensors, as task 2 states the launch."""
    from infra_lib.kernels.triton_env import next_power_of_2

    batch, heads, t, head_dim = q.shape
    s = k.shape[2]
    grid = (-(-t // blocks[0]), batch * heads)
    args = (
        q,
        k,
        v,
        out,
        lse,
        heads,
        heads // k.shape[1],
        t,
        s,
        head_dim,
        1 / math.sqrt(head_dim),
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
    )
    meta = {
        "CAUSAL": bool(causal),
        "BLOCK_M": blocks[0],
        "BLOCK_N": blocks[1],
        "BLOCK_D": max(16, next_power_of_2(head_dim)),
    }
    return grid, args, meta


def _flash_output(case, device):
    """``out`` filled with UNWRITTEN: contiguous, or for the "strided" layout a [batch, t, heads, head_dim]
    buffer with padded rows, transposed (out's strides are then neither q's nor contiguous ones)."""
    import torch

    b, h, t, d = case["batch"], case["heads"], case["t"], case["head_dim"]
    if case["layout"] == "strided":
        return torch.full((b, t, h, d + 3), UNWRITTEN, device=device)[..., :d].transpose(1, 2)
    return torch.full((b, h, t, d), UNWRITTEN, device=device)


def drive_flash(kernel, cases):
    """Task 2's driver: each case's q, k and v launched as the task states, with the usual mistakes' outputs."""
    import torch

    require_kernel(kernel, "flash_attention_kernel")
    results = []
    for case in cases:
        q, k, v = _flash_tensors(case)
        alternatives = _flash_alternatives(case, q, k, v)
        q, k, v = to_device(q, k, v)
        b, h, t = case["batch"], case["heads"], case["t"]
        out = _flash_output(case, q.device)
        lse = torch.full((b, h, t), UNWRITTEN, device=q.device)
        grid, args, meta = flash_launch(kernel, q, k, v, out, lse, causal=case["causal"], blocks=case["blocks"])
        result = launch(kernel, grid, args, meta, {"q_ptr": q, "k_ptr": k, "v_ptr": v})
        result.update(out=as_values(out), lse=as_values(lse), alternatives=alternatives)
        results.append(result)
    return results


def _describe_flash(case) -> str:
    b, h, kv, t, s, d = (case[key] for key in ("batch", "heads", "kv_heads", "t", "s", "head_dim"))
    extra = {
        "huge": ", scores of the order of 1e4",
        "negative": ", every score near -300",
        "rising": ", scores that grow along the keys",
    }.get(case["special"], "")
    layout = {
        "model": ", q, k and v transposed views (the model's layout)",
        "strided": ", q, k and v with the head dimension strided (stride_*d = t or s), out a transposed view "
        "with padded rows",
    }.get(case["layout"], "")
    bm, bn = case["blocks"]
    return (
        f"q [{b}, {h}, {t}, {d}], k and v [{b}, {kv}, {s}, {d}] (group {h // kv}), "
        f"{'causal' if case['causal'] else 'not causal'}{layout}{extra}, BLOCK_M={bm}, BLOCK_N={bn}, "
        f"grid ({-(-t // bm)}, {b * h})"
    )


_TILES = f"{LESSON} “3 · FlashAttention: tiles and a running max”"
FLASH_RESCALE_HINT = (
    "the output matches attention whose accumulator was never rescaled: when a key block raises "
    "a row's running max, what the accumulator (and the running sum) already hold was weighted "
    "against the smaller max and must shrink by exp(old max - new max) before the block's "
    f"p @ v is added ({_TILES})."
)
FLASH_DIAGONAL_HINT = (
    "the causal mask sits on the wrong diagonal: the t queries are the last t of the s positions, "
    "so query i sits at position s - t + i and sees keys 0 to s - t + i, itself included; "
    "with t < s (a chunk on top of a cache, a decode step) the mask is not the square one "
    f"({CAUSAL_SECTION})."
)
FLASH_GQA_HINT = (
    "the query heads are mapped to the wrong key/value heads: with n_heads = group * n_kv_heads, "
    "consecutive query heads share a KV head, so query head h reads KV head h // group (heads 0 to "
    "group - 1 read KV head 0); with one query head per KV head every mapping looks right "
    f"({CAUSAL_SECTION})."
)
FLASH_MASK_HINT = (
    "a masked score took part in the running max: with every visible score near -300, a lane past s "
    "(or past the diagonal) that scores 0 becomes the max, and every real exp underflows to 0. The "
    f"mask must be applied to the scores before their max is taken ({_TILES})."
)
FLASH_SHIFT_HINT = (
    "exp overflows float32 above about 88: every exponential must be taken against the row's running "
    f"max, so that scores of the order of 1e4 stay finite ({_TILES})."
)
FLASH_STRIDES_HINT = (
    "only the case with an unusual layout differs: there the head dimension is not the contiguous one "
    "(stride_qd, stride_kd and stride_vd are not 1) and out is a transposed view with padded rows. "
    "Every address comes from its own tensor's four strides, the dim's included, never from an "
    f"assumed layout or another tensor's strides ({_TILES})."
)
FLASH_V_HINT = (
    "your log-sum-exp is right, so the scores, the mask, the running max and the running sum are too: "
    "what differs is the output, that is the V rows read (their strides, their KV head), the "
    f"accumulator's rescaling as the max grows, or the final division by the sum ({_TILES})."
)


def _diagnose_flash(failure: Failure) -> str:
    for names, hint in (
        (("acc_not_rescaled", "neither_rescaled"), FLASH_RESCALE_HINT),
        (("diagonal_at_i", "diagonal_one_late"), FLASH_DIAGONAL_HINT),
        (("heads_modulo",), FLASH_GQA_HINT),
    ):
        if failure.matches(*names):
            return hint
    if failure.non_finite():  # "negative" fails both mistakes, "huge" (nothing masked) only the missing shift
        huge_passed = any(c["special"] == "huge" and i not in failure.failing for i, c in enumerate(failure.cases))
        return FLASH_MASK_HINT if failure.case["special"] == "negative" and huge_passed else FLASH_SHIFT_HINT
    if failure.only_where(lambda c: c["layout"] == "strided"):
        return FLASH_STRIDES_HINT
    if failure.only_where(lambda c: c["heads"] > c["kv_heads"]):
        return FLASH_GQA_HINT
    if failure.only_where(lambda c: c["causal"] and c["t"] < c["s"]):
        return FLASH_DIAGONAL_HINT
    if close(failure.got["lse"], failure.expected["lse"], 1e-4):
        return FLASH_V_HINT
    return ""


def _flash_access_hint(violation: dict) -> str:
    argument = violation["argument"]
    if violation["side"] == "between":
        return gaps_hint(argument, _TILES)
    if violation["kind"] == "store":
        return (
            f"a store reached outside `{argument}`: query rows past t and dims past head_dim (BLOCK_D is a power "
            "of two, at least 16) must not be stored; lse holds t float32 per (batch, head), contiguous, "
            f"at lse_ptr + (batch * n_heads + head) * t + row ({_TILES})."
        )
    if argument in ("k_ptr", "v_ptr"):
        return (
            f"a load reached outside `{argument}`: the last key block is usually partial, so lanes at s and beyond "
            "(and dims past head_dim) must not be read; with the causal mask, a query block needs no key past "
            f"its last query's position either ({CAUSAL_SECTION})."
        )
    return (
        f"a load reached outside `{argument}`: the last query block is usually partial and BLOCK_D may exceed "
        "head_dim: rows past t and dims past head_dim must not be read, and the value they get instead must "
        f"add nothing to a dot product ({_TILES})."
    )


_FLASH = KernelSpec(
    "flash_attention_kernel",
    (("out", "out_ptr"), ("lse", "lse_ptr")),
    _describe_flash,
    _flash_access_hint,
    _diagnose_flash,
)


_FLASH_HINT = (
    "each program owns BLOCK_M queries of one (batch, head) and walks the key blocks once, keeping per query a "
    "running max, a running sum and an accumulator of p @ v, all float32, rescaled whenever the max grows; out = "
    "accumulator / sum and lse = max + log(sum). Query i sits at position s - t + i, query head h reads KV head "
    "h // group, and every tensor is walked with its own strides. Shapes here: one token, a prefill (t = s), a "
    "chunk (t < s), a decode step (t = 1), not causal; MHA, GQA and MQA; q, k and v as transposed views "
    f"({_TILES}; {CAUSAL_SECTION})."
)

register(
    Check(
        check_id="lab15.flash_odd_shapes",
        make_inputs=_flash_odd_shapes,
        compare=compare_values(_FLASH),
        hint=_FLASH_HINT,
        **task_parts(2, REFERENCE, drive_flash),
    )
)

register(
    Check(
        check_id="lab15.flash_extreme_scores",
        make_inputs=_flash_extremes,
        compare=compare_values(_FLASH),
        hint=_FLASH_HINT + " Here the scores are extreme: of the order of 1e4, near -300 for every visible key, or "
        "growing along the keys so that the running max rises block after block.",
        **task_parts(2, REFERENCE, drive_flash),
    )
)

register(
    Check(
        check_id="lab15.flash_block_shapes",
        make_inputs=_flash_block_shapes,
        compare=compare_values(_FLASH),
        hint=_FLASH_HINT + " Here BLOCK_M and BLOCK_N differ, and head_dim is 64 or 24: the query tile's rows go with "
        "BLOCK_M and the grid's first axis, the key tile's with BLOCK_N.",
        **task_parts(2, REFERENCE, drive_flash),
    )
)

register(
    Check(
        check_id="lab15.flash_traffic",
        make_inputs=_flash_traffic_cases,
        compare=compare_traffic(
            _FLASH,
            "Q, out and lse once; each query block reads the K and V rows up to its last "
            "visible key once, and no row past it",
        ),
        hint="the score matrix never leaves the program: no score or probability is stored, and each query block reads "
        "every K and V row it needs exactly once. With the causal mask, key blocks past a query block's last visible "
        "key are skipped, and the last key block visited is read only up to that key. Budget: Q, out and lse once; "
        f"each query block reads the K and V rows 0 to its last visible key once ({CAUSAL_SECTION}).",
        **task_parts(2, REFERENCE, drive_flash),
    )
)


# --- task 2 in a model ------------------------------------------------------------------------------------


def flash_cached_attention_with(kernel):
    """The model's attention step (``model.using_attention``) on ``kernel``: append this step's keys and
    values to the cache, then launch the kernel, causal, through ``check_bounds``. The model stays on
    the CPU; with a GPU, each step's tensors go to it and the output comes back."""

    def attend(q, k_new, v_new, cache):
        import torch

        keys, values = cache.append(k_new, v_new)
        device_q, keys, values = to_device(q, keys, values)
        out = torch.full(q.shape, UNWRITTEN, dtype=q.dtype, device=keys.device)
        lse = torch.full(q.shape[:3], UNWRITTEN, dtype=torch.float32, device=keys.device)
        launch_in_a_model(
            kernel, "flash_attention_kernel", *flash_launch(kernel, device_q, keys, values, out, lse, causal=True)
        )
        return out.to(q.device)

    return attend


def _drive_flash_in_model(kernel, case):
    """Greedy tokens of a model whose every layer attends with ``kernel``. The reference side is the
    model's own torch attention (the reference kernel gives the same tokens, tests/test_attention_backends.py),
    which spares the grader the interpreter's time on the reference."""
    from infra_lib.kernels.triton_env import interpreter_active

    require_kernel(kernel, "flash_attention_kernel")
    own = kernel is REFERENCE()
    model = case_model(case)
    with attending_with(model, None if own else flash_cached_attention_with(kernel)):
        results = greedy_through(model, case_prompts(case, chat=False), case["new_tokens"])
    return [{**result, "interpreted": interpreter_active()} for result in results]


_IN_A_MODEL = (
    "every layer of the model attends through your kernel: the prompt with t = s (causal), then each new "
    "token with t = 1 over the whole cache, q a transposed view and k, v the cache's contiguous keys. If "
    "the kernel checks above pass and this fails, look at t = 1 and at the query heads of a group "
    f"({CAUSAL_SECTION}; {MODEL_SECTION})."
)

register(
    Check(
        check_id="lab15.flash_in_tiny_model",
        make_inputs=lambda rng: tiny_model_case(rng, 4),
        compare=compare_in_model,
        hint=_IN_A_MODEL,
        **task_parts(2, REFERENCE, _drive_flash_in_model),
    )
)

_SHORT_PROMPTS = ["The capital of France is", "Water boils at", "The largest planet is", "One, two, three,"]

# One greedy token on SmolLM2 (the prompt's prefill through the learner's kernel, its logits compared too): the
# interpreter runs every program of 30 layers in Python; the small decoder's checks decode several.
register(
    Check(
        check_id="lab15.flash_in_smollm2",
        make_inputs=lambda rng: smollm2_case(rng, 1, _SHORT_PROMPTS),
        compare=compare_in_model,
        hint=_IN_A_MODEL + " This one runs SmolLM2-135M-Instruct itself (9 query heads over 3 KV heads, head_dim 64).",
        **task_parts(2, REFERENCE, _drive_flash_in_model),
    )
)
