"""LoRA on the course's Llama: the layer against peft's, the wrapped model against transformers + peft, merging,
the shipped date task, the memory a LoRA step holds against a full fine-tune's, and a short fine-tune of SmolLM2."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import SMOLLM2
from torch import nn

from infra_lib.model.lora import (
    LORA_TARGETS,
    LoRALinear,
    adapter_state,
    apply_lora,
    compare_linear_with_peft,
    compare_model_with_peft,
    load_adapter_state,
    lora_layers,
    merge_lora,
    trainable_parameters,
    unmerge_lora,
)
from infra_lib.training.lora_finetune import (
    DATE_TASKS,
    Example,
    finetune,
    load_date_items,
    make_date_items,
    training_memory,
)
from infra_lib.training.train_step import tiny_config, tiny_model


def _layer(dtype=torch.float32, bias=True, rank=4, alpha=8.0, seed=0) -> LoRALinear:
    torch.manual_seed(seed)
    return LoRALinear(nn.Linear(24, 40, bias=bias).to(dtype), rank, alpha)


def test_a_new_layer_equals_its_base_and_only_a_and_b_train():
    layer = _layer()
    x = torch.randn(3, 5, 24)
    assert torch.equal(layer(x), layer.base(x))  # B starts at zero: the adapted layer is the base
    assert layer.lora_A.shape == (4, 24) and layer.lora_B.shape == (40, 4) and layer.scaling == 2.0
    assert bool(layer.lora_A.abs().gt(0).all()) and not layer.lora_B.any()
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]
    with torch.no_grad():
        layer.lora_B.normal_()
    (layer(x) ** 2).sum().backward()
    assert layer.base.weight.grad is None and layer.base.bias.grad is None
    assert layer.lora_A.grad.abs().sum() > 0 and layer.lora_B.grad.abs().sum() > 0


@pytest.mark.parametrize(("rank", "alpha", "dropout"), [(0, 8.0, 0.0), (2.5, 8.0, 0.0), (2, 0.0, 0.0), (2, 4.0, 1.0)])
def test_lora_linear_refuses_bad_arguments(rank, alpha, dropout):
    with pytest.raises(ValueError):
        LoRALinear(nn.Linear(4, 4), rank, alpha, dropout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lora_linear_equals_peft_on_the_same_a_and_b(dtype):
    """At the start (B zero: the gradient of A is zero in both) and with a random B: outputs and the gradients of A,
    B and the input agree with peft's lora.Linear to 1e-6 (float32) and 1e-12 (float64); they come out equal."""
    tolerance = 1e-6 if dtype == torch.float32 else 1e-12
    for bias in (True, False):
        layer = _layer(dtype, bias)
        x = torch.randn(3, 5, 24, dtype=dtype)
        at_start = compare_linear_with_peft(layer, x, seed=1)
        with torch.no_grad():
            layer.lora_B.normal_()
        trained = compare_linear_with_peft(layer, x, seed=2)
        assert max(at_start.values()) <= tolerance and max(trained.values()) <= tolerance, (at_start, trained)


def test_a_tiny_llama_with_lora_equals_transformers_with_peft():
    model = tiny_model(tiny_config(vocab_size=320), seed=0)
    apply_lora(model, rank=4, alpha=8.0, seed=1)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(std=0.05)
    tokens = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(3))
    diffs = compare_model_with_peft(model, tokens)
    assert diffs["logits"] <= 1e-5 and diffs["grad_A"] <= 1e-5 and diffs["grad_B"] <= 1e-5, diffs


def test_merge_keeps_the_output_and_unmerge_restores_the_weight():
    layer = _layer(rank=3, alpha=5.0)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(6, 24)
    weight, unmerged = layer.base.weight.detach().clone(), layer(x).detach()
    layer.merge()
    merged_weight = layer.base.weight.detach().clone()
    assert layer.merged and torch.allclose(layer(x), unmerged, atol=1e-5)
    assert torch.allclose(merged_weight, weight + layer.scaling * layer.lora_B @ layer.lora_A, atol=1e-6)
    layer.merge()  # a second merge does nothing
    assert torch.equal(layer.base.weight, merged_weight)
    layer.unmerge()
    layer.unmerge()  # nor does a second unmerge
    assert not layer.merged and (layer.base.weight - weight).abs().max() <= 1e-6
    assert torch.allclose(layer(x), unmerged, atol=1e-5)


def test_apply_lora_wraps_every_target_and_counts_its_parameters():
    config = tiny_config()
    model = tiny_model(config, seed=0)
    full = trainable_parameters(model)
    wrapped = apply_lora(model, LORA_TARGETS, rank=2, alpha=4.0, seed=0)
    assert len(wrapped) == 7 * config.n_layers
    expected = sum(2 * (layer.in_features + layer.out_features) for layer in wrapped.values())
    assert trainable_parameters(model) == expected < full / 10
    again = tiny_model(config, seed=0)
    apply_lora(again, LORA_TARGETS, rank=2, alpha=4.0, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(adapter_state(model).values(), adapter_state(again).values()))
    with pytest.raises(ValueError, match="already"):
        apply_lora(model)
    with pytest.raises(ValueError, match="no module"):
        apply_lora(tiny_model(config), ("qkv_proj",))


def test_an_adapter_state_moves_between_models_and_merges_into_the_same_logits():
    config = tiny_config()
    trained, fresh = tiny_model(config, seed=0), tiny_model(config, seed=0)
    apply_lora(trained, rank=2, alpha=4.0, seed=1)
    apply_lora(fresh, rank=2, alpha=4.0, seed=2)
    with torch.no_grad():
        for layer in lora_layers(trained).values():
            layer.lora_B.normal_(std=0.1)
    load_adapter_state(fresh, adapter_state(trained))
    tokens = torch.randint(0, config.vocab_size, (1, 12))
    with torch.no_grad():
        expected = trained(tokens)
        merge_lora(fresh)
        assert torch.allclose(fresh(tokens), expected, atol=1e-5)
        with pytest.raises(ValueError, match="merged"):
            load_adapter_state(fresh, adapter_state(trained))
        unmerge_lora(fresh)
    with pytest.raises(ValueError, match="does not fit"):
        load_adapter_state(fresh, {"layers.0.self_attn.q_proj.lora_A": torch.zeros(2, 2)})


def test_the_shipped_date_task_is_what_its_seeded_generator_writes():
    shipped = [json.loads(line) for line in DATE_TASKS.read_text(encoding="utf-8").splitlines()]
    assert shipped == make_date_items(seed=0)
    for task in ("to_iso", "from_iso"):
        train, test = load_date_items(task, "train"), load_date_items(task, "test")
        assert (len(train), len(test)) == (240, 60)
        assert not {i["answer"] for i in train} & {i["answer"] for i in test}  # no date in both splits
    assert load_date_items("to_iso", "test")[0]["answer"].count("-") == 2
    with pytest.raises(ValueError):
        load_date_items("to_roman", "train")


def test_a_lora_step_holds_gradients_and_adam_state_for_the_adapters_only():
    """Counted from the tensors that exist after one AdamW step: the adapters' gradients and two moments (plus
    AdamW's one-number step counter per tensor), against every parameter's in a full fine-tune."""
    config = tiny_config()
    generator = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(0, 256, (6,), generator=generator).tolist(), [7, 8, 9]) for _ in range(4)]
    models = {}
    for kind in ("full", "lora"):
        model = tiny_model(config, seed=0)
        if kind == "lora":
            apply_lora(model, rank=4, alpha=8.0, seed=0)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-3)
        run = finetune(model, examples, steps=1, batch_size=4, optimizer=optimizer)
        models[kind] = (training_memory(model, optimizer), run.trainable, len(trainable))
    (lora, lora_count, lora_tensors), (full, full_count, full_tensors) = models["lora"], models["full"]
    assert lora.gradients == 4 * lora_count and full.gradients == 4 * full_count
    assert lora.optimizer_state == 8 * lora_count + 4 * lora_tensors
    assert full.optimizer_state == 8 * full_count + 4 * full_tensors
    assert lora.parameters == full.parameters + 4 * lora_count  # the frozen model is still all there
    assert lora.total < full.total / 2


@SMOLLM2
def test_a_few_lora_steps_on_smollm2_raise_the_held_out_likelihood_and_merge_keeps_the_answer(smollm2):
    """Three steps of four examples on the date task (the chapter trains for minutes): the held-out answers' mean
    log-likelihood rises, and merging the adapters leaves the greedy answer as it was."""
    from infra_lib.model import greedy_decode
    from infra_lib.training.lora_finetune import encode_items, mean_answer_log_likelihood

    tokenizer = smollm2.tokenizer
    model = copy.deepcopy(smollm2.model)
    train = encode_items(tokenizer, load_date_items("to_iso", "train"))
    held_out = encode_items(tokenizer, load_date_items("to_iso", "test")[:6])
    before = mean_answer_log_likelihood(model, held_out)
    apply_lora(model, rank=8, alpha=16.0, seed=0)
    assert trainable_parameters(model) == 2_442_240  # 30 layers x 81 408
    run = finetune(model, train, steps=3, batch_size=4, lr=2e-3, seed=0)
    assert run.losses[-1] < run.losses[0]
    assert mean_answer_log_likelihood(model, held_out) > before
    model.eval()
    unmerged = greedy_decode(model, held_out[0].prompt_ids, 12, stop_id=tokenizer.eos_id)
    merge_lora(model)
    assert greedy_decode(model, held_out[0].prompt_ids, 12, stop_id=tokenizer.eos_id) == unmerged
