"""Lab 17 task 3: ``install_kv(store, pool, payload, metadata)``, the decode side of the KV handoff, into a receiver
whose pool already serves other sequences: the table it returns (blocks taken from the receiver's own pool, each
held once), every byte of the store afterwards (the payload's blocks where the table says, every other block
untouched), and, for a payload it cannot take (another layout, the wrong shape, too few free blocks), the error
with nothing allocated and nothing written."""

from __future__ import annotations

import random

from grading.checks.common import reference
from grading.checks.lab17.kv_cases import DTYPES, filled_store, layout, raised, store_blocks
from grading.checks.lab17.tasks import HANDOFF_SECTION, TASKS, first_mismatch
from grading.registry import Check, Mismatch, ReferenceFailed, register

POOL_HINT = (
    "the receiver's blocks come from its own pool: allocate takes metadata.num_blocks free blocks and holds each "
    "once (reference count 1), so that the decode engine frees them when the request finishes; writing into "
    f"blocks the pool still counts as free lets the next allocation hand them to another sequence ({HANDOFF_SECTION})"
)
SENDER_IDS_HINT = (
    "metadata.source_blocks are the sender's ids, a record of where the bytes came from: on the receiver those ids "
    "may belong to other sequences. The receiver's table is the blocks its own pool hands out"
)
BYTES_HINT = (
    "block table[i] of every layer receives payload[layer, 0, i] in the keys and payload[layer, 1, i] in the "
    "values, whole blocks, exactly (the same dtype: no rounding); no other block of the store is written"
)
REFUSE_HINT = (
    "check before taking anything: a payload whose layout (block_size, n_layers, n_kv_heads, head_dim, dtype) or "
    "shape differs from the store's is refused with ValueError, and a pool with fewer free blocks than the payload "
    "needs raises the pool's OutOfBlocks; either way no block is allocated and no byte written"
)
RETURN_HINT = "install_kv returns the new block table: a list of metadata.num_blocks block ids, in the payload's order"


def _install_case(rng: random.Random, dtype: str = "float32", change: dict | None = None, tight: bool = False):
    """A receiver of 10 to 12 blocks whose first blocks other sequences hold (some freed again, so the free queue is
    out of id order), and a payload whose sender's ids are blocks the receiver's sequences hold."""
    shape = layout(rng, dtype)
    num_blocks = rng.randint(10, 12)
    held = rng.randint(5, 7)
    freed = sorted(rng.sample(range(held), 2))
    blocks = rng.randint(2, 3)
    case = {
        "layout": shape,
        "num_blocks": num_blocks,
        "held": held,
        "freed": freed,
        "source_blocks": rng.sample([b for b in range(held) if b not in freed], blocks),
        "num_tokens": (blocks - 1) * shape["block_size"] + rng.randint(1, shape["block_size"]),
        "seed": rng.randrange(10**6),
        "payload_seed": rng.randrange(10**6),
        "change": change or {},
        "tight": tight,
    }
    return case


def install_cases(rng: random.Random) -> list[dict]:
    return [_install_case(rng), _install_case(rng)]


def install_edge_cases(rng: random.Random) -> list[dict]:
    """Other dtypes, then payloads that must be refused: another head_dim, block size, layer count or dtype in the
    metadata, a payload cut short, and a pool with too few free blocks."""
    cases = [_install_case(rng, dtype) for dtype in DTYPES[1:]]
    for change in ({"head_dim": 1}, {"block_size": 1}, {"n_layers": -1}, {"dtype": "float64"}, {"cut": 1}):
        cases.append(_install_case(rng, change=change))
    cases.append(_install_case(rng, tight=True))
    return cases


def receiver(case: dict):
    """The receiving store and its pool, in the state the case describes."""
    from infra_lib.serving.block_pool import BlockPool

    store = filled_store(case["layout"], case["num_blocks"], case["seed"])
    pool = BlockPool(case["num_blocks"], case["layout"]["block_size"])
    held = pool.allocate(case["held"])
    pool.free([held[i] for i in case["freed"]])
    if case["tight"]:  # leave one block fewer free than the payload needs
        pool.allocate(pool.num_free - len(case["source_blocks"]) + 1)
    return store, pool


def payload_for(case: dict):
    """(payload, metadata): seeded bytes in the case's layout, with the metadata's changes made."""
    import torch

    from infra_lib.serving.disaggregated import KVMetadata

    shape, change = dict(case["layout"]), case["change"]
    dtype = getattr(torch, change.get("dtype", shape["dtype"]))
    for name in ("head_dim", "block_size", "n_layers"):
        shape[name] += change.get(name, 0)
    metadata = KVMetadata(
        case["num_tokens"],
        shape["block_size"],
        shape["n_layers"],
        shape["n_kv_heads"],
        shape["head_dim"],
        dtype,
        tuple(case["source_blocks"]),
    )
    generator = torch.Generator().manual_seed(case["payload_seed"])
    payload = torch.randn(metadata.payload_shape, generator=generator).to(dtype)
    if change.get("cut"):
        payload = payload[:, :, : metadata.num_blocks - 1]
    return payload, metadata


def drive_install(install, cases: list[dict]) -> list[dict]:
    if not callable(install):
        raise TypeError(f"check(...) needs your install_kv function, got a {type(install).__name__}")
    records = []
    for case in cases:
        store, pool = receiver(case)
        payload, metadata = payload_for(case)
        before = {"free": pool.num_free, "refs": [pool.ref_count(b) for b in range(pool.num_blocks)]}
        free_ids = pool.free_block_ids()
        try:
            table = install(store, pool, payload, metadata)
            record = {"kind": "value", "table": table if type(table) is list else f"a {type(table).__name__}"}
            if type(table) is list and not all(type(b) is int for b in table):
                record["table"] = f"a list of {sorted({type(b).__name__ for b in table})}"
        except (NotImplementedError, MemoryError):
            raise
        except Exception as exc:  # the learner's code may raise anything
            record = raised(exc)
        record.update(
            before=before,
            free_ids=free_ids,
            after={"free": pool.num_free, "refs": [pool.ref_count(b) for b in range(pool.num_blocks)]},
            store=store_blocks(store),
            original=store_blocks(filled_store(case["layout"], case["num_blocks"], case["seed"])),
            payload=payload.float().permute(2, 0, 1, 3, 4, 5).tolist(),  # [block][layer][K/V][slot][head][dim]
        )
        records.append(record)
    return records


def _describe(case: dict) -> str:
    shape, change = case["layout"], case["change"]
    what = "" if not change else f" whose metadata has {change} changed from the store's layout"
    tight = " (the pool one block short)" if case["tight"] else ""
    return (
        f"install_kv of a {len(case['source_blocks'])}-block payload ({case['num_tokens']} tokens, sender's blocks "
        f"{case['source_blocks']}){what} into a {shape['dtype']} store of {case['num_blocks']} blocks of "
        f"{shape['block_size']} slots whose pool holds {case['held'] - len(case['freed'])} blocks for other "
        f"sequences{tight}"
    )


def _refused(got: dict, standard: dict, case: dict, where: str) -> Mismatch | None:
    want = "OutOfBlocks" if case["tight"] else "ValueError"
    ok = got["kind"] == "raised" and (got["out_of_blocks"] if case["tight"] else got["value_error"])
    if not ok:
        have = got["error"] if got["kind"] == "raised" else f"it returned {got['table']}"
        return Mismatch(f"install_kv did not refuse the payload with {want}", f"on {where}: {have}", hint=REFUSE_HINT)
    if got["after"] != standard["before"] or got["store"] != standard["original"]:
        return Mismatch(
            f"install_kv raised {want} but had already allocated or written",
            f"on {where}: free blocks {standard['before']['free']} before, {got['after']['free']} after",
            hint=REFUSE_HINT,
        )
    return None


def _case_mismatch(got: dict, standard: dict, case: dict) -> Mismatch | None:
    """What is wrong with ``got``, judged by the contract on the ``standard`` run's pool, store and payload (the
    reference's, recorded in the grader's own process)."""
    where = _describe(case)
    if case["change"] or case["tight"]:
        return _refused(got, standard, case, where)
    if got["kind"] == "raised":
        return Mismatch(f"install_kv raised {got['type']}", f"on {where}: {got['error']}", hint=POOL_HINT)
    table, n = got["table"], len(case["source_blocks"])
    if type(table) is not list or len(table) != n:
        return Mismatch(f"install_kv must return a list of {n} block ids", f"on {where}: got {table}", hint=RETURN_HINT)
    before = standard["before"]
    if table == case["source_blocks"] and got["after"] == before:
        return Mismatch(
            "install_kv used the sender's block ids as the receiver's",
            f"on {where}: table {table}, which the receiver's pool holds for other sequences",
            hint=SENDER_IDS_HINT,
        )
    unowned = [b for b in table if not 0 <= b < case["num_blocks"] or b not in standard["free_ids"]]
    if unowned or len(set(table)) != n:
        return Mismatch(
            "install_kv's table names blocks the pool did not have free",
            f"on {where}: table {table}, free before the call {standard['free_ids']}",
            hint=POOL_HINT,
        )
    refs = got["after"]["refs"]
    expected_refs = [1 if b in table else r for b, r in enumerate(before["refs"])]
    if refs != expected_refs or got["after"]["free"] != before["free"] - n:
        return Mismatch(
            "the pool does not hold the table's blocks once each (and nothing else changed)",
            f"on {where}: table {table}; reference counts after {refs}, expected {expected_refs}",
            hint=POOL_HINT,
        )
    for b in range(case["num_blocks"]):
        want = standard["payload"][table.index(b)] if b in table else standard["original"][b]
        if got["store"][b] != want:
            what = f"the payload's block {table.index(b)}" if b in table else "its own bytes"
            return Mismatch(
                f"block {b} of the store does not hold {what}", f"on {where}: table {table}", hint=BYTES_HINT
            )
    return None


def _judge(got: dict, expected: dict, case: dict) -> Mismatch | None:
    if _case_mismatch(expected, expected, case) is not None:
        raise ReferenceFailed(f"the course's install_kv fails its own check on {_describe(case)}")
    return _case_mismatch(got, expected, case)


def compare_install(got, expected, cases: list[dict]) -> Mismatch | None:
    return first_mismatch(got, expected, cases, _judge)


INSTALL_REFERENCE = reference("infra_lib.serving.disaggregated", "install_kv")

register(
    Check(
        check_id="lab17.install_kv",
        task=TASKS[3],
        reference=INSTALL_REFERENCE,
        make_inputs=install_cases,
        drive=drive_install,
        compare=compare_install,
        hint=POOL_HINT,
    )
)

register(
    Check(
        check_id="lab17.install_kv_edges",
        task=TASKS[3],
        reference=INSTALL_REFERENCE,
        make_inputs=install_edge_cases,
        drive=drive_install,
        compare=compare_install,
        hint=REFUSE_HINT,
    )
)
