"""Paged decode attention in Triton against the torch ``paged_attention``, its bounds, and its traffic.

Without a GPU the kernels run in Triton's interpreter, so the shapes are small; the same tests
compile them on a GPU (the traffic counts and the model-level runs, which feed the model CPU
tensors, need the interpreter and say so).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton", reason="Triton ships wheels for Linux only")

from conftest import run_benchmark  # noqa: E402

from grading.checks.lab06 import tiny_model  # noqa: E402
from infra_lib.kernels.oob import check_bounds  # noqa: E402
from infra_lib.kernels.paged_decode import (  # noqa: E402
    INDEX_BYTES,
    decode_launches,
    gather_then_attend,
    paged_decode_attention,
    paged_decode_bytes,
    paged_decode_cached_attention,
)
from infra_lib.kernels.traffic import count_traffic  # noqa: E402
from infra_lib.kernels.triton_env import interpreter_active, kernel_device  # noqa: E402
from infra_lib.model import SamplingParams  # noqa: E402
from infra_lib.serving import (  # noqa: E402
    BlockPool,
    LLMEngine,
    PagedKVStore,
    SchedulerConfig,
    model_runner,  # noqa: E402
    paged_greedy_decode,
)
from infra_lib.serving.paged_attention import paged_attention  # noqa: E402

DEVICE = kernel_device()
RAGGED = [1, 5, 16, 17, 0]
needs_interpreter = pytest.mark.skipif(
    not interpreter_active(),
    reason="counted in the interpreter (on a GPU, Nsight Compute) and the model helpers feed CPU tensors",
)


def paged_inputs(seq_lens, block_size, n_kv_heads, group, head_dim, *, seed=0, dtype=torch.float32, spare=3):
    """q, caches and block tables whose blocks are shuffled over the cache (non-contiguous, out of order)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare
    k_cache, v_cache = (
        torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen).to(DEVICE, dtype) for _ in range(2)
    )
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(seq_lens))]
    q = torch.randn(len(seq_lens), n_kv_heads * group, 1, head_dim, generator=gen).to(DEVICE, dtype)
    return q, k_cache, v_cache, tables


def reference(q, k_cache, v_cache, tables, seq_lens):
    """``paged_attention`` on the sequences that have a context; zeros for the empty ones."""
    keep = [i for i, s in enumerate(seq_lens) if s]
    out = torch.zeros_like(q)
    out[keep] = paged_attention(q[keep], k_cache, v_cache, [tables[i] for i in keep], [seq_lens[i] for i in keep])
    return out


# --- equality with the torch paged attention ---------------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_equals_paged_attention_on_a_ragged_batch(block_size, group, head_dim):
    q, k_cache, v_cache, tables = paged_inputs(RAGGED, block_size, 2, group, head_dim, seed=block_size + group)
    out = paged_decode_attention(q, k_cache, v_cache, tables, RAGGED)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, RAGGED), atol=1e-5, rtol=1e-5)
    assert out[4].eq(0).all()  # seq_len 0: nothing to attend to, a row of zeros


def test_a_padded_table_tensor_and_a_tensor_of_lengths_give_the_same_result():
    q, k_cache, v_cache, tables = paged_inputs(RAGGED, 4, 2, 3, 24, seed=1)
    width = max(len(t) for t in tables) + 2
    padded = torch.tensor([t + [10**6] * (width - len(t)) for t in tables])  # ids past the length are never read
    out = paged_decode_attention(q, k_cache, v_cache, padded, torch.tensor(RAGGED))
    torch.testing.assert_close(out, paged_decode_attention(q, k_cache, v_cache, tables, RAGGED), atol=0, rtol=0)


@pytest.mark.parametrize("split_k", [2, 7])
def test_split_k_equals_the_unsplit_result(split_k):
    seq_lens = [1, 5, 16, 17, 0, 40]
    q, k_cache, v_cache, tables = paged_inputs(seq_lens, 4, 2, 3, 24, seed=2)
    whole = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens)
    split = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, split_k=split_k)
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-5)  # 7 slices: short contexts leave some empty
    assert split[4].eq(0).all()


def test_half_precision_and_an_explicit_scale():
    q, k_cache, v_cache, tables = paged_inputs(RAGGED, 16, 2, 2, 24, seed=3, dtype=torch.float16)
    out = paged_decode_attention(q, k_cache, v_cache, tables, RAGGED)
    assert out.dtype == torch.float16
    wide = reference(q.float(), k_cache.float(), v_cache.float(), tables, RAGGED)
    torch.testing.assert_close(out.float(), wide, atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, RAGGED), atol=4e-3, rtol=1e-2)
    sharper = paged_decode_attention(q, k_cache, v_cache, tables, RAGGED, scale=0.5, split_k=2)
    expected = reference(q.float() * (0.5 * 24**0.5), k_cache.float(), v_cache.float(), tables, RAGGED)
    torch.testing.assert_close(sharper.float(), expected, atol=2e-3, rtol=1e-2)


def test_a_single_token_context_returns_its_value_and_an_empty_one_zeros():
    q, k_cache, v_cache, tables = paged_inputs([1, 0], 4, 2, 3, 16, seed=4)
    out = paged_decode_attention(q, k_cache, v_cache, tables, [1, 0])
    block = tables[0][0]
    expected = v_cache[block, 0].repeat_interleave(3, dim=0)  # one key: weight 1 on its value, per query head
    torch.testing.assert_close(out[0, :, 0], expected, atol=1e-6, rtol=1e-6)
    assert out[1].eq(0).all()
    empty = paged_decode_attention(q, k_cache, v_cache, [[], []], [0, 0], split_k=2)
    assert empty.eq(0).all()


# --- errors -------------------------------------------------------------------------------------------


def test_bad_inputs_say_what_is_wrong():
    q, k_cache, v_cache, tables = paged_inputs([5, 9], 4, 2, 3, 16, seed=5)
    with pytest.raises(ValueError, match=r"sequence 1 has 9 tokens, 3 blocks of 4 slots, but its block table holds 2"):
        paged_decode_attention(q, k_cache, v_cache, [tables[0], tables[1][:2]], [5, 9])
    with pytest.raises(ValueError, match=r"block_tables must be \[batch=2, max_blocks\], got \[6\]"):
        paged_decode_attention(q, k_cache, v_cache, torch.arange(6), [5, 9])
    with pytest.raises(ValueError, match=r"sequence 0's block table names block 99, outside the cache's 8 blocks"):
        paged_decode_attention(q, k_cache, v_cache, [[99, 0], tables[1]], [5, 9])
    with pytest.raises(ValueError, match=r"q must have 4 dimension\(s\), got shape \[2, 6, 16\]"):
        paged_decode_attention(q[:, :, 0], k_cache, v_cache, tables, [5, 9])
    with pytest.raises(ValueError, match=r"k_cache must have 4 dimension\(s\)"):
        paged_decode_attention(q, k_cache[0], v_cache, tables, [5, 9])
    with pytest.raises(ValueError, match=r"q holds t=3 queries per sequence.*use paged_attention for a prefill"):
        paged_decode_attention(q.expand(2, 6, 3, 16).contiguous(), k_cache, v_cache, tables, [5, 9])
    with pytest.raises(ValueError, match=r"5 query heads do not split into groups over 2 KV heads"):
        paged_decode_attention(q[:, :5], k_cache, v_cache, tables, [5, 9])
    with pytest.raises(ValueError, match=r"k_cache is \[8, 4, 2, 16\] but v_cache is \[8, 4, 1, 16\]"):
        paged_decode_attention(q, k_cache, v_cache[:, :, :1], tables, [5, 9])
    with pytest.raises(ValueError, match=r"q has head_dim 8 but the cache 16"):
        paged_decode_attention(q[..., :8], k_cache, v_cache, tables, [5, 9])
    with pytest.raises(TypeError, match=r"q is torch.float16, k_cache torch.float32"):
        paged_decode_attention(q.half(), k_cache, v_cache, tables, [5, 9])
    with pytest.raises(ValueError, match=r"seq_lens gives 1 lengths for a batch of 2"):
        paged_decode_attention(q, k_cache, v_cache, tables, [5])
    with pytest.raises(ValueError, match=r"seq_lens must be whole numbers >= 0.*got \[5, -1\]"):
        paged_decode_attention(q, k_cache, v_cache, tables, [5, -1])
    with pytest.raises(TypeError, match=r"block_tables holds block ids, so an integer dtype"):
        paged_decode_attention(q, k_cache, v_cache, torch.zeros(2, 3), [5, 9])
    with pytest.raises(ValueError, match=r"split_k must be a whole number of partitions >= 1"):
        paged_decode_attention(q, k_cache, v_cache, tables, [5, 9], split_k=0)
    with pytest.raises(ValueError, match=r"scale must be a positive number"):
        paged_decode_attention(q, k_cache, v_cache, tables, [5, 9], scale=float("nan"))
    with pytest.raises(TypeError, match=r"needs a PagedLayerCache, got DynamicCache"):
        paged_decode_cached_attention(q, q, q, type("DynamicCache", (), {})())


# --- bounds -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split_k", [None, 3])
@pytest.mark.parametrize("block_size, group, head_dim", [(4, 3, 24), (16, 2, 16), (6, 1, 20)])
def test_every_launch_stays_in_bounds(split_k, block_size, group, head_dim):
    q, k_cache, v_cache, tables = paged_inputs(RAGGED, block_size, 2, group, head_dim, seed=6, spare=0)
    out, launches = decode_launches(q, k_cache, v_cache, tables, RAGGED, split_k=split_k)
    for kernel, grid, args, meta in launches:  # the merge reads the partials the first launch handed back
        report = check_bounds(kernel, grid, *args, **meta)
        assert report.clean, report
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, RAGGED), atol=1e-5, rtol=1e-5)


# --- traffic ------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("split_k", [None, 2])
def test_the_kernel_reads_each_row_once_per_kv_head(split_k):
    seq_lens, block_size, n_kv_heads, group, head_dim = [1, 5, 16, 17, 0, 33], 4, 2, 3, 24
    q, k_cache, v_cache, tables = paged_inputs(seq_lens, block_size, n_kv_heads, group, head_dim, seed=7)
    with count_traffic() as traffic:
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, split_k=split_k)
    kv_rows = sum(seq_lens) * n_kv_heads * head_dim * 2 * 4
    block_ids = sum(-(-s // block_size) for s in seq_lens) * n_kv_heads * INDEX_BYTES
    parts = split_k or 1
    per_slice = q.numel() * 4 + len(seq_lens) * n_kv_heads * INDEX_BYTES  # queries, lengths
    partials = 0 if parts == 1 else q.numel() // head_dim * parts * (2 + head_dim) * 4
    assert traffic.bytes_loaded == kv_rows + block_ids + parts * per_slice + partials
    assert traffic.bytes_stored == q.numel() * 4 + partials
    formula = paged_decode_bytes(seq_lens, n_kv_heads * group, n_kv_heads, head_dim, block_size, split_k=split_k)
    assert formula == {"loaded": traffic.bytes_loaded, "stored": traffic.bytes_stored}


@needs_interpreter
def test_grouping_the_query_heads_divides_the_kv_reads_by_the_group():
    seq_lens, group = [9, 20], 3
    q, k_cache, v_cache, tables = paged_inputs(seq_lens, 4, 2, group, 16, seed=8)
    with count_traffic() as grouped:
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens)
    with count_traffic() as per_head:  # every query head its own copy of its KV head: one program per query head
        paged_decode_attention(
            q, k_cache.repeat_interleave(group, 2), v_cache.repeat_interleave(group, 2), tables, seq_lens
        )
    kv_rows = sum(seq_lens) * 2 * 16 * 2 * 4
    extra_ids = sum(-(-s // 4) for s in seq_lens) * 2 * (group - 1) * INDEX_BYTES
    extra_lengths = len(seq_lens) * 2 * (group - 1) * INDEX_BYTES
    assert per_head.bytes_loaded - grouped.bytes_loaded == (group - 1) * kv_rows + extra_ids + extra_lengths


@needs_interpreter
def test_gather_then_attend_moves_the_rows_three_times():
    """The gather is torch indexing, so its bytes are computed: each row and block id read once, each row
    written to the copy; the attention over the copy is the same kernel, counted."""
    seq_lens, block_size, n_kv_heads, group, head_dim = [1, 5, 16, 17, 0, 33], 4, 2, 3, 24
    q, k_cache, v_cache, tables = paged_inputs(seq_lens, block_size, n_kv_heads, group, head_dim, seed=9)
    with count_traffic() as in_place:
        out = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens)
    with count_traffic() as attend_copy:
        baseline = gather_then_attend(q, k_cache, v_cache, tables, seq_lens)
    torch.testing.assert_close(baseline, out, atol=0, rtol=0)
    assert (attend_copy.bytes_loaded, attend_copy.bytes_stored) == (in_place.bytes_loaded, in_place.bytes_stored)
    kv_rows = sum(seq_lens) * n_kv_heads * head_dim * 2 * 4
    gather = {"loaded": kv_rows + sum(-(-s // block_size) for s in seq_lens) * INDEX_BYTES, "stored": kv_rows}
    gathered = paged_decode_bytes(seq_lens, n_kv_heads * group, n_kv_heads, head_dim, block_size, gathered=True)
    assert gathered == {
        "loaded": attend_copy.bytes_loaded + gather["loaded"],
        "stored": attend_copy.bytes_stored + gather["stored"],
    }
    assert sum(gathered.values()) > 2.5 * in_place.bytes_moved  # three times the rows, plus the small parts


# --- in the model and the engine ------------------------------------------------------------------------


@needs_interpreter
def test_the_model_decodes_the_same_tokens_through_the_kernel():
    model = tiny_model(0)  # 6 query heads over 2 KV heads, head_dim 8
    prompt = [random.Random(10).randrange(96) for _ in range(10)]

    def decode():
        pool, store = BlockPool(16, 4), PagedKVStore.for_model(model.config, 16, 4)
        pool.allocate(3)  # the sequence's blocks do not start at block 0
        return paged_greedy_decode(model, store, pool, prompt, 4).token_ids

    expected = decode()
    with model.using_attention(paged_decode_cached_attention), count_traffic() as traffic:
        assert decode() == expected
    assert traffic.loads > 0  # the three decode steps ran the kernel (the prefill is torch's)


@needs_interpreter
def test_the_engine_decode_batch_can_run_the_kernel(monkeypatch):
    """``ModelRunner`` sends all of a step's decodes to ``paged_attention`` in one call, with the kernel's
    signature: routing the t = 1 calls to the kernel changes no token."""
    model = tiny_model(0)
    rng = random.Random(11)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (3, 9, 14)]

    def generate():
        engine = LLMEngine.from_model(model, config=SchedulerConfig(block_size=4, num_blocks=32))
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=4)) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [engine.output(i).token_ids for i in ids]

    def decodes_through_the_kernel(q, k_cache, v_cache, tables, seq_lens):
        if q.shape[2] == 1:
            return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens)
        return paged_attention(q, k_cache, v_cache, tables, seq_lens)

    expected = generate()
    monkeypatch.setattr(model_runner, "paged_attention", decodes_through_the_kernel)
    with count_traffic() as traffic:
        assert generate() == expected
    assert traffic.loads > 0


def test_a_prefill_through_the_kernels_step_needs_neither_the_model_nor_the_serving_layer(tmp_path):
    """A prefill (t > 1) falls back to the torch ``paged_attention``, which lives in the kernels layer:
    a fresh process runs it with a cache of its own and never imports ``infra_lib.model`` or
    ``infra_lib.serving``; the result equals ``paged_attention`` where the serving layer names it."""
    import subprocess
    import sys

    from infra_lib.kernels import paged_gather

    assert paged_attention is paged_gather.paged_attention  # the lessons' import path still finds it
    script = f"""
import sys, torch
from infra_lib.kernels.paged_decode import paged_decode_cached_attention

class Cache:  # a PagedLayerCache's surface: write, then the caches, the table and the length
    def __init__(self):
        self.k_cache, self.v_cache = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
        self.block_table, self.length = [4, 1, 3], 0

    def write(self, k_new, v_new):
        for i in range(k_new.shape[2]):
            block, row = self.block_table[(self.length + i) // 4], (self.length + i) % 4
            self.k_cache[block, row], self.v_cache[block, row] = k_new[0, :, i], v_new[0, :, i]
        self.length += k_new.shape[2]

gen = torch.Generator().manual_seed(3)
q, k, v = (torch.randn(1, n, 9, 8, generator=gen) for n in (6, 2, 2))
cache = Cache()
out = paged_decode_cached_attention(q, k, v, cache)
loaded = sorted(m for m in sys.modules if m.split(".")[:2] in (["infra_lib", "model"], ["infra_lib", "serving"]))
assert not loaded, f"the kernels' prefill imported {{loaded}}"
torch.save({{"q": q, "k": cache.k_cache, "v": cache.v_cache, "out": out}}, {str(tmp_path / "prefill.pt")!r})
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    saved = torch.load(tmp_path / "prefill.pt")
    expected = paged_attention(saved["q"], saved["k"], saved["v"], [[4, 1, 3]], [9])
    torch.testing.assert_close(saved["out"], expected, rtol=0, atol=0)


# --- the benchmark --------------------------------------------------------------------------------------


@needs_interpreter
def test_traffic_benchmark_writes_json(tmp_path):
    result = run_benchmark("paged_decode_traffic", tmp_path / "paged_decode.json")
    assert result["flags"]["block_size"] == 16 and len(result["results"]) == 2
    for row in result["results"]:
        assert row["in_place"]["counted"] == row["in_place"]["formula"]
        assert row["gathered"]["counted_attend"] + row["gathered"]["gather"] == row["gathered"]["formula"]
        assert 2.5 < row["ratio"] < 3.0
