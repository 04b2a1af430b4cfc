"""Lab 07 task 5's comparison: two runs of the same scheduler plans (the learner's step and the course's
runner), step by step. Layer 0's keys and values depend on the embeddings alone, so a difference there
names the slots or the positions: a key that differs in a part starting at position 0 was stored before
its rotation, one that differs only in parts starting later was rotated at the wrong position. A
difference in a later layer, or in the logits only, names attention or what follows it."""

from __future__ import annotations

from grading.checks.common import array_mismatch
from grading.checks.lab07.step_plans import token_slots
from grading.registry import Mismatch

STEP_SECTION = "chapter 07, section “8 · One step for many sequences: the flattened batch”"
KV_ATOL, KV_RTOL = 1e-4, 1e-4  # float32 keys and values of the small model (magnitudes of order 1 to 10)
LOGITS_ATOL, LOGITS_RTOL = 1e-3, 1e-4

SLOT_HINT = (
    "a token's keys and values go to the one slot its position names through its own sequence's block "
    "table: the table entry that covers the position, at the position's offset inside that block (a "
    f"block's first position is at offset 0); no other slot changes ({STEP_SECTION})."
)
VALUES_HINT = (
    "each written slot holds the value projection of the token at that position, in every layer: check "
    f"which token ids the step computes for each sequence (its scheduled positions) ({STEP_SECTION})."
)
ROPE_HINT = (
    "the store keeps keys as attention reads them: rotated (RoPE) at the token's position. Keys stored "
    f"before the rotation agree at position 0 only ({STEP_SECTION})."
)
POSITIONS_HINT = (
    "a token's position is its place in its sequence, not in the step: a chunk that continues a prompt, "
    "and a decode, start where the sequence's computed tokens end (ScheduledSeq.start), and RoPE rotates "
    f"at that position ({STEP_SECTION})."
)
ATTENTION_HINT = (
    "layer 0 stored the right keys and values, so the difference is in what a layer passes on: each "
    "sequence's queries attend over its own keys only, every position up to its own (causal inside a "
    "chunk, and all of the sequence's earlier positions, read through its block table), then the output "
    f"projection and the residual sums ({STEP_SECTION})."
)
SAMPLING_HINT = (
    "the step returns logits for sampling only: one row per sequence whose ScheduledSeq.samples is true, "
    "for its last scheduled token, in batch order; a chunk that does not finish its prompt samples "
    f"nothing ({STEP_SECTION})."
)
SHAPE_HINT = (
    "the logits are one tensor [num_sampling, vocab], whatever the step holds: a step where no sequence samples "
    f"returns 0 rows of vocab columns, [0, vocab] ({STEP_SECTION})."
)
STEP_HINT = (
    "forward_step is one forward pass over the whole plan: every scheduled token of every sequence, "
    "each at its own position; its keys and values written into its slot in every layer; each "
    "sequence's queries over its own positions; logits for the sequences that sample, in batch order "
    f"({STEP_SECTION})."
)
LOGITS_HINT = (
    "every key and value agrees, so look at what comes after the last layer's writes: that layer's "
    "attention (each sequence over its own positions, causal inside a chunk), its MLP, the final norm and "
    f"lm_head, taken at the last scheduled token of each sequence that samples ({STEP_SECTION})."
)


def _where(case: dict, index: int) -> str:
    step = case["steps"][index]
    parts = ", ".join(
        f"seq {p['seq_id']} {p['kind']} positions {p['start']}..{p['start'] + p['num_tokens'] - 1} "
        f"blocks {p['blocks']}{'' if p['samples'] else ' (does not sample)'}"
        for p in step
    )
    return f"step {index + 1} of {len(case['steps'])} (block_size {case['block_size']}; {parts})"


def _slots_mismatch(got: list, expected: list, tokens: list, where: str, layer: int, name: str) -> Mismatch:
    owner = {slot: (seq_id, p) for _, seq_id, p, slot in tokens}
    missing = [s for s in expected if s not in got]
    extra = [s for s in got if s not in expected]
    said = "; ".join(
        [f"slot {s} (seq {owner[s][0]} position {owner[s][1]}) was not written" for s in missing[:3]]
        + [f"slot {s} was written, which is no scheduled token's slot" for s in extra[:3]]
    )
    return Mismatch(
        "the step wrote keys or values into other slots than its tokens' own",
        f"on {where}, layer {layer} {name.upper()}: {said}",
        hint=SLOT_HINT,
    )


def _moved_rows(got: list, expected: list, slots: list, tokens: list) -> str:
    """Where every differing row of ``got`` is the expected row of another slot: which token's went where
    ("" when some row is no expected row at all)."""
    import numpy as np

    got_rows, expected_rows = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if got_rows.shape != expected_rows.shape:
        return ""
    owner = {slot: (seq_id, p) for _, seq_id, p, slot in tokens}
    said = []
    for i in range(len(slots)):
        if np.allclose(got_rows[i], expected_rows[i], atol=KV_ATOL, rtol=KV_RTOL):
            continue
        same = [j for j in range(len(slots)) if np.allclose(got_rows[i], expected_rows[j], atol=KV_ATOL, rtol=KV_RTOL)]
        if not same:
            return ""
        seq_id, p = owner[slots[same[0]]]
        said.append(f"slot {slots[i]} holds seq {seq_id} position {p}'s (its slot is {slots[same[0]]})")
    return "; ".join(said[:3])


def _written_mismatch(got: list, expected: list, case: dict, index: int) -> Mismatch | None:
    """The first difference in what the step wrote: slots, then values, layer 0 first."""
    import numpy as np

    where, tokens = _where(case, index), token_slots(case["steps"][index], case["block_size"])
    if len(got) != len(expected):
        return Mismatch("the store lost or gained layers", f"on {where}: {len(got)} layers, expected {len(expected)}")
    for layer, (g, e) in enumerate(zip(got, expected)):
        for name in ("k", "v"):
            if g[name]["slots"] != e[name]["slots"]:
                return _slots_mismatch(g[name]["slots"], e[name]["slots"], tokens, where, layer, name)
        for name in ("v", "k"):
            at = f"{where}, layer {layer} {name.upper()} at slots {e[name]['slots']}"
            problem = array_mismatch(
                g[name]["rows"], e[name]["rows"], "the keys or values written differ", at, KV_ATOL, KV_RTOL
            )
            if problem is None:
                continue
            moved = _moved_rows(g[name]["rows"], e[name]["rows"], e[name]["slots"], tokens)
            if moved:  # the right rows, each in another token's slot
                return Mismatch(
                    "the step wrote keys or values into other slots than its tokens' own",
                    f"on {where}, layer {layer} {name.upper()}: {moved}",
                    hint=SLOT_HINT,
                )
            if layer > 0:
                hint = ATTENTION_HINT
            elif name == "v":
                hint = VALUES_HINT
            else:  # keys wrong at layer 0: in a part that starts at 0 (the rotation), or only after (positions)?
                bad = {
                    slot
                    for slot, g_row, e_row in zip(e["k"]["slots"], g["k"]["rows"], e["k"]["rows"])
                    if not np.allclose(g_row, e_row, atol=KV_ATOL, rtol=KV_RTOL)
                }
                starts = {case["steps"][index][part]["start"] == 0 for part, _, _, slot in tokens if slot in bad}
                hint = ROPE_HINT if True in starts else POSITIONS_HINT
            return Mismatch(problem.what, problem.detail, hint=hint)
    return None


def compare_steps(got, expected, cases) -> Mismatch | None:
    """The first difference between two runs of the same plans: what a step wrote, then its logits."""
    if len(got) != len(expected) or any(len(g) != len(e) for g, e in zip(got, expected)):
        return Mismatch("the step's results have the wrong form", "a record per step of every case was expected")
    for case, got_steps, expected_steps in zip(cases, got, expected):
        for index, (g, e) in enumerate(zip(got_steps, expected_steps)):
            problem = _written_mismatch(g["written"], e["written"], case, index)
            if problem:
                return problem
            rows, want = len(g["logits"]), len(e["logits"])
            if rows != want:
                tokens = sum(p["num_tokens"] for p in case["steps"][index])
                return Mismatch(
                    "the step returned another number of rows of logits than sequences that sample",
                    f"on {_where(case, index)}: {rows} rows, expected {want}"
                    + (f" (one for each of the step's {tokens} tokens)" if rows == tokens else ""),
                    hint=SAMPLING_HINT,
                )
            if g["shape"] != e["shape"]:
                return Mismatch(
                    "the step returned logits of another shape",
                    f"on {_where(case, index)}: shape {g['shape']}, expected {e['shape']}",
                    hint=SHAPE_HINT,
                )
            at = _where(case, index)
            problem = array_mismatch(g["logits"], e["logits"], "the logits differ", at, LOGITS_ATOL, LOGITS_RTOL)
            if problem:
                return Mismatch(problem.what, problem.detail, hint=LOGITS_HINT)
    return None
