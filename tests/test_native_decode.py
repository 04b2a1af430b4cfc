"""infra_lib.model.native_decode: the decode step in C gives the model's logits and greedy tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import SMOLLM2

from infra_lib.model import DenseKVCache, Llama, LlamaConfig, greedy_decode
from infra_lib.model.native_decode import NativeDecoder, NativeUnavailable, _build, native_decode_available

PROMPTS = ("What is Python?", "Name three planets.", "Write a haiku about the sea.")


def _tiny(tie: bool, bias: bool, intermediate: int = 96) -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=intermediate,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        max_position=128,
        tie_embeddings=tie,
        attention_bias=bias,
        output_bias=bias,
    )
    model = Llama(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms and biases away from their initial ones and zeros
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _weights_as_read(model: Llama, weights: str) -> Llama:
    """The same model with every projection's and the head's weight as the C step in ``weights`` reads
    it (rounded to bf16, or quantised to int8 and scaled back), kept in fp32, the embedding table as it
    was: the step's weights in PyTorch's arithmetic."""
    from infra_lib.model.decode_layout import Int8RowLinear

    def as_read(weight: torch.Tensor) -> torch.Tensor:
        if weights == "bf16":
            return weight.to(torch.bfloat16).float()
        quantised = Int8RowLinear(weight)
        return quantised.q.float() * quantised.scale.float()[:, None]

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for layer in rounded.layers:
            for linear in (
                *[getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")],
                layer.mlp.gate_proj,
                layer.mlp.up_proj,
                layer.mlp.down_proj,
            ):
                linear.weight.copy_(as_read(linear.weight))
        head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
        head.weight = torch.nn.Parameter(as_read(model.lm_head.weight.detach()))
        rounded.lm_head = head
    return rounded


@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize(
    "tie, bias, intermediate", [(True, False, 96), (False, True, 97)], ids=["tied", "untied-bias-odd-rows"]
)
def test_native_step_gives_the_models_logits_at_every_position(tie, bias, intermediate, weights):
    """Every decode step's logits equal the model's through its KV cache (summed in another order):
    grouped-query heads, biases, a tied or untied head, rows that do not fill a group of four, a row
    length that does not pair up; bf16 and int8 against the same model with its weights as the step
    reads them (rounded to bf16; quantised and scaled back)."""
    model = _tiny(tie, bias, intermediate)
    reference = model if weights == "fp32" else _weights_as_read(model, weights)
    tokens = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(1))
    decoder = NativeDecoder(model, capacity=40, weights=weights)
    picks = decoder.teacher_forced(tokens[0, :10].tolist(), tokens[0, 10:].tolist())
    with torch.no_grad():
        # the prompt runs in PyTorch on the model's fp32 weights, in the decoder as here; then each step
        cache = DenseKVCache.for_model(model.config, batch=1, capacity=40)
        expected = [int(model(tokens[:, :10], cache)[0, -1].argmax())]
        for i in range(10, 30):
            want = reference(tokens[:, i : i + 1], cache)[0, -1]
            got = decoder._step(int(tokens[0, i]), i)
            assert float((got - want).abs().max()) <= 1e-4, i
            expected.append(int(want.argmax()))
    assert picks == expected[:20]


def test_perplexity_read_one_step_at_a_time_is_the_models():
    """StaticDecoder.perplexity (the first token as the prompt, then one decode step a token) gives
    quant.perplexity's number, eager and through the C step; too short or too long a text is refused."""
    from infra_lib.model.compiled_decode import StaticDecoder
    from infra_lib.model.quant import perplexity

    model = _tiny(False, True)
    tokens = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = perplexity(model, tokens)
    assert StaticDecoder(model, capacity=40, compile=False).perplexity(tokens) == pytest.approx(expected, rel=1e-5)
    decoder = NativeDecoder(model, capacity=40)
    assert decoder.perplexity(tokens) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="two tokens"):
        decoder.perplexity(tokens[:1])
    with pytest.raises(ValueError, match="larger capacity"):
        decoder.perplexity(tokens + tokens)


@SMOLLM2
def test_native_decoder_keeps_smollm2s_greedy_tokens_and_logits(smollm2):
    """fp32: the model's greedy tokens on the course's prompts and its logits within 1e-4 (logits
    run to about 30); one thread or two, the same logits to the bit (each output row is one
    thread's sum); bf16 and int8 weights pick fp32's token at 90% of positions or more, teacher-forced,
    reading a half and a quarter of fp32's bytes."""
    model, tokenizer = smollm2.model, smollm2.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in PROMPTS]
    answers = [greedy_decode(model, prompt, 16) for prompt in prompts]  # no stop token: 16 each
    decoder = NativeDecoder(model, capacity=96)
    for prompt, answer in zip(prompts[:2], answers):
        expected = answer[: answer.index(tokenizer.eos_id) + 1] if tokenizer.eos_id in answer else answer
        assert decoder.greedy(prompt, 16, tokenizer.eos_id) == expected
    prompt, answer = prompts[0], answers[0]
    with torch.inference_mode():
        full = model(torch.tensor([prompt + answer]))[0]
        decoder.teacher_forced(prompt, answer[:8])  # fills the cache up to answer[6]
        steps = {}
        for threads in (1, 2):
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                steps[threads] = decoder._step(answer[7], len(prompt) + 7).clone()
            finally:
                torch.set_num_threads(previous)
    assert float((steps[2] - full[len(prompt) + 7]).abs().max()) <= 1e-4
    assert torch.equal(steps[1], steps[2])
    assert decoder.bytes_per_step == pytest.approx(model.weight_bytes(), rel=0.01)
    for weights, share in (("bf16", 1 / 2), ("int8", 1 / 4)):
        smaller = NativeDecoder(model, capacity=96, weights=weights)
        assert smaller.bytes_per_step == pytest.approx(decoder.bytes_per_step * share, rel=0.02), weights
        hits = total = 0
        for prompt, answer in zip(prompts, answers):
            picks = smaller.teacher_forced(prompt, answer)
            hits += sum(a == b for a, b in zip(picks, answer))
            total += len(answer)
        assert hits / total >= 0.9, (weights, hits, total)


def test_bad_input_gets_errors_that_say_what_to_change(tmp_path):
    from infra_lib.model.decode_layout import decode_layout

    model = _tiny(True, False)
    with pytest.raises(ValueError, match="weights must be one of"):
        NativeDecoder(model, weights="int4")
    with pytest.raises(TypeError, match="model as loaded"):
        NativeDecoder(decode_layout(model))
    with pytest.raises(TypeError, match="infra_lib Llama"):
        NativeDecoder(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="fp32 model"):
        NativeDecoder(Llama(model.config).to(torch.bfloat16))
    decoder = NativeDecoder(model, capacity=16)
    with pytest.raises(ValueError, match="token ids"):
        decoder.teacher_forced([1, 2], [3, 300])
    with pytest.raises(ValueError, match="larger capacity"):
        decoder.greedy([1] * 10, 8)
    with pytest.raises(ValueError, match="empty"):
        decoder.teacher_forced([1], [])
    assert native_decode_available() == (True, "")
    with pytest.raises(NativeUnavailable, match="did not compile"):
        _build("/bin/false", tmp_path / "step.so")
    assert not (tmp_path / "step.so").exists()


def test_a_compiler_that_refuses_the_tuning_flags_still_builds_the_step(tmp_path):
    """Tuning for this CPU is a bonus: a compiler that rejects it builds the portable step, which loads."""
    import ctypes
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    picky = tmp_path / "picky-cc"
    picky.write_text(
        '#!/bin/sh\nfor a in "$@"; do case "$a" in -march=*|-mcpu=*|-mprefer*) '
        'echo "unknown option $a" >&2; exit 1;; esac; done\n'
        f'exec {cc} "$@"\n'
    )
    picky.chmod(0o755)
    _build(str(picky), tmp_path / "step.so")
    assert ctypes.CDLL(str(tmp_path / "step.so")).infra_native_abi() >= 1


def test_doctor_says_how_to_get_the_step_where_it_cannot_be_built(monkeypatch):
    """Without a C compiler the doctor notes it (not a failure: the course runs without the step) and
    says what to install."""
    import infra_lib.model.native_decode as native_decode
    from course_tools import doctor

    monkeypatch.setattr(
        native_decode,
        "native_decode_available",
        lambda: (False, "no C compiler found (looked for $CC, cc, gcc, clang): install one"),
    )
    finding = doctor.native_finding()
    assert not finding.ok and not finding.required
    assert finding.detail.startswith("no C compiler found") and "apt-get install gcc" in finding.fix
    assert "[note] native decode step" in doctor.report([finding])[0]
