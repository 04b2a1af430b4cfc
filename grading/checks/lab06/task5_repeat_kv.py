"""Task 5's check: ``repeat_kv(x, group)``, the KV heads copied for the query heads that share them, in x's dtype."""

from __future__ import annotations

import random

from grading.checks.common import array_mismatch, reference
from grading.checks.lab06.tensors import ATTENTION, seeded, tensor_list
from grading.registry import Check, Mismatch, register


def _repeat_cases(rng: random.Random) -> list[dict]:
    cases = [
        {
            "seed": rng.randrange(10**6),
            "batch": rng.randint(1, 2),
            "n_kv_heads": kv,
            "seq": rng.randint(1, 6),
            "head_dim": rng.choice([2, 4, 8]),
            "group": group,
            "dtype": "float32",
        }
        for kv, group in [(rng.randint(2, 3), 3), (1, rng.randint(2, 5)), (rng.randint(2, 4), 1), (3, 2)]
    ]
    cases[rng.choice([0, 1, 3])]["dtype"] = "bfloat16"  # a cache kept in bf16: the copies keep x's dtype
    return cases


def _drive_repeat(repeat_kv, cases):
    import torch

    out = []
    for c in cases:
        x = seeded(c["seed"], c["batch"], c["n_kv_heads"], c["seq"], c["head_dim"]).to(getattr(torch, c["dtype"]))
        repeated = repeat_kv(x, c["group"])
        out.append({"values": tensor_list(repeated, "repeat_kv"), "dtype": str(repeated.dtype).removeprefix("torch.")})
    return out


def _describe_repeat(c) -> str:
    return (
        f"x of shape [{c['batch']}, {c['n_kv_heads']}, {c['seq']}, {c['head_dim']}] and dtype {c['dtype']} "
        f"with group={c['group']}"
    )


def _compare_repeat(got, expected, cases):
    for c, g, e in zip(cases, got, expected):
        problem = array_mismatch(
            g["values"],
            e["values"],
            "repeat_kv put the wrong key/value head under a query head",
            _describe_repeat(c),
            atol=0.0,
        )
        if problem:
            return problem
        if g["dtype"] != e["dtype"]:
            return Mismatch(
                "repeat_kv changed the dtype of the keys and values",
                f"on {_describe_repeat(c)}: expected dtype {e['dtype']}, got {g['dtype']}",
                hint="repeating a head copies its numbers, it does not convert them: the result keeps "
                "x's dtype, so a cache kept in bf16 stays bf16 (a new tensor made without x's dtype "
                "gets torch's default, float32).",
            )
    return None


register(
    Check(
        check_id="lab06.repeat_kv",
        task="lab06 task 5: repeat_kv",
        reference=reference(ATTENTION, "repeat_kv"),
        make_inputs=_repeat_cases,
        drive=_drive_repeat,
        compare=_compare_repeat,
        hint="the query heads that share a KV head are neighbours (the first group of them read KV head 0, the next "
        "group KV head 1), so each KV head's copies must sit side by side, not the whole stack of KV heads tiled group "
        "times. With a group of 1 the heads are unchanged (chapter 06, section “Lab 06”).",
    )
)
