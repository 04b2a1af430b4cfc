"""Lab 17's tasks as their stubs name them, and the lesson sections its hints point to."""

from __future__ import annotations

from grading.registry import Mismatch

TASKS = {
    1: "lab17 task 1: PrefixRouter",
    2: "lab17 task 2: pack_kv",
    3: "lab17 task 3: install_kv",
    4: "lab17 task 4: shard_mlp and tp_mlp_forward",
    5: "lab17 task 5: top_k_gating",
}
_CHAPTER = "chapter 17, section"
ROUTING_SECTION = f"{_CHAPTER} “2 · Routing by prefix, within a load bound”"
HANDOFF_SECTION = f"{_CHAPTER} “5 · The KV handoff: its bytes, its time, and when the split pays”"
SPLIT_SECTION = f"{_CHAPTER} “4 · Prefill and decode on separate workers”"
TP_SECTION = f"{_CHAPTER} “6 · Tensor-parallel decode”"
MOE_SECTION = f"{_CHAPTER} “7 · Experts across processes”"


def first_mismatch(got, expected, cases: list, judge) -> Mismatch | None:
    """The first case whose data ``judge(got, expected, case)`` finds wrong, or None when every case is right."""
    if type(got) is not list or len(got) != len(cases):
        return Mismatch("the check recorded the wrong number of cases")
    for mine, theirs, case in zip(got, expected, cases):
        mismatch = judge(mine, theirs, case)
        if mismatch is not None:
            return mismatch
    return None
