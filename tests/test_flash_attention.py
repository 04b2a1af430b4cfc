"""FlashAttention forward and the naive three-kernel baseline: against torch, under the bounds
checker, through the model, and by the bytes each one moves.

Without a GPU the kernels run in Triton's interpreter, so the shapes are small; the same tests
compile them on a GPU (where tl.dot rounds float32 to tf32, hence the looser tolerance there).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton ships wheels for Linux only")

from infra_lib.kernels.triton_env import interpreter_active, kernel_device, load_triton  # noqa: E402

triton, tl = load_triton()

from conftest import run_benchmark  # noqa: E402

import infra_lib.kernels.flash_attention as flash_module  # noqa: E402
from infra_lib.kernels.flash_attention import (  # noqa: E402
    attention_reference,
    flash_attention,
    flash_attention_bytes,
    flash_cached_attention,
    naive_attention,
    naive_attention_bytes,
)
from infra_lib.kernels.oob import check_bounds  # noqa: E402
from infra_lib.kernels.traffic import count_traffic  # noqa: E402

DEVICE = kernel_device()
TOL = 1e-4 if interpreter_active() else 2e-2
needs_interpreter = pytest.mark.skipif(
    not interpreter_active(), reason="traffic is counted in the interpreter; on a GPU use Nsight Compute"
)


def qkv(batch, n_heads, n_kv_heads, t, s, head_dim, *, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_heads, t, head_dim, generator=generator)
    k, v = (torch.randn(batch, n_kv_heads, s, head_dim, generator=generator) for _ in range(2))
    return tuple(x.to(dtype=dtype, device=DEVICE) for x in (q, k, v))


def assert_matches_reference(q, k, v, *, causal, tol=TOL, **blocks):
    out, lse = flash_attention(q, k, v, causal=causal, **blocks)
    want_out, want_lse = attention_reference(q, k, v, causal=causal)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32
    assert lse.shape == q.shape[:3]
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)


# --- results ----------------------------------------------------------------------------------------

# (t, s, head_dim, n_heads // n_kv_heads): decode-like t < s and prefill t == s, none a multiple of 16
ODD_SHAPES = [
    (1, 1, 16, 1),
    (1, 5, 24, 2),
    (5, 5, 16, 4),
    (1, 17, 24, 1),
    (5, 17, 16, 2),
    (17, 17, 24, 4),
    (1, 33, 16, 4),
    (17, 33, 24, 1),
    (33, 33, 16, 2),
    (5, 33, 24, 4),
]


@pytest.mark.parametrize("t, s, head_dim, group", ODD_SHAPES)
def test_flash_matches_the_reference_on_odd_shapes(t, s, head_dim, group):
    q, k, v = qkv(1, 4, 4 // group, t, s, head_dim, seed=t * 100 + s)
    for causal in (True, False):
        assert_matches_reference(q, k, v, causal=causal)


def test_flash_with_other_blocks_and_scale_and_the_naive_baseline_agree():
    q, k, v = qkv(2, 2, 1, 19, 40, 20, seed=1)
    assert_matches_reference(q, k, v, causal=True, block_m=32, block_n=16)
    out, _ = flash_attention(q, k, v, causal=False, scale=0.3, block_m=16, block_n=32)
    torch.testing.assert_close(out, attention_reference(q, k, v, causal=False, scale=0.3)[0], atol=TOL, rtol=TOL)
    for causal in (True, False):
        want = attention_reference(q, k, v, causal=causal)[0]
        torch.testing.assert_close(naive_attention(q, k, v, causal=causal), want, atol=TOL, rtol=TOL)


def test_decode_sees_every_key_and_prefill_row_zero_sees_only_key_zero():
    q, k, v = qkv(1, 2, 2, 1, 9, 16, seed=2)
    causal, _ = flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(causal, flash_attention(q, k, v, causal=False)[0], atol=TOL, rtol=TOL)
    q, k, v = qkv(1, 2, 2, 9, 9, 16, seed=3)
    out, lse = flash_attention(q, k, v)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0], atol=TOL, rtol=TOL)  # softmax over one key is 1
    torch.testing.assert_close(lse[:, :, 0], (q[:, :, 0] * k[:, :, 0]).sum(-1) / 4, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_logits_stay_finite(sign):
    q, k, v = qkv(1, 2, 1, 20, 37, 16, seed=4)
    q = q * (sign * 1e4)  # scores of order 1e4: exp overflows float32 without the running max
    out, lse = flash_attention(q, k, v)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    want_out, want_lse = attention_reference(q, k, v)
    torch.testing.assert_close(out, want_out, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-5)


def test_half_precision_and_bfloat16():
    q, k, v = qkv(1, 4, 2, 17, 21, 24, seed=5, dtype=torch.float16)
    assert_matches_reference(q, k, v, causal=True, tol=1e-2)
    q, k, v = qkv(1, 4, 2, 17, 21, 24, seed=5, dtype=torch.bfloat16)
    if interpreter_active():  # NumPy has no bfloat16: the interpreter cannot run it
        with pytest.raises(TypeError, match="q is bfloat16, which Triton's interpreter cannot compute with"):
            flash_attention(q, k, v)
    else:
        assert_matches_reference(q, k, v, causal=True, tol=3e-2)


def test_non_contiguous_inputs_are_read_through_their_strides():
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(2, 7, 4, 24, generator=generator).to(DEVICE).transpose(1, 2)  # laid out as the model's q
    k = torch.randn(2, 2, 24, 30, generator=generator).to(DEVICE).transpose(2, 3)  # head_dim strided by s
    v = torch.randn(2, 2, 64, 24, generator=generator).to(DEVICE)[:, :, :30]  # a cache slice: capacity 64
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous()) and k.stride(-1) != 1
    for causal in (True, False):
        assert_matches_reference(q, k, v, causal=causal)
        torch.testing.assert_close(
            naive_attention(q, k, v, causal=causal), attention_reference(q, k, v, causal=causal)[0], atol=TOL, rtol=TOL
        )


def test_bad_inputs_give_clear_errors():
    q, k, v = qkv(1, 4, 2, 3, 5, 16)
    with pytest.raises(ValueError, match=r"q must have 4 dimension\(s\), got shape \[4, 3, 16\]"):
        flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)"):
        flash_attention(q, *qkv(1, 3, 3, 3, 5, 16)[1:])
    with pytest.raises(ValueError, match=r"t = 3 queries but k only s = 2 keys.*t <= s"):
        flash_attention(q, k[:, :, :2], v[:, :, :2])
    with pytest.raises(ValueError, match=r"k has no keys \(shape \[1, 2, 0, 16\]\)"):
        flash_attention(q, k[:, :, :0], v[:, :, :0])
    with pytest.raises(ValueError, match=r"k has no keys"):
        attention_reference(q, k[:, :, :0], v[:, :, :0])
    with pytest.raises(TypeError, match=r"q is torch.float32, k is torch.float16.*k.to\(q.dtype\)"):
        flash_attention(q, k.half(), v)
    with pytest.raises(ValueError, match=r"k has shape \[1, 2, 5, 16\] but v has \[1, 2, 4, 16\]"):
        flash_attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match=r"batch and head_dim \(dims 0 and 3\) must match"):
        naive_attention(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match=r"k is on meta, where Triton cannot run"):
        flash_attention(q, k.to("meta"), v)
    with pytest.raises(TypeError, match=r"v has dtype int64"):
        flash_attention(q, k, v.long())
    with pytest.raises(ValueError, match=r"scale must be a positive number"):
        flash_attention(q, k, v, scale=0.0)
    with pytest.raises(ValueError, match=r"block_m must be a power of two .* got 24"):
        flash_attention(q, k, v, block_m=24)


def test_every_launch_stays_in_bounds(monkeypatch):
    reports = []

    def guarded(kernel, grid, *args, **meta):
        reports.append((kernel.fn.__name__, check_bounds(kernel, grid, *args, **meta)))  # raises when not clean

    monkeypatch.setattr(flash_module, "_launch", guarded)
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(1, 5, 4, 20, generator=generator).to(DEVICE).transpose(1, 2)
    k, v = (torch.randn(1, 2, 40, 20, generator=generator).to(DEVICE)[:, :, :23] for _ in range(2))
    for causal in (True, False):
        assert_matches_reference(q, k, v, causal=causal)  # results still land in the caller's tensors
        torch.testing.assert_close(
            naive_attention(q, k, v, causal=causal), attention_reference(q, k, v, causal=causal)[0], atol=TOL, rtol=TOL
        )
    assert_matches_reference(*qkv(1, 2, 1, 1, 17, 24, seed=8), causal=True)
    names = [name for name, _ in reports]
    assert names.count("flash_attention_kernel") == 3 and names.count("softmax_kernel") == 2
    assert {"attention_scores_kernel", "attention_pv_kernel"} < set(names)
    assert all(report.clean for _, report in reports)


def test_the_model_decodes_the_same_tokens_with_flash_attention():
    from grading.checks.lab06 import tiny_model
    from infra_lib.model import DenseKVCache
    from infra_lib.model.generation import greedy_decode

    model = tiny_model(3).to(DEVICE)
    prompt = [5, 17, 42, 8, 91, 3, 60, 27, 14, 77]
    tokens = torch.tensor([prompt], device=DEVICE)
    with torch.inference_mode():
        logits = {}
        for name, fn in (("default", model.attention_fn), ("flash", flash_cached_attention)):
            with model.using_attention(fn):
                logits[name] = model(tokens, DenseKVCache.for_model(model.config, capacity=16, device=DEVICE))
        torch.testing.assert_close(logits["flash"], logits["default"], atol=10 * TOL, rtol=10 * TOL)
        expected = greedy_decode(model, prompt, 4)
        with model.using_attention(flash_cached_attention):
            assert greedy_decode(model, prompt, 4) == expected


# --- traffic ----------------------------------------------------------------------------------------


def counted(fn, *args, **kwargs):
    with count_traffic() as traffic:
        fn(*args, **kwargs)
    return traffic


@needs_interpreter
def test_flash_reads_q_once_and_k_v_once_per_query_block():
    q, k, v = qkv(1, 2, 1, 33, 33, 24)
    full = counted(flash_attention, q, k, v, causal=False)
    row = 24 * 4  # bytes of one head_dim row in float32
    # per query head: Q once (33 rows), K and V once per query block (3 blocks x 33 rows each)
    assert full.bytes_loaded == 2 * (33 + 2 * 3 * 33) * row
    assert full.bytes_stored == 2 * 33 * (row + 4)  # O and lse, once
    causal = counted(flash_attention, q, k, v, causal=True)
    # causal: block b stops at its last query's key, 16, 32 and 33 keys
    assert causal.bytes_loaded == 2 * (33 + 2 * (16 + 32 + 33)) * row
    assert causal.bytes_stored == full.bytes_stored


@needs_interpreter
@pytest.mark.parametrize(
    "batch, t, s, head_dim, group, dtype",
    [(2, 5, 17, 24, 2, torch.float32), (1, 17, 33, 16, 4, torch.float16), (1, 1, 40, 20, 1, torch.float32)],
)
def test_counted_bytes_equal_the_formulas(batch, t, s, head_dim, group, dtype):
    q, k, v = qkv(batch, 4, 4 // group, t, s, head_dim, dtype=dtype)
    size = q.element_size()
    for causal in (True, False):
        traffic = counted(flash_attention, q, k, v, causal=causal)
        want = flash_attention_bytes(batch, 4, t, s, head_dim, causal=causal, element_size=size)
        assert (traffic.bytes_loaded, traffic.bytes_stored) == (want["loaded"], want["stored"]), causal
    naive = counted(naive_attention, q, k, v)
    want = naive_attention_bytes(batch, 4, t, s, head_dim, element_size=size)
    assert (naive.bytes_loaded, naive.bytes_stored) == (want["loaded"], want["stored"])


@needs_interpreter
def test_the_causal_skip_reads_fewer_key_blocks():
    q, k, v = qkv(1, 1, 1, 64, 64, 16)
    causal, full = counted(flash_attention, q, k, v, causal=True), counted(flash_attention, q, k, v, causal=False)
    q_bytes = 64 * 16 * 4
    # 4 query blocks: without the mask each reads all 4 key blocks, with it 1, 2, 3 and 4 of them
    assert full.bytes_loaded - q_bytes == 2 * 16 * 16 * 16 * 4  # K and V: 16 blocks of 16 keys x 16 dims
    assert causal.bytes_loaded - q_bytes == 2 * 10 * 16 * 16 * 4
    assert causal.flops / full.flops == 10 / 16  # the skipped blocks' tl.dot never runs either
    naive_causal, naive_full = counted(naive_attention, q, k, v), counted(naive_attention, q, k, v, causal=False)
    assert naive_causal.bytes_moved == naive_full.bytes_moved  # the naive kernels compute and store every score


@needs_interpreter
def test_naive_traffic_grows_quadratically_and_flash_with_one_query_block_linearly():
    moved = {}
    for s in (64, 128):
        q, k, v = qkv(1, 1, 1, s, s, 16, seed=s)
        moved[s] = {
            "naive": counted(naive_attention, q, k, v, causal=False),
            "flash": counted(flash_attention, q, k, v, causal=False),
            "one block": counted(flash_attention, q, k, v, causal=False, block_m=128),
        }
        assert moved[s]["naive"].bytes_moved == sum(
            naive_attention_bytes(1, 1, s, s, 16)[key] for key in ("loaded", "stored")
        )
        assert moved[s]["flash"].bytes_moved < moved[s]["naive"].bytes_moved / 2
    growth = {name: moved[128][name].bytes_moved / moved[64][name].bytes_moved for name in moved[64]}
    assert 3.8 < growth["naive"] <= 4  # the t x s score matrix, written twice and read twice
    assert growth["one block"] == 2  # Q, K, V, O each cross memory once: linear in s
    # with block_m = 16 the K/V re-reads (s keys per query block) grow as s^2 too, but at 8 bytes
    # per score here against naive's 28
    assert 3 < growth["flash"] < 4


def test_flash_traffic_benchmark_writes_json(tmp_path):
    result = run_benchmark("flash_traffic", tmp_path / "flash_traffic.json")
    assert result["benchmark"] == "flash_traffic" and result["flags"]["lengths"] == [32, 64]
    for row in result["results"]:
        s, naive, flash = row["s"], row["naive"], row["flash"]
        assert naive["scores"] == s * s * 4 and naive["total"] == naive["loaded"] + naive["stored"]
        assert flash["total"] == flash["loaded"] + flash["stored"] < naive["total"]
        assert row["naive_over_flash"] == pytest.approx(naive["total"] / flash["total"])
        assert row["matches_formula"] is True and row["max_abs_difference"] < TOL
