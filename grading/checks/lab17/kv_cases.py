"""What lab 17's KV-handoff checks share: seeded paged stores and payloads, a store read back as plain data, and
a call's outcome (what it returned, or the error it raised) in a form the comparison can read."""

from __future__ import annotations

import random

DTYPES = ("float32", "bfloat16", "float16")


def layout(rng: random.Random, dtype: str = "float32") -> dict:
    """A small paged layout: 2 or 3 layers, blocks of 3 to 5 slots, 1 or 2 KV heads of 4 to 6 dims."""
    return {
        "n_layers": rng.randint(2, 3),
        "block_size": rng.randint(3, 5),
        "n_kv_heads": rng.randint(1, 2),
        "head_dim": rng.randint(4, 6),
        "dtype": dtype,
    }


def filled_store(shape: dict, num_blocks: int, seed: int):
    """A ``PagedKVStore`` of ``num_blocks`` blocks, every element a seeded random value (no two blocks alike)."""
    import torch

    from infra_lib.serving.kv_store import PagedKVStore

    dtype = getattr(torch, shape["dtype"])
    store = PagedKVStore(
        shape["n_layers"], num_blocks, shape["block_size"], shape["n_kv_heads"], shape["head_dim"], dtype
    )
    generator = torch.Generator().manual_seed(seed)
    for cache in store.k + store.v:
        cache.copy_(torch.randn(cache.shape, generator=generator).to(dtype))
    return store


def store_blocks(store) -> list:
    """The store as plain data, block by block: ``[block][layer][K=0 / V=1][slot][head][dim]`` as floats."""
    import torch

    stacked = torch.stack([torch.stack((k, v)) for k, v in zip(store.k, store.v)])  # [L, 2, blocks, slots, H, D]
    return stacked.permute(2, 0, 1, 3, 4, 5).float().tolist()


def same_store(store, snapshot: list) -> bool:
    import torch

    return all(torch.equal(a, b) for a, b in zip(store.k + store.v, snapshot))


def snapshot(store) -> list:
    return [t.clone() for t in store.k + store.v]


def metadata_record(metadata) -> dict:
    """What a returned metadata says, field by field, and whether it is the course's ``KVMetadata``."""
    from infra_lib.serving.disaggregated import KVMetadata

    fields = ("num_tokens", "block_size", "n_layers", "n_kv_heads", "head_dim", "dtype", "source_blocks")
    record = {"type": type(metadata).__name__, "is_course_class": isinstance(metadata, KVMetadata)}
    for name in fields:
        value = getattr(metadata, name, None)
        if name == "source_blocks" and isinstance(value, (list, tuple)):
            record[name] = [b if type(b) is int else repr(b) for b in value]
        else:
            record[name] = "missing" if value is None else str(value)
    return record


def raised(exc: BaseException) -> dict:
    """A recorded error: its type, whether it is a ValueError or the pool's OutOfBlocks, its message."""
    from infra_lib.serving.errors import OutOfBlocks

    return {
        "kind": "raised",
        "type": type(exc).__name__,
        "value_error": isinstance(exc, ValueError),
        "out_of_blocks": isinstance(exc, OutOfBlocks),
        "error": f"{type(exc).__name__}: {exc}"[:300],
    }
