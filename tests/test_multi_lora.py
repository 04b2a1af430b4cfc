"""Several LoRA adapters in one engine step: the per-row deltas against peft's mixed-adapter batch, and the course's
engine serving requests with different adapters (or none) at once, each getting the tokens it gets served alone on
a copy of the model with its adapter merged."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import SMOLLM2
from torch import nn

from infra_lib.model.lora import LORA_TARGETS, LoRALinear, apply_lora, lora_layers
from infra_lib.model.sampling import SamplingParams
from infra_lib.serving.engine import LLMEngine
from infra_lib.serving.multi_lora import LoRAAdapter, MultiLoRA, MultiLoRAEngine, merged_copy
from infra_lib.serving.scheduler_output import SchedulerConfig
from infra_lib.training.train_step import tiny_config, tiny_model


def test_per_row_deltas_equal_peft_serving_a_mixed_batch():
    """peft's ``adapter_names`` forward (one adapter per batch row, "__base__" for none) on the same A and B."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    holder = nn.Sequential()
    holder.add_module("proj", nn.Linear(16, 12))
    ours = copy.deepcopy(holder)
    twin = get_peft_model(holder, LoraConfig(r=4, lora_alpha=8, target_modules=["proj"]), adapter_name="one")
    twin.add_adapter("two", LoraConfig(r=2, lora_alpha=6, target_modules=["proj"]))
    twin.eval()  # peft serves a mixed batch in inference only
    layer = twin.base_model.model.proj
    adapters = []
    with torch.no_grad():
        for name in ("one", "two"):
            layer.lora_B[name].weight.normal_()
            a, b = layer.lora_A[name].weight.clone(), layer.lora_B[name].weight.clone()
            adapters.append(LoRAAdapter(name, {"proj": (a, b)}, layer.scaling[name]))
    lora = MultiLoRA(ours, adapters)
    x = torch.randn(4, 3, 16)
    names = ["two", "__base__", "one", "two"]
    with torch.no_grad():
        expected = twin(x, adapter_names=names)
        slots = torch.tensor([lora.slot(None if n == "__base__" else n) for n in names]).repeat_interleave(3)
        with lora.rows(slots):
            got = ours(x)
        assert (got - expected).abs().max() <= 1e-6
        assert torch.equal(ours(x)[1], expected[1])  # outside rows(): the base alone, and a base row is exact
    lora.remove()
    assert type(ours.proj) is nn.Linear


def _serve(engine, prompts, adapters, params) -> list[list[int]]:
    ids = [engine.add_request(p, params, **({} if a is False else {"adapter": a})) for p, a in zip(prompts, adapters)]
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    return [engine.output(i).token_ids for i in ids]


def _alone(model, adapter, prompt, params, config, tokenizer=None) -> list[int]:
    """One request served alone by the plain engine on a copy of ``model`` with ``adapter`` merged."""
    served_by = merged_copy(model, adapter) if adapter is not None else model  # the plain engine changes no weight
    return _serve(LLMEngine.from_model(served_by, tokenizer, config), [prompt], [False], params)[0]


def test_an_engine_step_serves_two_adapters_and_the_base_as_each_alone_merged():
    """Small blocks and a small token budget, so prompts are prefilled in chunks beside other requests' decodes."""
    model = tiny_model(tiny_config(vocab_size=320), seed=0)
    adapters = [
        LoRAAdapter.random(model, "all", LORA_TARGETS, rank=4, alpha=8.0, seed=1, std=0.5),
        LoRAAdapter.random(model, "qv", ("q_proj", "v_proj"), rank=2, alpha=4.0, seed=2, std=0.5),
    ]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, block_size=4, num_blocks=64)
    params = SamplingParams(max_new_tokens=6)
    prompts = [list(range(5, 22)), [30, 31, 32], list(range(40, 51))]
    names = ["all", "qv", None]
    engine = MultiLoRAEngine.from_model(copy.deepcopy(model), None, config, adapters=adapters)
    served = _serve(engine, prompts, names, params)
    by_name = {a.name: a for a in adapters}
    alone = [_alone(model, by_name.get(n), p, params, config) for p, n in zip(prompts, names)]
    assert served == alone
    assert served[0] != _alone(model, None, prompts[0], params, config)  # the adapter acts


def test_the_multi_lora_engine_refuses_what_it_cannot_serve():
    model = tiny_model(tiny_config(), seed=0)
    adapter = LoRAAdapter.random(model, "a", ("q_proj",), rank=2, alpha=4.0, seed=0)
    with pytest.raises(ValueError, match="prefix cache"):
        MultiLoRAEngine.from_model(model, None, SchedulerConfig(enable_prefix_caching=True), adapters=[adapter])
    with pytest.raises(ValueError, match="distinct names"):
        MultiLoRA(model, [adapter, adapter])
    engine = MultiLoRAEngine.from_model(model, None, SchedulerConfig(num_blocks=16), adapters=[adapter])
    with pytest.raises(ValueError, match="no adapter named 'b'"):
        engine.add_request([1, 2, 3], adapter="b")
    assert not engine.sequences  # nothing was queued
    engine.runner.lora.remove()
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear


def test_an_adapter_trained_with_apply_lora_moves_into_the_engine():
    model = tiny_model(tiny_config(), seed=0)
    trained = copy.deepcopy(model)
    apply_lora(trained, ("q_proj", "down_proj"), rank=2, alpha=6.0, seed=3)
    with torch.no_grad():
        for layer in lora_layers(trained).values():
            layer.lora_B.normal_(std=0.1)
    adapter = LoRAAdapter.from_model(trained, "trained")
    assert adapter.scaling == 3.0 and set(adapter.weights) == set(lora_layers(trained))
    tokens = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert torch.allclose(merged_copy(model, adapter)(tokens), trained(tokens), atol=1e-5)
    with pytest.raises(ValueError, match="no LoRA layers"):
        LoRAAdapter.from_model(model, "none")
    assert isinstance(next(iter(lora_layers(trained).values())), LoRALinear)


@SMOLLM2
def test_smollm2_serves_two_adapters_and_the_base_in_one_engine_as_each_alone_merged(smollm2):
    """The same chat prompt three times in the same steps: with one adapter, with the other, and on the base model."""
    tokenizer = smollm2.tokenizer
    base = smollm2.model
    adapters = [
        LoRAAdapter.random(base, "all", LORA_TARGETS, rank=8, alpha=16.0, seed=1, std=0.05),
        LoRAAdapter.random(base, "attention", ("q_proj", "k_proj", "v_proj", "o_proj"), 4, 8.0, seed=2, std=0.1),
    ]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=64)
    params = SamplingParams(max_new_tokens=6)
    prompts = ["Write 5 March 2021 as an ISO date."] * 3
    names = ["all", "attention", None]
    engine = MultiLoRAEngine.from_model(base, tokenizer, config, adapters=adapters)
    try:
        served = _serve(engine, prompts, names, params)
    finally:
        engine.runner.lora.remove()  # the session's model is shared: its plain layers go back
    assert all(type(layer.self_attn.q_proj) is nn.Linear for layer in base.layers)
    by_name = {a.name: a for a in adapters}
    alone = [_alone(base, by_name.get(n), p, params, config, tokenizer) for p, n in zip(prompts, names)]
    assert served == alone
    assert served[0] != served[2] and served[1] != served[2]  # each adapter changes the base model's answer
