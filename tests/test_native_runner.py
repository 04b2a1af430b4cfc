"""infra_lib.serving.native_runner: the engine's step in C gives ModelRunner's logits, K/V and tokens."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import SMOLLM2
from test_native_decode import _tiny, _weights_as_read, four_bit, vector_width  # noqa: F401 (a fixture)

from infra_lib.model import SamplingParams, greedy_decode
from infra_lib.model.native_decode import native_library
from infra_lib.serving import LLM, LLMEngine, PagedKVStore, SchedulerConfig
from infra_lib.serving.model_runner import ModelRunner
from infra_lib.serving.native_runner import NativeModelRunner, pack_panels


class BothRunners:
    """Runs every engine step through the PyTorch runner and the C runner, each on its own store,
    records how far the logits and the stores differ, and samples from the PyTorch logits."""

    def __init__(self, reference: ModelRunner, native: NativeModelRunner):
        self.reference, self.native = reference, native
        self.max_position = reference.max_position
        self.logit_error = self.store_error = 0.0
        self.step_sizes: list[int] = []
        self.step_errors: list[float] = []  # each step's largest logit difference

    def run(self, batch):
        expected, got = self.reference.forward(batch), self.native.forward(batch)
        self.step_sizes.append(sum(s.num_tokens for _, s in batch))
        assert got.shape == expected.shape
        self.step_errors.append(float((got - expected).abs().max()))
        self.logit_error = max(self.logit_error, self.step_errors[-1])
        for a, b in zip(self.reference.store.k + self.reference.store.v, self.native.store.k + self.native.store.v):
            self.store_error = max(self.store_error, float((a - b).abs().max()))
        samplers = [seq for seq, s in batch if s.samples]
        return {seq.seq_id: int(expected[i].argmax()) for i, seq in enumerate(samplers)}


def _config(budget: int) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, block_size=4, num_blocks=96)


def _both(model, weights: str, budget: int, max_tokens: int) -> tuple[LLMEngine, BothRunners]:
    config = _config(budget)
    stores = [PagedKVStore.for_model(model.config, config.num_blocks, config.block_size) for _ in range(2)]
    if weights in ("q4_1", "int4"):
        given, reference = four_bit(model, weights)
    else:
        given, reference = model, model if weights == "fp32" else _weights_as_read(model, weights)
    runner = BothRunners(
        ModelRunner(reference, stores[0]),
        NativeModelRunner(given, stores[1], weights, max_tokens=max_tokens, group_size=32),
    )
    return LLMEngine(runner, config), runner


def _serve(engine: LLMEngine, prompts, new_tokens) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, stop_ids=())) for p, n in zip(prompts, new_tokens)]
    while engine.has_unfinished():
        engine.step()
    return [engine.output(i).token_ids for i in ids]


NEW_TOKENS = [5, 3, 8, 4, 6, 2]


def _ragged(model, weights: str) -> tuple[list[list[int]], list[list[int]], BothRunners]:
    """Six ragged prompts served in steps of up to 6 tokens, each step through both runners: the
    prompts, each request's tokens, and the runners (every step checked to have run in C)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in (3, 11, 6, 17, 1, 9)]
    engine, runner = _both(model, weights, budget=6, max_tokens=64)
    tokens = _serve(engine, prompts, NEW_TOKENS)
    assert runner.native.native_steps == len(runner.step_sizes) > 0 and runner.native.fallback_steps == 0
    assert max(runner.step_sizes) > 4  # steps with a chunk beside decodes, not only decodes
    assert [len(t) for t in tokens] == NEW_TOKENS
    return prompts, tokens, runner


@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize(
    "tie, bias, intermediate", [(True, False, 96), (False, True, 97)], ids=["tied", "untied-bias-odd-rows"]
)
def test_native_runner_gives_the_pytorch_runners_logits_and_kv(tie, bias, intermediate, weights):
    """Ragged prompts in chunks of up to 6 tokens beside other sequences' decodes, every step in C:
    each step's logits and every K/V slot equal ModelRunner's (summed in another order), through
    block tables that run out of order as the pool hands blocks back; grouped-query heads, biases, a
    tied or untied head, projections whose rows do not fill a panel. bf16 and int8 against the same
    model with its weights as the step reads them."""
    model = _tiny(tie, bias, intermediate)
    prompts, tokens, runner = _ragged(model, weights)
    assert runner.logit_error < 1e-4, f"logits differ by {runner.logit_error:.2e}"
    assert runner.store_error < 1e-5, f"K/V slots differ by {runner.store_error:.2e}"
    if weights == "fp32":
        assert tokens == [greedy_decode(model, p, n) for p, n in zip(prompts, NEW_TOKENS)]


@pytest.mark.parametrize("weights", ["q4_1", "int4"])
@pytest.mark.parametrize(
    "tie, bias, vocab", [(True, False, 300), (False, True, 301)], ids=["tied", "untied-bias-odd-rows"]
)
@pytest.mark.usefixtures("vector_width")
def test_four_bit_runner_gives_its_pytorch_paths_logits_and_kv(tie, bias, vocab, weights):
    """The same ragged workload with Q4_1 (the file's blocks) and int4 (groups of 32) weights, on both
    vector widths: each step's logits and every K/V slot equal ModelRunner's on the model with its
    weights as the step reads them and each product's input rounded as the step rounds it (int8 per
    block of 32), summed in another order, at three steps in four or more; rows of three blocks and
    a head of 301 rows. An input within float noise of a rounding boundary rounds one value the other
    way: that step's logits move by up to about 1% of their range (about 40 here), and the K/V it
    wrote stays a little apart."""
    _, _, runner = _ragged(_tiny(tie, bias and weights == "int4", 96, vocab), weights)
    errors = sorted(runner.step_errors)
    assert errors[len(errors) * 3 // 4] < 1e-4 and errors[-1] < 0.4, errors
    assert runner.store_error < 0.05, f"K/V slots differ by {runner.store_error:.2e}"


def test_steps_larger_than_max_tokens_run_in_pytorch_on_the_same_store():
    """A prompt prefilled by the fallback (PyTorch), then decoded in C from the K/V it wrote: the
    engine's tokens equal greedy_decode's, and both paths ran."""
    model = _tiny(True, False)
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=32, block_size=4, num_blocks=64)
    store = PagedKVStore.for_model(model.config, config.num_blocks, config.block_size)
    runner = NativeModelRunner(model, store, max_tokens=4)
    engine = LLMEngine(runner, config)
    prompts = [list(range(5, 25)), list(range(40, 49)), [7, 8]]
    tokens = _serve(engine, prompts, [6, 6, 6])
    assert tokens == [greedy_decode(model, p, 6) for p in prompts]
    assert runner.native_steps > 0 and runner.fallback_steps > 0


def test_the_engine_runs_in_c_through_from_model_and_llm():
    model = _tiny(False, True, 97)
    config = _config(8)
    llm = LLM(engine=LLMEngine.from_model(model, config=config, native="fp32"))
    assert isinstance(llm.engine.runner, NativeModelRunner)
    out = llm.generate([[3, 4, 5, 6], [9] * 7], SamplingParams(max_new_tokens=5, stop_ids=()), use_tqdm=False)
    assert [o.token_ids for o in out] == [greedy_decode(model, p, 5) for p in ([3, 4, 5, 6], [9] * 7)]


def test_pack_panels_puts_each_panels_rows_input_major_and_pads_the_last():
    weight = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    panels = pack_panels(weight, 4)
    assert panels.shape == (2, 3, 4)
    assert torch.equal(panels[0], weight[:4].T) and torch.equal(panels[1][:, 0], weight[4])
    assert torch.equal(panels[1][:, 1:], torch.zeros(3, 3))
    assert native_library().infra_native_panel_width() in (16, 32)


def test_native_runner_refuses_what_it_cannot_read():
    model = _tiny(True, False)
    store = PagedKVStore.for_model(model.config, 8, 4)
    with pytest.raises(ValueError, match="weights must be one of"):
        NativeModelRunner(model, store, "fp16")
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        NativeModelRunner(model, store, max_tokens=0)
    with pytest.raises(ValueError, match="contiguous fp32 store"):
        NativeModelRunner(model, PagedKVStore.for_model(model.config, 8, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="fallback model must have the model's config"):
        NativeModelRunner(model, store, fallback=_tiny(True, False, 97))
    from infra_lib.model.decode_layout import decode_layout

    with pytest.raises(TypeError, match="as loaded"):
        NativeModelRunner(decode_layout(model), store)
    runner = NativeModelRunner(model, store)
    with pytest.raises(ValueError, match="at least one scheduled sequence"):
        runner.forward([])


@SMOLLM2
def test_smollm2_engine_in_c_gives_the_pytorch_engines_tokens(smollm2):
    """SmolLM2 on a small backlog at batch limit 4, every step in C; then again with steps over 32
    tokens (the prompts' prefill) in PyTorch and the rest in C: every request's tokens equal the
    PyTorch engine's, and greedy_decode's alone."""
    model, tokenizer = smollm2.model, smollm2.tokenizer
    prompts = [
        tokenizer.encode(text)
        for text in (
            "What is Python?",
            "Name three planets.",
            "Write a haiku about the sea.",
            "Explain in three short paragraphs how a CPU cache works, why memory bandwidth limits decoding, and what "
            "batching changes about it.",
            "Count from one to five.",
        )
    ]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=16, num_blocks=64)
    params = SamplingParams(max_new_tokens=12, stop_ids=())
    expected = [o.token_ids for o in LLM(model, tokenizer, config).generate(prompts, params, use_tqdm=False)]
    assert expected[:2] == [greedy_decode(model, p, 12) for p in prompts[:2]]
    native = LLM(engine=LLMEngine.from_model(model, tokenizer, config, native="fp32"))
    assert [o.token_ids for o in native.generate(prompts, params, use_tqdm=False)] == expected
    assert native.engine.runner.native_steps == len(native.engine.steps) and native.engine.runner.fallback_steps == 0
    store = PagedKVStore.for_model(model.config, config.num_blocks, config.block_size)
    split = LLM(engine=LLMEngine(NativeModelRunner(model, store, max_tokens=32), config, tokenizer))
    assert [o.token_ids for o in split.generate(prompts, params, use_tqdm=False)] == expected
    assert split.engine.runner.native_steps > split.engine.runner.fallback_steps > 0


@SMOLLM2
def test_the_server_on_the_engine_in_c_answers_the_openai_client_as_in_pytorch(smollm2):
    """`infra-lab serve --native fp32`'s engine behind the official client: the whole answer and the
    streamed deltas equal the PyTorch engine's greedy answer; a sampled answer arrives too."""
    from openai import OpenAI

    from infra_lib.serving.server import ServerThread, build_engine, create_app

    question = [{"role": "user", "content": "What is the capital of France?"}]
    expected = LLM(smollm2.model, smollm2.tokenizer, _config(64)).generate(
        [question], SamplingParams(max_new_tokens=16), use_tqdm=False
    )[0]
    engine = build_engine(smollm2.model, smollm2.tokenizer, max_num_seqs=4, kv_blocks=64, native="fp32")
    assert isinstance(engine.engine.runner, NativeModelRunner)
    with ServerThread(create_app(engine, "SmolLM2-135M-Instruct")) as thread:
        client = OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0)
        whole = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=question, temperature=0, max_tokens=16
        )
        assert whole.choices[0].message.content == expected.text
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=question, temperature=0, max_tokens=16, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text
        sampled = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=question, temperature=0.8, max_tokens=8, seed=3
        )
        assert sampled.usage.completion_tokens >= 1
    assert engine.engine.runner.native_steps > 0
    with pytest.raises(ValueError, match="without --native"):
        build_engine(smollm2.model, smollm2.tokenizer, pieces={"BlockPool": None}, native="fp32")
