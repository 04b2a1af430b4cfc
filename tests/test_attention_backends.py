"""The attention backend switch: the model and the engine give the same greedy tokens with their
attention in the course's Triton kernels (FlashAttention for prompts, paged decode for one-token
steps; the interpreter on a CPU) as in PyTorch. SmolLM2 through both Triton paths is asserted by
chapter 15, section 7, which runs in the suite (tests/test_notebooks.py)."""

from __future__ import annotations

import random

import pytest

from grading.checks.lab06 import tiny_model
from infra_lib.model.generation import greedy_decode
from infra_lib.model.sampling import SamplingParams
from infra_lib.serving import LLMEngine, SchedulerConfig
from infra_lib.serving.model_runner import ModelRunner, attention_backends


def _engine_tokens(model, prompts, backend: str, new_tokens: int, budget: int) -> list[list[int]]:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, block_size=4, num_blocks=64)
    engine = LLMEngine.from_model(model, config=config, attention_backend=backend)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=new_tokens, stop_ids=())) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.output(i).token_ids for i in ids]


def test_the_engine_gives_the_same_tokens_through_the_triton_kernels():
    """Ragged prompts cut into chunks of 5 (FlashAttention over the gathered prefix) and decoded
    together (the paged decode kernel reading the blocks in place)."""
    model = tiny_model(3)
    rng = random.Random(0)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in (3, 9, 6)]
    triton_tokens = _engine_tokens(model, prompts, "triton", 4, budget=5)
    assert triton_tokens == _engine_tokens(model, prompts, "torch", 4, budget=5)
    assert triton_tokens == [greedy_decode(model, p, 4) for p in prompts]


def test_the_model_gives_the_same_tokens_through_flash_attention():
    model = tiny_model(4)
    prompt = list(range(2, 12))
    with model.using_backend("triton"):
        assert model.attention_fn.__name__ == "flash_cached_attention"
        flash = greedy_decode(model, prompt, 5)
    assert model.attention_fn.__name__ == "cached_attention"  # the with block put the default back
    assert flash == greedy_decode(model, prompt, 5)


def test_an_unknown_backend_is_refused_with_the_choices():
    model = tiny_model(0)
    with pytest.raises(ValueError, match=r"'torch', 'triton'.*'cuda'"):
        attention_backends("cuda")
    with pytest.raises(ValueError, match="'torch' or 'triton'"):
        model.using_backend("flash")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLMEngine.from_model(model, config=SchedulerConfig(num_blocks=8), attention_backend="Triton")
    assert ModelRunner.__init__.__defaults__ == ("torch",)
