"""The fused 4-bit GEMV kernels against the layers that dequantise first, their bounds, their traffic,
and the model with its 4-bit linears switched to them.

Without a GPU the kernels run in Triton's interpreter, so the shapes are small (n = 48 or 37,
k = 96); the same tests compile them on a GPU, except the traffic counts (interpreter only).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton ships wheels for Linux only")

from conftest import SMOLLM2, run_benchmark  # noqa: E402

from infra_lib.kernels.triton_env import interpreter_active, kernel_device, load_triton  # noqa: E402

triton, tl = load_triton()

from infra_lib.kernels import gemv_q4  # noqa: E402
from infra_lib.kernels.gemv_q4 import (  # noqa: E402
    q4_1_matmul,
    q4_1_matmul_bytes,
    q4_1_matmul_launch,
    q4_matmul,
    q4_matmul_bytes,
    q4_matmul_launch,
    tile_shape,
    use_fused_q4,
)
from infra_lib.kernels.matmul import matmul, tiled_matmul_bytes  # noqa: E402
from infra_lib.kernels.oob import check_bounds  # noqa: E402
from infra_lib.kernels.traffic import count_traffic  # noqa: E402
from infra_lib.model.quant import LINEAR_NAMES, Q4_1Linear, QuantLinear, quantize_model  # noqa: E402

DEVICE = kernel_device()
TOL = dict(atol=2e-5, rtol=1e-5)  # float32 sums in another order
HALF_TOL = dict(atol=2e-2, rtol=1e-2)
needs_interpreter = pytest.mark.skipif(
    not interpreter_active(), reason="traffic is counted in the interpreter; on a GPU use Nsight Compute"
)


def randn(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


def int4_layer(n=48, k=96, group_size=32, bias=False, seed=0) -> QuantLinear:
    return QuantLinear(randn(n, k, seed=seed), randn(n, seed=seed + 1) if bias else None, 4, group_size).to(DEVICE)


def q4_1_layer(n=48, k=96, seed=0) -> Q4_1Linear:
    """Random Q4_1 blocks: any byte is a valid pair of nibbles."""
    generator = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=generator) * 0.1
    m_min = -torch.rand(n, k // 32, generator=generator)
    qs = torch.randint(0, 256, (n, k // 32, 16), generator=generator, dtype=torch.uint8)
    return Q4_1Linear(d, m_min, qs).to(DEVICE)


def q4_1_from_weight(weight: torch.Tensor) -> Q4_1Linear:
    """``weight`` [out, in] in GGUF Q4_1 blocks: d = (max - min) / 15, m = min, weights 0-15 in the low nibbles."""
    blocks = weight.reshape(weight.shape[0], -1, 32)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d, m_min = ((high - low) / 15).half(), low.half()
    q = torch.clamp(torch.round((blocks - m_min.float()[..., None]) / d.float()[..., None]), 0, 15).to(torch.uint8)
    return Q4_1Linear(d, m_min, q[..., :16] | (q[..., 16:] << 4)).to(weight.device)


def run_checked(launch):
    """Run a launch under the bounds checker (it must stay in range) and return its output."""
    report = check_bounds(launch.kernel, launch.grid, *launch.args, **launch.meta)
    assert report.clean, str(report)
    return launch.out


# --- equality with the dequantise-then-matmul layers ---------------------------------------------------


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize(
    "n, k, group_size, bias, block_n",
    [(48, 96, 32, False, 32), (37, 96, 16, True, 16), (5, 64, 64, False, 64), (37, 96, 6, True, 32)],
)
def test_q4_matmul_matches_quant_linear(m, n, k, group_size, bias, block_n):
    layer, x = int4_layer(n, k, group_size, bias), randn(m, k, seed=2)
    torch.testing.assert_close(
        q4_matmul(x, layer.qweight, layer.scales, group_size, layer.bias, block_n=block_n), layer(x), **TOL
    )


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n, k, block_n, k_groups", [(48, 96, 32, None), (37, 96, 16, 2), (37, 64, 64, 1)])
def test_q4_1_matmul_matches_q4_1_linear(m, n, k, block_n, k_groups):
    layer, x = q4_1_layer(n, k), randn(m, k, seed=3)
    torch.testing.assert_close(
        q4_1_matmul(x, layer.d, layer.m, layer.qs, block_n=block_n, k_groups=k_groups), layer(x), **TOL
    )


def test_multiplying_the_identity_reads_back_each_layers_dequantized_weight():
    # y = I @ W.T = W.T: every weight, in the order pack_int4 / GGUF put the nibbles (64 rows: 4 row tiles)
    eye = torch.eye(96, device=DEVICE)
    int4, q4_1 = int4_layer(37, 96, 32), q4_1_layer(37, 96)
    torch.testing.assert_close(q4_matmul(eye, int4.qweight, int4.scales, 32).T, int4.dequantized(), **TOL)
    torch.testing.assert_close(q4_1_matmul(eye, q4_1.d, q4_1.m, q4_1.qs).T, q4_1.dequantized(), **TOL)


def test_q4_1_low_nibbles_are_weights_0_to_15_and_high_nibbles_16_to_31():
    d, m_min = torch.full((1, 1), 0.5), torch.full((1, 1), -1.0)
    qs = torch.zeros(1, 1, 16, dtype=torch.uint8)
    qs[0, 0, 3] = 0x5A  # low nibble 10: weight 3; high nibble 5: weight 19
    w = q4_1_matmul(torch.eye(32, device=DEVICE), d.to(DEVICE), m_min.to(DEVICE), qs.to(DEVICE))[:, 0]
    expected = torch.full((32,), -1.0)
    expected[3], expected[19] = 10 * 0.5 - 1.0, 5 * 0.5 - 1.0
    assert torch.equal(w.cpu(), expected)


def test_half_precision_x():
    int4, q4_1 = int4_layer(37, 96, 32, bias=True), q4_1_layer(37, 96)
    x = randn(3, 96, seed=4).half()
    y4 = q4_matmul(x, int4.qweight, int4.scales, 32, int4.bias.half())
    y41 = q4_1_matmul(x, q4_1.d, q4_1.m, q4_1.qs)
    assert y4.dtype == y41.dtype == torch.float16
    torch.testing.assert_close(y4.float(), int4(x.float()), **HALF_TOL)
    torch.testing.assert_close(y41.float(), q4_1(x.float()), **HALF_TOL)


# --- errors ------------------------------------------------------------------------------------------


def test_q4_matmul_errors():
    layer, x = int4_layer(48, 96, 32), randn(1, 96)
    packed, scales = layer.qweight, layer.scales
    cases = [
        (
            lambda: q4_matmul(randn(1, 90), packed[:, :45], scales, 32),
            ValueError,
            r"x has 90 columns, not a multiple of group_size 32",
        ),
        (lambda: q4_matmul(x, packed, scales, 3), ValueError, r"group_size must be a positive even integer.*got 3"),
        (
            lambda: q4_matmul(x, packed.to(torch.int8), scales, 32),
            TypeError,
            r"packed has dtype int8; it must be uint8",
        ),
        (
            lambda: q4_matmul(randn(1, 64), packed, scales, 32),
            ValueError,
            r"packed \[48, 48\] holds 96 weights per row but x has 64 columns",
        ),
        (
            lambda: q4_matmul(x, packed, scales[:, :2], 32),
            ValueError,
            r"scales has shape \[48, 2\]; expected \[48, 3\]",
        ),
        (lambda: q4_matmul(x, packed, scales, 32, randn(47)), ValueError, r"bias has 47 elements.*48 output rows"),
        (lambda: q4_matmul(x[0], packed, scales, 32), ValueError, r"x must have 2 dimension\(s\), got shape \[96\]"),
        (lambda: q4_matmul(x.long(), packed, scales, 32), TypeError, r"x has dtype int64"),
        (lambda: q4_matmul(torch.empty(1, 96, device="meta"), packed, scales, 32), ValueError, r"x is on meta"),
        (lambda: q4_matmul(x, packed, scales, 32, block_n=24), ValueError, r"block_n must be a power of two.*got 24"),
        (lambda: q4_matmul(x, packed, scales, 32, k_groups=3), ValueError, r"k_groups must be a power of two.*got 3"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def test_q4_1_matmul_errors():
    layer, x = q4_1_layer(48, 96), randn(1, 96)
    d, m_min, qs = layer.d, layer.m, layer.qs
    cases = [
        (
            lambda: q4_1_matmul(randn(1, 48), d, m_min, qs),
            ValueError,
            r"x has 48 columns, not a multiple of the Q4_1 block \(32 weights\)",
        ),
        (
            lambda: q4_1_matmul(randn(1, 64), d, m_min, qs),
            ValueError,
            r"qs has shape \[48, 3, 16\]; for x with 64 columns expected \[n, 2, 16\]",
        ),
        (lambda: q4_1_matmul(x, d[:, :2], m_min, qs), ValueError, r"d has shape \[48, 2\]; expected \[48, 3\]"),
        (lambda: q4_1_matmul(x, d, m_min[:47], qs), ValueError, r"m_min has shape \[47, 3\]; expected \[48, 3\]"),
        (lambda: q4_1_matmul(x, d, m_min, qs.reshape(48, -1)), ValueError, r"qs must have 3 dimension\(s\)"),
        (lambda: q4_1_matmul(x, d, m_min, qs.float()), TypeError, r"qs has dtype float32; it must be uint8"),
        (lambda: q4_1_matmul(x, d.int(), m_min, qs), TypeError, r"d has dtype int32"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    with pytest.raises(ValueError, match=r"d is on meta, where Triton cannot run"):
        q4_1_matmul(x, torch.empty(48, 3, device="meta"), m_min, qs)


# --- bounds ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 3])
def test_every_launch_stays_in_bounds(m):
    x = randn(m, 128, seed=5)[:, :96]  # a padded row stride: reads past a row's 96 columns would be caught
    int4 = int4_layer(37, 96, 16, bias=True)
    y = run_checked(q4_matmul_launch(x, int4.qweight, int4.scales, 16, int4.bias, block_n=16, k_groups=4))
    torch.testing.assert_close(y, int4(x), **TOL)
    q4_1 = q4_1_layer(37, 96)
    y = run_checked(q4_1_matmul_launch(x, q4_1.d, q4_1.m, q4_1.qs, block_n=32, k_groups=2))
    torch.testing.assert_close(y, q4_1(x), **TOL)
    padded = int4_layer(37, 96, 6)  # groups of 6: 3 bytes each, in a 4-lane block
    y = run_checked(q4_matmul_launch(x, padded.qweight, padded.scales, 6, block_n=32))
    torch.testing.assert_close(y, padded(x), **TOL)


# --- traffic -----------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("m", [1, 3])
def test_int4_traffic_is_half_a_byte_per_weight_plus_scales_and_x(m):
    n, k, group_size, block_n = 48, 96, 32, 32
    layer, x = int4_layer(n, k, group_size), randn(m, k, seed=6)
    with count_traffic() as fused:
        y = q4_matmul(x, layer.qweight, layer.scales, group_size, block_n=block_n)
    block_m = tile_shape(m, block_n)[0]
    expected = q4_matmul_bytes(m, n, k, group_size, block_m=block_m, block_n=block_n)
    assert (fused.bytes_loaded, fused.bytes_stored) == (expected["loaded"], expected["stored"])
    # 2304 bytes of nibbles, 48 * 3 float32 scales, x once per tile-column (2); only y is written
    assert fused.bytes_loaded == n * k // 2 + n * (k // group_size) * 4 + 2 * m * k * 4
    assert fused.bytes_stored == y.numel() * 4 and fused.stores == 2

    with count_traffic() as fp32:
        matmul(x, layer.dequantized().t(), block_m=16, block_n=block_n, block_k=32)
    x_reads = 2 * m * k * 4  # the same for both kernels: x once per tile-column
    assert fp32.bytes_loaded == tiled_matmul_bytes(m, n, k, 16, block_n)["loaded"] == n * k * 4 + x_reads
    assert (fp32.bytes_loaded - x_reads) / (fused.bytes_loaded - x_reads) == 4 / (0.5 + 4 / 32)


@needs_interpreter
def test_int4_traffic_with_a_bias_and_half_precision_x():
    layer, x = int4_layer(37, 96, 16, bias=True), randn(3, 96, seed=7).half()
    with count_traffic() as fused:
        q4_matmul(x, layer.qweight, layer.scales, 16, layer.bias, block_n=16)
    expected = q4_matmul_bytes(3, 37, 96, 16, block_m=tile_shape(3)[0], block_n=16, x_bytes=2, bias_bytes=4)
    assert (fused.bytes_loaded, fused.bytes_stored) == (expected["loaded"], expected["stored"])
    assert expected == {"loaded": 37 * 48 + 37 * 6 * 4 + 37 * 4 + 3 * 3 * 96 * 2, "stored": 3 * 37 * 2}


@needs_interpreter
@pytest.mark.parametrize("m", [1, 3])
def test_q4_1_traffic_is_twenty_bytes_per_block_plus_x(m):
    n, k, block_n = 37, 96, 16
    layer, x = q4_1_layer(n, k), randn(m, k, seed=8)
    with count_traffic() as fused:
        q4_1_matmul(x, layer.d, layer.m, layer.qs, block_n=block_n, k_groups=2)
    expected = q4_1_matmul_bytes(m, n, k, block_m=tile_shape(m)[0], block_n=block_n)
    assert (fused.bytes_loaded, fused.bytes_stored) == (expected["loaded"], expected["stored"])
    assert fused.bytes_loaded == n * (k // 32) * 20 + 3 * m * k * 4  # three tile-columns read x
    assert fused.bytes_stored == m * n * 4


# --- the forward switch ------------------------------------------------------------------------------


def tiny_q4_1_model(seed: int):
    """A small random decoder with widths that are whole Q4_1 blocks, its linears in Q4_1."""
    from infra_lib.model.config import LlamaConfig
    from infra_lib.model.model import Llama

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Llama(
            LlamaConfig(
                vocab_size=96,
                hidden_size=64,
                n_layers=2,
                n_heads=4,
                n_kv_heads=2,
                head_dim=16,
                intermediate_size=128,
                max_position=64,
                rope_theta=1000.0,
            )
        )
        for p in model.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.35)
    for layer in model.layers:
        for name in LINEAR_NAMES:
            parent, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent), child, q4_1_from_weight(layer.get_submodule(name).weight.detach()))
    return model.eval().to(DEVICE)


def count_calls(monkeypatch, name: str) -> list[int]:
    """Record the rows of x at every call of ``gemv_q4.<name>`` from the forward switch."""
    rows, kernel = [], getattr(gemv_q4, name)

    def counted(x, *args, **kwargs):
        rows.append(x.shape[0])
        return kernel(x, *args, **kwargs)

    monkeypatch.setattr(gemv_q4, name, counted)
    return rows


@torch.inference_mode()
def test_quantized_tiny_model_decodes_the_same_tokens_fused(monkeypatch):
    from grading.checks.lab06 import tiny_model
    from infra_lib.model.generation import greedy_decode

    model = quantize_model(tiny_model(0), bits=4, group_size=16).to(DEVICE)
    prompt = [5, 17, 42, 8, 63, 1, 90, 33]
    unfused = greedy_decode(model, prompt, 3)
    calls = count_calls(monkeypatch, "q4_matmul")
    switched = use_fused_q4(model, max_rows=4)
    assert len(switched) == 2 * 7 and switched[0] == "layers.0.self_attn.q_proj"
    assert greedy_decode(model, prompt, 3) == unfused
    assert calls == [1] * 2 * 14  # the 8-row prefill kept the stored path; two decode steps took the kernel

    use_fused_q4(model)  # the default threshold takes the prefill too
    calls.clear()
    assert greedy_decode(model, prompt, 3) == unfused and calls == [8] * 14 + [1] * 28

    assert use_fused_q4(model, enabled=False) == switched
    calls.clear()
    assert greedy_decode(model, prompt, 3) == unfused and calls == []
    assert all("forward" not in vars(model.get_submodule(name)) for name in switched)
    assert use_fused_q4(quantize_model(tiny_model(0), bits=8, group_size=16)) == []  # only 4-bit layers
    with pytest.raises(ValueError, match="max_rows must be a positive integer, got 0"):
        use_fused_q4(model, max_rows=0)


@torch.inference_mode()
def test_q4_1_tiny_model_decodes_the_same_tokens_fused(monkeypatch):
    from infra_lib.model.generation import greedy_decode

    model = tiny_q4_1_model(1)
    prompt = [3, 77, 12, 50, 9, 61, 24, 88]
    unfused = greedy_decode(model, prompt, 3)
    calls = count_calls(monkeypatch, "q4_1_matmul")
    assert len(use_fused_q4(model)) == 14
    assert greedy_decode(model, prompt, 3) == unfused and calls == [8] * 14 + [1] * 28


@SMOLLM2
def test_smollm2_q4_1_layers_as_stored_match_their_dequantised_forward():
    # One decode token through all 210 layers takes over half a minute in the interpreter: three real layers.
    from infra_lib.model.loaders import default_gguf_path, stored_blocks

    blocks = stored_blocks(default_gguf_path(), "Q4_1")[1]
    x = randn(1, 1536, seed=9)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.29.ffn_down.weight"):
        layer = Q4_1Linear.from_gguf_rows(blocks[name]).to(DEVICE)
        row = x[:, : layer.in_features]
        torch.testing.assert_close(q4_1_matmul(row, layer.d, layer.m, layer.qs), layer(row), atol=1e-4, rtol=1e-4)


@SMOLLM2
@torch.inference_mode()
def test_smollm2_decodes_the_same_tokens_through_the_fused_q4_1_kernel(monkeypatch):
    """The whole model, as stored in its GGUF file: a decode step with all 210 Q4_1 layers in the
    fused kernel picks the token the stored dequantise-then-matmul path picks. Wide tiles (512 output
    features, 16 blocks of k a step) keep the interpreter to a few programs per layer; the default
    tiles are checked layer by layer above."""
    import functools

    from infra_lib.model.generation import greedy_decode
    from infra_lib.model.quant import load_gguf_q4_1

    loaded = load_gguf_q4_1()
    model, tokenizer = loaded.model.to(DEVICE), loaded.tokenizer
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    stored = greedy_decode(model, prompt, 2)
    monkeypatch.setattr(gemv_q4, "q4_1_matmul", functools.partial(gemv_q4.q4_1_matmul, block_n=512, k_groups=16))
    calls = count_calls(monkeypatch, "q4_1_matmul")
    assert len(use_fused_q4(model, max_rows=1)) == 30 * 7
    fused = greedy_decode(model, prompt, 2)
    assert calls == [1] * 30 * 7, "the prefill keeps the stored path; the one decode step takes the kernel"
    assert fused == stored and tokenizer.decode(fused) == "The capital", tokenizer.decode(fused)


# --- the benchmark -----------------------------------------------------------------------------------


def test_traffic_benchmark_writes_json(tmp_path):
    result = run_benchmark("q4_gemv_traffic", tmp_path / "q4_gemv_traffic.json")
    rows = {row["kernel"]: row for row in result["results"]}
    assert result["benchmark"] == "q4_gemv_traffic" and list(rows) == ["fp32 GEMV", "int4 fused", "Q4_1 fused"]
    assert result["accelerator"]["hbm_tbps"] == 3.35 and result["flags"]["group_size"] == 64
    for row in rows.values():
        assert row["shape"] == [576, 576]
        if result["flags"]["counted"]:
            assert row["counted"] == row["formula"]
        assert row["token_floor_us"] == pytest.approx(135e6 * row["bytes_per_weight"] / 3.35e12 * 1e6)
    assert [rows[name]["weight_bytes_per_weight"] for name in rows] == [4.0, 0.5625, 0.625]
    assert rows["fp32 GEMV"]["bytes_per_weight"] / rows["int4 fused"]["bytes_per_weight"] > 6
    assert rows["int4 fused"]["token_floor_us"] < rows["Q4_1 fused"]["token_floor_us"] < 30
