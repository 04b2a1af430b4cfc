"""Task 4's checks: ``causal_mask(t, s)`` on prefills (t = s) and on queries that follow a cache (t < s)."""

from __future__ import annotations

import random

from grading.checks.common import reference
from grading.checks.lab06.tensors import ATTENTION
from grading.registry import Check, Mismatch, register


def _prefill_masks(rng: random.Random) -> list[list[int]]:
    return [[1, 1]] + [[n, n] for n in rng.sample(range(2, 12), 4)]


def _offset_masks(rng: random.Random) -> list[list[int]]:
    return [
        [1, rng.randint(2, 20)],
        [1, rng.randint(21, 40)],
        [rng.randint(2, 5), rng.randint(6, 15)],
        [rng.randint(2, 6), rng.randint(7, 12)],
    ]


def _drive_masks(causal_mask, cases):
    import torch

    out = []
    for t, s in cases:
        mask = causal_mask(t, s)
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"causal_mask must return a torch.Tensor, got {type(mask).__name__}")
        out.append({"dtype": str(mask.dtype), "shape": list(mask.shape), "values": mask.int().tolist()})
    return out


def _compare_masks(got, expected, cases):
    for (t, s), g, e in zip(cases, got, expected):
        where = f"causal_mask(t={t}, s={s})"
        if g["dtype"] != "torch.bool":
            return Mismatch("causal_mask must return booleans", f"{where} returned dtype {g['dtype']}")
        if g["shape"] != e["shape"]:
            return Mismatch("causal_mask returned the wrong shape", f"{where}: expected {e['shape']}, got {g['shape']}")
        if g["values"] != e["values"]:
            row = next(i for i, (a, b) in enumerate(zip(g["values"], e["values"])) if a != b)
            return Mismatch(
                "causal_mask hides or shows the wrong keys",
                f"{where}, row {row} (query at position {s - t + row}): expected {e['values'][row]}, "
                f"got {g['values'][row]}",
            )
    return None


register(
    Check(
        check_id="lab06.causal_mask_prefill",
        task="lab06 task 4: causal_mask",
        reference=reference(ATTENTION, "causal_mask"),
        make_inputs=_prefill_masks,
        drive=_drive_masks,
        compare=_compare_masks,
        hint="causality: a query may see the key at its own position and every earlier one, never a later one, so with "
        "t = s (a prefill) the mask is lower-triangular. Return a torch.bool tensor of shape [t, s], True where "
        "attending is allowed (chapter 06, section “Lab 06”).",
    )
)

register(
    Check(
        check_id="lab06.causal_mask_with_cache",
        task="lab06 task 4: causal_mask",
        reference=reference(ATTENTION, "causal_mask"),
        make_inputs=_offset_masks,
        drive=_drive_masks,
        compare=_compare_masks,
        hint="with a cache the t queries are the LAST t of the s positions, not the first: every cached key lies in "
        "their past, so the mask's diagonal runs into the bottom-right corner instead of starting at the top-left, "
        "and a decode step (t = 1) sees every key. Rows are queries, columns keys (chapter 06, section “Lab 06”).",
    )
)
