"""infra_lib.model.native_decode: the decode step in C gives the model's logits and greedy tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import SMOLLM2

import infra_lib.model.native_decode as native_decode
from infra_lib.model import DenseKVCache, Llama, LlamaConfig, greedy_decode
from infra_lib.model.native_decode import (
    NativeDecoder,
    NativeUnavailable,
    _build,
    native_decode_available,
    native_library,
    projections,
    quantize_q8_0,
)
from infra_lib.model.quant import Q4_1Linear, dequantize_symmetric, quantize_symmetric

PROMPTS = ("What is Python?", "Name three planets.", "Write a haiku about the sea.")
FOUR_BIT = ("q4_1", "int4")


def _tiny(tie: bool, bias: bool, intermediate: int = 96, vocab: int = 300) -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
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


def q4_1_linear(weight: torch.Tensor) -> Q4_1Linear:
    """A weight in GGUF Q4_1 blocks (d = (max - min) / 15, m = min, q = round((w - m) / d)), as a
    test's model holds the file's blocks."""
    blocks = weight.detach().float().reshape(weight.shape[0], -1, 32)
    low = blocks.amin(-1)
    d = ((blocks.amax(-1) - low) / 15).to(torch.float16)
    m = low.to(torch.float16)
    step = torch.where(d > 0, d.float(), 1.0)[..., None]
    q = torch.round((blocks - m.float()[..., None]) / step).clamp(0, 15).to(torch.uint8)
    return Q4_1Linear(d, m, q[..., :16] | (q[..., 16:] << 4))


def _round_activations(module, args):
    """What a 4-bit step does to a product's input: int8 per block of 32, scale max |x| / 127."""
    x = args[0]
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * torch.where(top > 0, 127 / top, 0)).clamp(-127, 127)
    return ((q * (top / 127)).reshape(x.shape),)


def four_bit(model: Llama, weights: str, group_size: int = 32, rounded: bool = True) -> tuple[Llama, Llama]:
    """(the model a 4-bit step is given, the step in PyTorch's arithmetic).

    The first is ``model`` for int4 (quantised as the step loads it) and a copy holding Q4_1 blocks
    for q4_1, as ``load_gguf_q4_1`` holds the file's. The second holds every projection's weight as
    the step reads it (dequantised), the head in Q8_0, and with ``rounded`` rounds every product's
    input as the step does."""
    given = copy.deepcopy(model) if weights == "q4_1" else model
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for layer, into in zip(given.layers, reference.layers):
            for name, linear, target in zip(
                ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                projections(layer),
                projections(into),
            ):
                if weights == "q4_1":
                    blocks = q4_1_linear(linear.weight)
                    setattr(layer.self_attn if hasattr(layer.self_attn, name) else layer.mlp, name, blocks)
                    target.weight.copy_(blocks.dequantized())
                else:
                    q, scales = quantize_symmetric(linear.weight, 4, group_size)
                    target.weight.copy_(dequantize_symmetric(q, scales, group_size))
        q, d = quantize_q8_0(model.lm_head.weight)
        head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
        head.weight = torch.nn.Parameter((q.float().reshape(q.shape[0], -1, 32) * d.float()[..., None]).flatten(1))
        reference.lm_head = head
    if rounded:
        for module in reference.modules():
            if isinstance(module, torch.nn.Linear) and module is not reference.embed_tokens:
                module.register_forward_pre_hook(_round_activations)
    return given, reference


def _prefilled(model: Llama, tokens: list[int]) -> DenseKVCache:
    cache = DenseKVCache.for_model(model.config, batch=1, capacity=40)
    model(torch.tensor([tokens]), cache)
    return cache


@pytest.fixture(params=["512-bit", "portable"])
def vector_width(request, monkeypatch):
    """Each 4-bit test twice: on the step as built for this CPU (AVX-512 VNNI products where it has
    them) and on a build without AVX-512 (the portable loops), which the steps then load."""
    if request.param == "portable":
        library = native_library(("-mno-avx512f",))
        assert library.infra_native_q4_path() == 0
        monkeypatch.setattr(native_decode, "_LIBRARY", library)
    return request.param


@pytest.mark.parametrize("weights", FOUR_BIT)
@pytest.mark.parametrize(
    "tie, bias, vocab", [(True, False, 300), (False, True, 301)], ids=["tied", "untied-bias-odd-rows"]
)
def test_four_bit_step_gives_its_pytorch_paths_logits(tie, bias, vocab, weights, vector_width):
    """Q4_1 (the file's blocks) and int4 (chapter 09's, groups of 32): every decode step's logits
    equal the model with its weights as the step reads them and each product's input rounded as the
    step rounds it (int8 per block of 32), within 1e-4, and its greedy picks; without the rounding
    (the plain PyTorch path) within 3% of the logits' range. Rows of three blocks (an odd count),
    a head of 301 rows (not a whole group of four), grouped-query heads, a tied or untied head;
    both vector widths. (Q4_1Linear holds no bias, so q4_1 runs the biasless model.)"""
    model = _tiny(tie, bias and weights == "int4", 96, vocab)
    given, reference = four_bit(model, weights)
    _, plain = four_bit(model, weights, rounded=False)
    tokens = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    decoder = NativeDecoder(given, capacity=40, weights=weights, group_size=32)
    errors, same_pick = [], 0
    with torch.no_grad():
        for i in range(10, 30):
            # tokens[:i] through PyTorch on the given model (as the decoder reads a prompt), then
            # one step: each step compared from the same cache
            got = list(decoder._read(tokens[:i], [tokens[i], 0]))[-1]
            want, unrounded = (
                m(torch.tensor([[tokens[i]]]), cache)[0, -1]
                for m, cache in ((reference, _prefilled(given, tokens[:i])), (plain, _prefilled(given, tokens[:i])))
            )
            errors.append(float((got - want).abs().max()) / float(want.max() - want.min()))
            assert float((got - unrounded).abs().max()) <= 0.03 * float(unrounded.max() - unrounded.min()), i
            same_pick += int(got.argmax()) == int(want.argmax())
    # An input that lands within float noise of a rounding boundary (C and PyTorch sum a norm in
    # another order) rounds one value the other way: that step's logits move by up to about 1%.
    assert sorted(errors)[len(errors) * 3 // 4] <= 2e-6, errors
    assert max(errors) <= 0.01, errors
    assert same_pick >= 19


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


@pytest.fixture(scope="module")
def smollm2_answers(smollm2) -> tuple[list[list[int]], list[list[int]]]:
    """The course's prompts as chat token ids, and the model's 16 greedy tokens after each (PyTorch)."""
    tokenizer = smollm2.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in PROMPTS]
    return prompts, [greedy_decode(smollm2.model, prompt, 16) for prompt in prompts]  # no stop token: 16 each


@SMOLLM2
def test_native_decoder_keeps_smollm2s_greedy_tokens_and_logits(smollm2, smollm2_answers):
    """fp32: the model's greedy tokens on the course's prompts and its logits within 1e-4 (logits
    run to about 30); one thread or two, the same logits to the bit (each output row is one
    thread's sum); bf16 and int8 weights pick fp32's token at 90% of positions or more, teacher-forced,
    reading a half and a quarter of fp32's bytes."""
    model, tokenizer = smollm2.model, smollm2.tokenizer
    prompts, answers = smollm2_answers
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


@pytest.fixture(scope="module")
def smollm2_q4_1(smollm2):
    """SmolLM2 with its projections in the GGUF file's Q4_1 blocks (load_gguf_q4_1), once per module."""
    from infra_lib.model.quant import load_gguf_q4_1

    return load_gguf_q4_1().model


def _greedy_on(prefill: Llama, steps: Llama, prompt: list[int], n: int) -> list[int]:
    """Greedy ids: the prompt through ``prefill``, each later token through ``steps`` (as the C
    decoders read a prompt in PyTorch on the model they were given)."""
    cache = DenseKVCache.for_model(prefill.config, batch=1, capacity=len(prompt) + n)
    with torch.inference_mode():
        out = [int(prefill(torch.tensor([prompt]), cache)[0, -1].argmax())]
        while len(out) < n:
            out.append(int(steps(torch.tensor([[out[-1]]]), cache)[0, -1].argmax()))
    return out


@SMOLLM2
def test_smollm2_in_four_bits_keeps_its_pytorch_paths_greedy_tokens(smollm2, smollm2_q4_1, smollm2_answers):
    """Q4_1: the file's blocks, whose values the fp32 model holds (it is dequantised from them), and
    its Q8_0 head as the file stores it; the C step's greedy tokens are the model's on the course's
    first two prompts, and it picks the model's token at 90% of positions or more on all three,
    teacher-forced (activations rounded to int8 move the logits by about 2% of their range); it reads
    the file's bytes. int4 (groups of 64) alike against its PyTorch path (the weights as it reads
    them, the prompt in fp32 as the decoder reads it): its token at 90% of positions or more,
    teacher-forced, at a sixth of fp32's bytes."""
    from infra_lib.model.loaders import default_gguf_path, stored_blocks

    model = smollm2.model
    layer = smollm2_q4_1.layers[3].mlp.down_proj
    assert torch.equal(layer.dequantized(), model.layers[3].mlp.down_proj.weight)
    types, blocks = stored_blocks(default_gguf_path(), "Q8_0")
    q, d = quantize_q8_0(model.lm_head.weight)  # the table's blocks, recovered from its fp32 values
    stored = blocks["token_embd.weight"].reshape(q.shape[0], -1, 34)
    assert torch.equal(stored[..., :2].contiguous().view(torch.float16).squeeze(-1), d)
    assert torch.equal(stored[..., 2:].contiguous().view(torch.int8).flatten(1), q)
    prompts, answers = smollm2_answers
    decoder = NativeDecoder(smollm2_q4_1, capacity=96, weights="q4_1")
    for prompt, answer in zip(prompts[:2], answers):
        assert decoder.greedy(prompt, 16) == answer
    hits = sum(a == b for p, answer in zip(prompts, answers) for a, b in zip(decoder.teacher_forced(p, answer), answer))
    assert hits >= 0.9 * 16 * len(prompts)
    # the file's bytes but one fp32 embedding row for its Q8_0 one: Q4_1 projections, Q8_0 head, fp32 norms
    body = sum(rows.numel() for rows in stored_blocks(default_gguf_path(), "Q4_1")[1].values())
    norms = sum(t.nbytes for name, t in model.named_parameters() if name.endswith("norm.weight"))
    assert decoder.bytes_per_step == body + blocks["token_embd.weight"].numel() + norms + 4 * model.config.hidden_size
    assert {kind for name, kind in types.items() if name.startswith("blk.") and "norm" not in name} == {"Q4_1"}

    _, reference = four_bit(model, "int4", 64, rounded=False)
    int4 = NativeDecoder(model, capacity=96, weights="int4")
    weights = sum(m.weight.numel() for layer in model.layers for m in projections(layer))
    assert int4.bytes_per_step == decoder.bytes_per_step - weights * 20 // 32 + weights // 2 + weights // 64 * 4
    hits = total = 0
    for prompt in prompts[:2]:
        answer = _greedy_on(model, reference, prompt, 12)
        hits += sum(a == b for a, b in zip(int4.teacher_forced(prompt, answer), answer))
        total += len(answer)
    assert hits >= 0.9 * total, (hits, total)


def test_bad_input_gets_errors_that_say_what_to_change(tmp_path):
    from infra_lib.model.decode_layout import decode_layout

    model = _tiny(True, False)
    with pytest.raises(ValueError, match="weights must be one of"):
        NativeDecoder(model, weights="int3")
    with pytest.raises(TypeError, match="load_gguf_q4_1"):
        NativeDecoder(model, weights="q4_1")
    with pytest.raises(TypeError, match="not a quantised copy"):
        NativeDecoder(four_bit(model, "q4_1")[0], weights="int8")
    with pytest.raises(ValueError, match="group_size of 32, 64"):
        NativeDecoder(model, weights="int4", group_size=48)
    with pytest.raises(ValueError, match="whole blocks of 32 weights, at most 16384 long; this model has rows of 97"):
        NativeDecoder(_tiny(True, False, 97), weights="int4", group_size=32)
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
