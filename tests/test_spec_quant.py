"""Speculative decoding (exactness, the acceptance rule's distribution, cache rollback) and
weight-only quantisation (error bounds, packing, GGUF Q4_1 blocks as stored)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import SMOLLM2

from infra_lib.model import DenseKVCache, Llama, LlamaConfig, SamplingParams, greedy_decode
from infra_lib.model.quant import (
    Q4_1Linear,
    QuantLinear,
    dequantize_int8_groupwise,
    dequantize_symmetric,
    error_bound,
    heldout_text,
    load_gguf_q4_1,
    pack_int4,
    perplexity,
    quantize_int8_groupwise,
    quantize_model,
    quantize_symmetric,
    unpack_int4,
    weight_bytes,
)
from infra_lib.serving.speculative import (
    LayerSkipDraft,
    NgramDraft,
    accept_or_resample,
    expected_tokens_per_step,
    plain_decode,
    predicted_speedup,
    speculative_decode,
)

TINY = LlamaConfig(
    vocab_size=12,
    hidden_size=32,
    intermediate_size=64,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    max_position=128,
)


def tiny_model(seed: int, config: LlamaConfig = TINY, scale: float = 3.0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)  # sharper distributions than the default init, so drafts and targets disagree
    return model


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of ``counts`` against ``probs`` (cells with p > 0)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was drawn"
    observed, expected = counts[keep].double(), probs[keep].double() * counts.sum()
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))  # the chi-square survival function


# --- the acceptance rule -------------------------------------------------------------------------


def test_chi_square_helper_rejects_a_wrong_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    assert chi_square_p_value(torch.tensor([500.0, 300.0, 200.0]), probs) > 0.99
    assert chi_square_p_value(torch.tensor([400.0, 300.0, 300.0]), probs) < 1e-6


def test_first_token_of_a_step_is_distributed_as_the_target():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.05, 0.4, 0.3, 0.15, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])
    q = torch.tensor([[0.3, 0.1, 0.1, 0.1, 0.2, 0.2]])
    counts = torch.zeros(6)
    for _ in range(20000):
        draft = int(torch.multinomial(q[0], 1, generator=gen))
        accepted, nxt = accept_or_resample(p, q, [draft], gen)
        counts[accepted[0] if accepted else nxt] += 1
    assert chi_square_p_value(counts, p[0]) > 1e-3


def test_deterministic_drafts_and_greedy_reduce_to_matching_the_argmax():
    p = torch.nn.functional.one_hot(torch.tensor([3, 1, 4]), 6).float()
    q = torch.nn.functional.one_hot(torch.tensor([3, 2]), 6).float()
    assert accept_or_resample(p, q, [3, 2]) == ([3], 1)  # 2 rejected: the target's argmax instead
    q = torch.nn.functional.one_hot(torch.tensor([3, 1]), 6).float()
    assert accept_or_resample(p, q, [3, 1]) == ([3, 1], 4)  # all accepted: the bonus token
    with pytest.raises(ValueError, match=r"p \[γ\+1, vocab\]"):
        accept_or_resample(p[:2], q, [3, 1])


def test_expected_tokens_and_predicted_speedup():
    assert expected_tokens_per_step(0.0, 4) == 1.0 and expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert predicted_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / 0.2 / 1.2)
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.5, 2)


def test_expected_tokens_refuses_a_negative_gamma_and_returns_a_python_float():
    with pytest.raises(ValueError, match="gamma must be an int >= 0, got -1"):
        expected_tokens_per_step(0.5, -1)
    with pytest.raises(ValueError, match="got -2"):
        expected_tokens_per_step(1.0, -2)  # a = 1 has no division to fail on: the rule itself must refuse
    with pytest.raises(ValueError, match="gamma must be"):
        predicted_speedup(0.8, -1, 0.1)
    for a, gamma, want in ((0, 3, 1.0), (1, 4, 5.0), (0.0, 0, 1.0), (0.5, 0, 1.0), (0.5, 2, 1.75)):
        got = expected_tokens_per_step(a, gamma)
        assert type(got) is float and got == pytest.approx(want), (a, gamma, got)
    assert type(expected_tokens_per_step(torch.tensor(0.5).item(), 2)) is float
    import numpy as np

    assert type(expected_tokens_per_step(np.float64(0.8), 4)) is float  # not numpy's float64


# --- the whole loop on tiny random models --------------------------------------------------------


def test_sampled_speculative_output_matches_the_target_distribution():
    """The first two tokens after a fixed prompt, over many seeds, with γ = 3 and a draft that is the
    target with noise on its head: their joint distribution must be the target's."""
    target = tiny_model(1, scale=0.3)  # a target with some entropy (the largest first-token p is 0.55)
    draft_model = tiny_model(1, scale=0.3)
    with torch.no_grad():
        draft_model.lm_head.weight.add_(
            torch.randn(draft_model.lm_head.weight.shape, generator=torch.Generator().manual_seed(9)) * 0.5
        )
    prompt = [1, 5, 7]
    with torch.no_grad():  # the exact target distribution of the first two tokens
        first = torch.softmax(target(torch.tensor([prompt]))[0, -1], -1)
        joint = torch.stack(
            [first[a] * torch.softmax(target(torch.tensor([prompt + [a]]))[0, -1], -1) for a in range(TINY.vocab_size)]
        ).flatten()

    class RandomModelDraft(LayerSkipDraft):
        def __init__(self):
            self.model, self.num_layers = draft_model, TINY.n_layers
            self.cache, self.cached = DenseKVCache.for_model(TINY, capacity=16), []

    counts = torch.zeros(TINY.vocab_size**2)
    accepted = proposed = 0
    for seed in range(2000):
        result = speculative_decode(
            target, prompt, RandomModelDraft(), 3, SamplingParams(temperature=1.0, max_new_tokens=2, seed=seed)
        )
        a, b = result.token_ids[:2]
        counts[a * TINY.vocab_size + b] += 1
        accepted, proposed = accepted + result.accepted, proposed + result.proposed
    assert 0.2 < accepted / proposed < 0.9, f"acceptance {accepted / proposed:.2f}: the test needs a middling draft"
    assert chi_square_p_value(counts, joint) > 1e-3


def test_rollback_leaves_caches_as_if_rejected_tokens_were_never_seen():
    target = tiny_model(3)
    draft = LayerSkipDraft(target, 1)
    prompt = [2, 9, 4, 4, 1]
    checked = []

    def check(cache, tokens):
        fresh = DenseKVCache.for_model(TINY, capacity=cache.layers[0].capacity)
        with torch.no_grad():
            target(torch.tensor([tokens[:-1]]), fresh)
        assert cache.seq_len == len(tokens) - 1
        n = len(tokens) - 1
        for ours, theirs in zip(cache.layers, fresh.layers):
            # the same keys and values (computed in other chunks: float rounding differs) ...
            torch.testing.assert_close(ours.k[:, :, :n], theirs.k[:, :, :n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ours.v[:, :, :n], theirs.v[:, :, :n], atol=1e-4, rtol=1e-4)
            # ... and nothing of the rejected tokens left behind
            assert not ours.k[:, :, n:].any() and not ours.v[:, :, n:].any()
        draft_fresh = DenseKVCache.for_model(draft.model.config, capacity=draft.cache.layers[0].capacity)
        with torch.no_grad():
            draft.model(torch.tensor([draft.cached]), draft_fresh)
        m = len(draft.cached)
        for ours, theirs in zip(draft.cache.layers, draft_fresh.layers):
            torch.testing.assert_close(ours.k[:, :, :m], theirs.k[:, :, :m], atol=1e-4, rtol=1e-4)
            assert ours.length == m and not ours.k[:, :, m:].any()
        checked.append(len(tokens))

    result = speculative_decode(target, prompt, draft, 4, SamplingParams(max_new_tokens=20), on_step=check)
    assert 0 < result.accepted < result.proposed, "the test needs both acceptances and rejections"
    assert len(checked) == result.target_passes


def test_greedy_speculative_equals_greedy_on_random_models():
    target = tiny_model(4)
    reference = greedy_decode(target, [3, 1, 4, 1, 5], 30)
    for draft in (LayerSkipDraft(target, 1), LayerSkipDraft(target, 2), NgramDraft(TINY.vocab_size)):
        for gamma in (1, 3, 6):
            out = speculative_decode(target, [3, 1, 4, 1, 5], draft, gamma, SamplingParams(max_new_tokens=30))
            assert out.token_ids == reference, (draft.name, gamma)
            assert len(out.token_ids) == 30 and out.target_passes <= 30


def test_ngram_draft_proposes_what_followed_the_latest_match():
    d = NgramDraft(100, max_n=3)
    assert d.lookup([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]
    assert d.lookup([1, 2, 3, 1, 2, 4, 1, 2], 2) == [4, 1]  # the latest occurrence wins
    assert d.lookup([1, 2, 3], 2) == []
    with pytest.raises(ValueError):
        NgramDraft(100, max_n=0)


def test_bad_arguments_are_refused():
    target = tiny_model(5)
    with pytest.raises(ValueError, match="num_layers"):
        LayerSkipDraft(target, 3)
    with pytest.raises(ValueError, match="gamma"):
        speculative_decode(target, [1], NgramDraft(12), -1)
    with pytest.raises(ValueError, match="at least one token"):
        speculative_decode(target, [], NgramDraft(12), 2)


# --- on SmolLM2 ----------------------------------------------------------------------------------


@SMOLLM2
def test_greedy_speculative_equals_greedy_on_smollm2(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Repeat after me: red, green, blue, red, green, blue."}])
    plain = plain_decode(model, prompt, SamplingParams(max_new_tokens=24), (tok.eos_id,))
    assert plain.target_passes == len(plain.token_ids)
    for draft, gamma in ((NgramDraft(model.config.vocab_size), 4), (LayerSkipDraft(model, 24), 2)):
        out = speculative_decode(model, prompt, draft, gamma, SamplingParams(max_new_tokens=24), (tok.eos_id,))
        assert out.token_ids == plain.token_ids, draft.name
        assert out.target_passes < len(out.token_ids), f"{draft.name} never got a token accepted"


# --- quantisation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,group", [(8, 64), (8, 32), (4, 32), (4, 128)])
def test_quantisation_error_within_half_a_step(bits, group):
    torch.manual_seed(bits + group)
    w = torch.randn(48, 256) * torch.logspace(-3, 1, 256)  # a wide range across each row
    w[3, :group] = 0.0  # an all-zero group
    q, scales = quantize_symmetric(w, bits, group)
    assert q.dtype == torch.int8 and scales.shape == (48, 256 // group)
    assert int(q.abs().max()) <= {8: 127, 4: 7}[bits]
    restored = dequantize_symmetric(q, scales, group)
    assert torch.all((w - restored).abs() <= error_bound(scales, group) * (1 + 1e-6) + 1e-12)
    assert torch.all(restored[3, :group] == 0)
    # each group's largest weight is represented exactly (up to float rounding)
    groups = w.reshape(48, -1, group)
    top = groups.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(restored.reshape(48, -1, group).gather(-1, top), groups.gather(-1, top))


def test_int8_functions_and_int4_packing():
    w = torch.randn(8, 128)
    q, s = quantize_int8_groupwise(w, 64)
    assert torch.equal(dequantize_int8_groupwise(q, s, 64), dequantize_symmetric(q, s, 64))
    q4 = torch.randint(-8, 8, (5, 64), dtype=torch.int8)
    packed = pack_int4(q4)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 32)
    assert torch.equal(unpack_int4(packed), q4)
    for bad in ((w, 48), (w.int(), 64), (w[0], 64)):
        with pytest.raises(ValueError):
            quantize_int8_groupwise(*bad)


@pytest.mark.parametrize("group", [True, False, 0, -16, 16.0, "16"])
def test_a_group_size_that_is_no_positive_int_is_refused(group):
    """A bool is refused although Python counts True as 1 (a group of one divides every row)."""
    w = torch.randn(4, 64)
    for quantize in (
        quantize_int8_groupwise,
        lambda w, g: quantize_symmetric(w, 4, g),
        lambda w, g: QuantLinear(w, None, 8, g),
    ):
        with pytest.raises(ValueError, match=f"group_size must be a positive int, got {group!r}"):
            quantize(w, group)
    q, scales = quantize_int8_groupwise(w, 16)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        dequantize_int8_groupwise(q, scales, group)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_a_weight_holding_nan_or_inf_is_refused_with_where(value, dtype):
    w = torch.randn(4, 64, dtype=dtype)
    w[2, 37] = value
    with pytest.raises(ValueError, match=rf"1 of the weight's values are nan or inf, the first w\[2, 37\] = {value}"):
        quantize_int8_groupwise(w, 16)
    with pytest.raises(ValueError, match="nan or inf"):
        QuantLinear(w, None, 4, 32)
    w[2, 37] = 0.0
    q, scales = quantize_int8_groupwise(w, 16)  # finite again: quantised as usual
    assert bool(torch.isfinite(scales).all())


def test_dequantize_refuses_a_q_that_is_not_int8_and_a_group_size_that_does_not_divide_the_row():
    w = torch.randn(4, 64)
    q, scales = quantize_int8_groupwise(w, 16)
    for bad_q in (q.int(), q.float(), q.to(torch.int16), q.to(torch.uint8), q.tolist()):
        with pytest.raises(ValueError, match="q must be a torch.int8 tensor"):
            dequantize_int8_groupwise(bad_q, scales, 16)
        with pytest.raises(ValueError, match="q must be a torch.int8 tensor"):
            dequantize_symmetric(bad_q, scales, 16)
    with pytest.raises(ValueError, match="q must be a torch.int8 tensor"):
        dequantize_symmetric(q[0], scales, 16)  # 1-D
    with pytest.raises(ValueError, match="group_size 48 does not divide the row length 64"):
        dequantize_int8_groupwise(q, scales[:, :1], 48)  # 64 // 48 = 1 scale per row would otherwise fit
    with pytest.raises(ValueError, match=r"scales must hold one scale per group, \[4, 4\]"):
        dequantize_int8_groupwise(q, torch.cat([scales, scales[:, :1]], dim=1), 16)
    torch.testing.assert_close(dequantize_int8_groupwise(q, scales, 16), w, atol=float(scales.max()) / 2, rtol=0)


def test_quant_linear_output_error_follows_from_the_weight_bound():
    torch.manual_seed(0)
    linear = torch.nn.Linear(192, 96)
    for bits in (8, 4):
        ql = QuantLinear(linear.weight, linear.bias, bits, 32)
        err = (ql.dequantized() - linear.weight).abs()
        assert torch.all(err <= error_bound(ql.scales, 32) + 1e-7)
        x = torch.randn(3, 192)
        bound = x.abs() @ error_bound(ql.scales, 32).T  # |x (W - W')^T| <= |x| |W - W'|^T
        assert torch.all((ql(x) - linear(x)).abs() <= bound + 1e-5)


@SMOLLM2
def test_quantised_smollm2_memory_quality_and_gguf_blocks(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    ids = tok.encode(heldout_text())[:384]
    base = perplexity(model, ids, 384)
    assert 5 < base < 60
    int8 = quantize_model(model, 8, 64)
    for name in ("layers.0.self_attn.q_proj", "layers.29.mlp.down_proj"):
        ql, w = int8.get_submodule(name), model.get_submodule(name).weight
        assert torch.all((ql.dequantized() - w).abs() <= error_bound(ql.scales, 64) + 1e-7)
    assert weight_bytes(int8) < 0.45 * weight_bytes(model)
    assert abs(perplexity(int8, ids, 384) / base - 1) < 0.02
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert greedy_decode(int8, prompt, 8) == greedy_decode(model, prompt, 8)
    # the Q4_1 blocks as stored dequantise to exactly the fp32 loader's weights
    q41 = load_gguf_q4_1().model
    assert isinstance(q41.layers[0].self_attn.q_proj, Q4_1Linear)
    for name in ("layers.0.self_attn.q_proj", "layers.7.self_attn.k_proj", "layers.29.mlp.down_proj"):
        assert torch.equal(q41.get_submodule(name).dequantized(), model.get_submodule(name).weight)
    assert weight_bytes(q41) < 0.4 * weight_bytes(model)
    assert greedy_decode(q41, prompt, 8) == greedy_decode(model, prompt, 8)
    assert math.isfinite(perplexity(quantize_model(model, 4, 32), ids, 384))


def test_spec_quant_benchmark_writes_json(tmp_path):
    from conftest import run_benchmark

    result = run_benchmark("spec_quant", tmp_path / "spec_quant.json")
    rows = result["speculative"]
    assert rows and all(r["same_as_plain"] for r in rows), "greedy speculative decoding changed the text"
    assert {r["draft"] for r in rows} >= {"3-gram lookup"} and all(r["tokens_per_target_pass"] >= 1 for r in rows)
    assert all(r["predicted_speedup"] > 0 and r["measured_speedup"] > 0 for r in rows)
    quant = {r["variant"]: r for r in result["quantisation"]}
    assert quant["fp32"]["memory_vs_fp32"] == 1.0
    assert quant["int8 g64"]["memory_vs_fp32"] < 0.45 and quant["GGUF Q4_1 (as stored)"]["memory_vs_fp32"] < 0.35
    assert quant["GGUF Q4_1 (as stored)"]["perplexity"] == pytest.approx(quant["fp32"]["perplexity"], rel=1e-4)
    assert quant["int8 g64"]["greedy_same_as_fp32"] and quant["GGUF Q4_1 (as stored)"]["greedy_same_as_fp32"]


def test_position_acceptance_counts_only_checked_draft_tokens():
    target = tiny_model(4)
    result = speculative_decode(
        target, [3, 1, 4, 1, 5], LayerSkipDraft(target, 1), 4, SamplingParams(max_new_tokens=30)
    )
    assert 0 < result.rejections <= result.target_passes
    assert result.position_acceptance_rate >= result.acceptance_rate
    assert result.position_acceptance_rate == result.accepted / (result.accepted + result.rejections)
