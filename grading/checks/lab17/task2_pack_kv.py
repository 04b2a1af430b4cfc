"""Lab 17 task 2: ``pack_kv(store, block_table, num_tokens)``, the prefill side of the KV handoff, on seeded stores
and scattered tables: the payload's shape, dtype, layout and every byte, the metadata, an untouched store and
table, and ValueError for a table it cannot read. When the bytes differ, the comparison looks for the usual
mistakes in the learner's payload (the table's blocks read in sorted order, K and V swapped, the slots past
``num_tokens`` left out) and names the one it finds."""

from __future__ import annotations

import math
import random

from grading.checks.common import reference
from grading.checks.lab17.kv_cases import DTYPES, filled_store, layout, metadata_record, raised, same_store, snapshot
from grading.checks.lab17.tasks import HANDOFF_SECTION, TASKS, first_mismatch
from grading.registry import Check, Mismatch, register

ORDER_HINT = (
    "the payload's i-th block is the block table[i] (it holds positions i x block_size onward), whatever the ids are: "
    "a table is in position order, not in id order (a pool hands out blocks in the order they were freed)"
)
KV_HINT = (
    "along the payload's second dim, index 0 holds the keys (store.k[layer]) and index 1 the values (store.v[layer])"
)
PARTIAL_HINT = (
    "whole blocks travel: the payload holds len(block_table) blocks of block_size slots each, the part-full last block "
    "too, with whatever its unused slots hold, so that the receiver's blocks are laid out like the sender's and its "
    f"engine writes the next token into the slot after num_tokens ({HANDOFF_SECTION})"
)
SHAPE_HINT = (
    "the payload is one tensor of shape (n_layers, 2, len(block_table), block_size, n_kv_heads, head_dim): layer, "
    "K or V, the table's blocks, then each block's slots as the store keeps them"
)
DTYPE_HINT = "the payload keeps the store's dtype: the bytes travel as they are stored (bfloat16 stays bfloat16)"
CONTIGUOUS_HINT = (
    "the payload is a new contiguous tensor: the wire sends its memory as one buffer (a view of the store or a "
    "permuted tensor is not one)"
)
METADATA_HINT = (
    "the metadata is the course's KVMetadata (imported by the setup cell): num_tokens as given, the store's layout "
    "(block_size, n_layers, n_kv_heads, head_dim, dtype) and source_blocks, the table's ids in table order, a tuple"
)
UNCHANGED_HINT = "pack_kv only reads: it changes neither the store nor the block table it is given"
ERRORS_HINT = (
    "a table pack_kv cannot read raises ValueError before anything is packed: an id outside 0..store.num_blocks - 1, "
    "an id twice, more or fewer blocks than num_tokens fills (one per started block of block_size slots), or "
    "num_tokens below 1"
)


def _scattered(rng: random.Random, num_blocks: int, count: int) -> list[int]:
    """``count`` distinct ids, neither ascending nor contiguous (unless there is no other way)."""
    for _ in range(50):
        table = rng.sample(range(num_blocks), count)
        if count < 2 or table != sorted(table):
            return table
    return table


def _pack_case(rng: random.Random, shape: dict, num_blocks: int, table: list[int], num_tokens: int, **extra) -> dict:
    return {
        "layout": shape,
        "num_blocks": num_blocks,
        "seed": rng.randrange(10**6),
        "table": table,
        "num_tokens": num_tokens,
        **extra,
    }


def pack_cases(rng: random.Random) -> list[dict]:
    """A part-full last block, full blocks in descending order, one token, on float32 stores."""
    cases = []
    for blocks, fill in ((3, "part"), (2, "full"), (1, "one")):
        shape, num_blocks = layout(rng), rng.randint(6, 10)
        if fill == "full":
            table = sorted(rng.sample(range(num_blocks), blocks))[::-1]
        else:
            table = _scattered(rng, num_blocks, blocks)
        bs = shape["block_size"]
        num_tokens = {"part": (blocks - 1) * bs + rng.randint(1, bs - 1), "full": blocks * bs, "one": 1}[fill]
        cases.append(_pack_case(rng, shape, num_blocks, table, num_tokens))
    return cases


def pack_edge_cases(rng: random.Random) -> list[dict]:
    """bfloat16 and float16 stores, every block of a store in shuffled order, and tables that must be refused."""
    cases = []
    for dtype in DTYPES[1:]:
        shape = layout(rng, dtype)
        cases.append(_pack_case(rng, shape, 8, _scattered(rng, 8, 3), 2 * shape["block_size"] + 1))
    shape = layout(rng)
    bs = shape["block_size"]
    cases.append(_pack_case(rng, shape, 5, _scattered(rng, 5, 5), 5 * bs - 1))
    for table, num_tokens in (
        ([1, 4, 1], 2 * bs + 1),  # an id twice
        ([2, 6], bs + 1),  # an id outside the store
        ([-1, 2], bs + 1),  # a negative id
        ([0, 2, 3], bs),  # more blocks than the tokens fill
        ([3], bs + 1),  # fewer
        ([4], 0),  # no token
    ):
        cases.append(_pack_case(rng, shape, 6, table, num_tokens, refused=True))
    return cases


def _drive_one(pack, case: dict) -> dict:
    import torch

    store = filled_store(case["layout"], case["num_blocks"], case["seed"])
    kept, table = snapshot(store), list(case["table"])
    try:
        result = pack(store, table, case["num_tokens"])
    except (NotImplementedError, MemoryError):
        raise
    except Exception as exc:  # the learner's code may raise anything
        return raised(exc)
    record = {"kind": "value", "unchanged": same_store(store, kept) and table == case["table"]}
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
        return {**record, "form": f"a {type(result).__name__}"}
    payload, metadata = result
    record.update(
        form="ok",
        shape=list(payload.shape),
        dtype=str(payload.dtype).replace("torch.", ""),
        contiguous=payload.is_contiguous(),
        metadata=metadata_record(metadata),
    )
    if payload.numel() <= 200_000:
        record["payload"] = payload.detach().float().tolist()
    return record


def drive_pack(pack, cases: list[dict]) -> list[dict]:
    if not callable(pack):
        raise TypeError(f"check(...) needs your pack_kv function, got a {type(pack).__name__}")
    return [_drive_one(pack, case) for case in cases]


def _describe(case: dict) -> str:
    shape = case["layout"]
    return (
        f"pack_kv(store, {case['table']}, {case['num_tokens']}) on a {shape['dtype']} store of {case['num_blocks']} "
        f"blocks of {shape['block_size']} slots, {shape['n_layers']} layers, {shape['n_kv_heads']} KV head(s) of "
        f"{shape['head_dim']} dims"
    )


def payload_mistake(got, expected, case: dict) -> tuple[str, str] | None:
    """(what, hint) for a payload of the expected shape whose bytes differ, naming the mistake it shows."""
    import numpy as np

    mine, theirs = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    table, bs = case["table"], case["layout"]["block_size"]
    order = np.argsort(table, kind="stable")
    if len(table) > 1 and list(order) != list(range(len(table))) and np.array_equal(mine, theirs[:, :, order]):
        return "the payload holds the table's blocks in the order of their ids, not in the table's order", ORDER_HINT
    if np.array_equal(mine, theirs[:, ::-1]):
        return "the payload has the keys where the values belong, and the values where the keys belong", KV_HINT
    used = case["num_tokens"] - (len(table) - 1) * bs  # slots used in the last block
    if used < bs:
        outside = np.ones(theirs.shape, dtype=bool)
        outside[:, :, -1, used:] = False
        if np.array_equal(mine[outside], theirs[outside]):
            return "the last block's slots past num_tokens are not the store's", PARTIAL_HINT
    return None


def _first_difference(got, expected) -> str:
    import numpy as np

    mine, theirs = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    index = tuple(int(i) for i in np.argwhere(mine != theirs)[0])
    names = ("layer", "K/V", "block", "slot", "head", "dim")
    where = ", ".join(f"{n} {i}" for n, i in zip(names, index))
    return f"first at {where}: expected {theirs[index]:.6g}, got {mine[index]:.6g}"


def _case_mismatch(got: dict, expected: dict, case: dict) -> Mismatch | None:
    where = _describe(case)
    if case.get("refused"):
        if got["kind"] == "raised" and got["value_error"]:
            return None
        have = got["error"] if got["kind"] == "raised" else "it returned a payload"
        return Mismatch(
            "pack_kv did not refuse a table it cannot read with ValueError", f"on {where}: {have}", hint=ERRORS_HINT
        )
    if got["kind"] == "raised":
        return Mismatch(f"pack_kv raised {got['type']}", f"on {where}: {got['error']}", hint=SHAPE_HINT)
    if got["form"] != "ok":
        return Mismatch(
            "pack_kv must return (payload, metadata)", f"on {where}: it returned {got['form']}", hint=SHAPE_HINT
        )
    if got["shape"] != expected["shape"]:
        shape = case["layout"]
        tokens = shape["n_layers"] * 2 * case["num_tokens"] * shape["n_kv_heads"] * shape["head_dim"]
        partial = math.prod(got["shape"]) == tokens
        return Mismatch(
            "the payload has the wrong shape" + (": it holds num_tokens slots, not whole blocks" if partial else ""),
            f"on {where}: expected {expected['shape']}, got {got['shape']}",
            hint=PARTIAL_HINT if partial else SHAPE_HINT,
        )
    if got["dtype"] != expected["dtype"]:
        return Mismatch(
            "the payload's dtype is not the store's",
            f"on {where}: expected {expected['dtype']}, got {got['dtype']}",
            hint=DTYPE_HINT,
        )
    if "payload" in got and got["payload"] != expected["payload"]:
        named = payload_mistake(got["payload"], expected["payload"], case)
        what, hint = named or ("the payload's bytes differ from the store's blocks", SHAPE_HINT)
        return Mismatch(what, f"on {where}: {_first_difference(got['payload'], expected['payload'])}", hint=hint)
    if not got["contiguous"]:
        return Mismatch("the payload is not contiguous", f"on {where}", hint=CONTIGUOUS_HINT)
    if got["metadata"] != expected["metadata"]:
        fields = [k for k in expected["metadata"] if got["metadata"].get(k) != expected["metadata"][k]]
        shown = "; ".join(f"{k}: expected {expected['metadata'][k]!r}, got {got['metadata'].get(k)!r}" for k in fields)
        return Mismatch("the metadata differs from the contract's", f"on {where}: {shown}", hint=METADATA_HINT)
    if not got["unchanged"]:
        return Mismatch("pack_kv changed the store or the block table", f"on {where}", hint=UNCHANGED_HINT)
    return None


def compare_pack(got, expected, cases: list[dict]) -> Mismatch | None:
    return first_mismatch(got, expected, cases, _case_mismatch)


PACK_REFERENCE = reference("infra_lib.serving.disaggregated", "pack_kv")

register(
    Check(
        check_id="lab17.pack_kv",
        task=TASKS[2],
        reference=PACK_REFERENCE,
        make_inputs=pack_cases,
        drive=drive_pack,
        compare=compare_pack,
        hint=SHAPE_HINT,
    )
)

register(
    Check(
        check_id="lab17.pack_kv_edges",
        task=TASKS[2],
        reference=PACK_REFERENCE,
        make_inputs=pack_edge_cases,
        drive=drive_pack,
        compare=compare_pack,
        hint=ERRORS_HINT + "; bfloat16 and float16 stores keep their dtype",
    )
)
