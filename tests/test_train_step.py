"""One training step of the tiny Llama: fp32 against a hand-written torch step, bf16 with fp32 master
weights, activation checkpointing, the memory it counts against zero.py's calculator, and a short
run on the sample text. Everything is seeded; no test looks at a clock."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from infra_lib.training.train_step import (
    MasterWeightAdamW,
    make_optimizer,
    memory_breakdown,
    memory_report,
    saved_activation_bytes,
    text_batches,
    text_tokens,
    tiny_model,
    train,
    train_step,
)
from infra_lib.training.zero import zero_memory_per_device

# The same batch through the bf16 model and the fp32 one: bf16 keeps 8 significant bits (relative
# rounding 2^-9 ≈ 0.2% per stored value), which moved the mean cross-entropy by at most 0.002 nats
# over three steps here; 0.01 leaves room for that, while an update that never reaches the working
# weights is off by 0.6 nats after one step.
BF16_LOSS_TOLERANCE = 0.01


@pytest.fixture(scope="module")
def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    stream = text_batches(text_tokens(), batch=4, seq_len=64, seed=1)
    return [next(stream) for _ in range(3)]


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_text_batches_are_seeded_windows_with_targets_shifted_by_one():
    tokens = text_tokens()
    assert tokens.dtype == torch.long and int(tokens.max()) < 256 and tokens.numel() > 30_000
    first = next(text_batches(tokens, batch=3, seq_len=16, seed=7))
    again = next(text_batches(tokens, batch=3, seq_len=16, seed=7))
    inputs, targets = first
    assert inputs.shape == targets.shape == (3, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1]), "targets must be the inputs shifted left by one token"
    assert torch.equal(inputs, again[0]) and torch.equal(targets, again[1]), "the same seed must give the same batch"


def test_fp32_step_equals_a_hand_written_torch_step(batches):
    inputs, targets = batches[0]
    model = tiny_model(seed=3)
    reference = tiny_model(seed=3)
    loss = train_step(model, make_optimizer(model, "fp32", lr=1e-3), inputs, targets)

    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    logits = reference(inputs)
    reference_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    reference_loss.backward()
    reference_optimizer.step()

    assert loss == pytest.approx(reference_loss.item(), abs=0), "the loss must be torch's cross-entropy"
    assert loss == pytest.approx(5.545, abs=0.1), "a fresh model must start near ln(256)"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=f"gradient of {name} differs")
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"{name} after the AdamW step differs")


def test_bf16_keeps_fp32_masters_and_follows_the_fp32_loss(batches):
    fp32_model, bf16_model = tiny_model(seed=3), tiny_model(seed=3)
    initial = [p.detach().clone() for p in bf16_model.parameters()]
    fp32_optimizer = make_optimizer(fp32_model, "fp32")
    bf16_optimizer = make_optimizer(bf16_model, "bf16")
    assert isinstance(bf16_optimizer, MasterWeightAdamW)
    for masters_from, p in zip(initial, bf16_optimizer.masters):
        assert torch.equal(p, masters_from), "the masters must be exact copies of the fp32 weights"

    for inputs, targets in batches:  # after the first step the loss also checks the update was copied back
        fp32_loss = train_step(fp32_model, fp32_optimizer, inputs, targets)
        bf16_loss = train_step(bf16_model, bf16_optimizer, inputs, targets, precision="bf16")
        assert bf16_loss == pytest.approx(fp32_loss, abs=BF16_LOSS_TOLERANCE)

    for p, master, before in zip(bf16_model.parameters(), bf16_optimizer.masters, initial):
        assert p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16, "working weights and grads are bf16"
        assert master.dtype == torch.float32 and master.grad is None, "masters are fp32, their grads freed"
        assert torch.equal(p, master.to(torch.bfloat16)), "the working weights must be the rounded masters"
        assert not torch.equal(master, before), "AdamW must have updated the masters"
    states = bf16_optimizer.inner.state.values()
    assert all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)


def test_checkpointing_gives_the_same_step_and_saves_far_fewer_activations(batches):
    inputs, targets = batches[0]
    measured = {}
    for checkpoint in (False, True):
        model = tiny_model(seed=5)
        optimizer = make_optimizer(model, "fp32")
        measured[checkpoint] = memory_breakdown(model, optimizer, inputs, targets, checkpoint=checkpoint)
        measured[checkpoint]["loss"] = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item()
        measured[checkpoint]["grads"] = grads(model)
        measured[checkpoint]["params"] = [p.detach().clone() for p in model.parameters()]
    plain, recomputed = measured[False], measured[True]
    assert recomputed["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    for g, h in zip(plain["grads"] + plain["params"], recomputed["grads"] + recomputed["params"]):
        torch.testing.assert_close(h, g, rtol=1e-5, atol=1e-7)
    ratio = plain["activations"] / recomputed["activations"]
    assert ratio > 8, f"checkpointing 4 blocks should save about a tenth of the activations, saved 1/{ratio:.1f}"


def test_saved_activations_count_a_storage_once_and_skip_parameters():
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with saved_activation_bytes(layer) as saved:
        product = x[:2] * x[1:]  # mul saves two overlapping views of x's one storage
        y = layer(product)  # linear saves its input and its own weight
    assert sum(saved.values()) == x.nbytes + product.nbytes, (
        "count x's whole storage once (two views keep it alive), the product once, and not the weight"
    )
    y.sum().backward()


@pytest.mark.parametrize("precision, param_bytes, grad_bytes, optimizer_bytes", [("fp32", 4, 4, 8), ("bf16", 2, 2, 12)])
def test_memory_agrees_with_the_zero_calculator(precision, param_bytes, grad_bytes, optimizer_bytes):
    report = memory_report(batch=2, seq_len=32)
    n_tensors = len(list(tiny_model().parameters()))
    for checkpoint in (False, True):
        figures = report[precision + ("+checkpoint" if checkpoint else "")]
        n = figures["num_parameters"]
        expected = zero_memory_per_device(
            n, 1, 0, param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes
        )
        step_counts = 4 * n_tensors  # AdamW's one fp32 step count per parameter tensor
        assert figures["parameters"] == param_bytes * n and figures["gradients"] == grad_bytes * n
        assert figures["parameters"] + figures["gradients"] + figures["optimizer"] == expected + step_counts
        assert figures["bytes_per_parameter"] == pytest.approx(16, abs=1e-3)
        assert figures["peak"] == (
            figures["parameters"] + figures["gradients"] + figures["optimizer"] + figures["activations"]
        )
    assert report[precision + "+checkpoint"]["activations"] * 4 < report[precision]["activations"]


def test_a_short_run_lowers_the_loss():
    losses = train(40, batch=8, seq_len=64, lr=3e-3, seed=0)
    assert len(losses) == 40
    assert losses[0] > 5.2, f"a fresh model starts near ln(256) = 5.55, got {losses[0]:.2f}"
    assert sum(losses[-5:]) / 5 < 3.6, f"40 steps should bring the loss under 3.6, got {losses[-5:]}"


def test_errors_say_what_to_fix(batches):
    inputs, targets = batches[0]
    model = tiny_model()
    optimizer = make_optimizer(model, "fp32")
    with pytest.raises(ValueError, match="precision must be one of"):
        train_step(model, optimizer, inputs, targets, precision="fp16")
    with pytest.raises(ValueError, match="precision must be one of"):
        make_optimizer(model, "float32")
    with pytest.raises(ValueError, match=r"\[batch, seq_len\].*\[4, 64\] and \[4, 63\]"):
        train_step(model, optimizer, inputs, targets[:, 1:])
    with pytest.raises(ValueError, match="int64 token ids"):
        train_step(model, optimizer, inputs, targets + 256)
    with pytest.raises(ValueError, match="needs a torch.bfloat16 model"):
        train_step(model, optimizer, inputs, targets, precision="bf16")
    make_optimizer(model, "bf16")
    with pytest.raises(ValueError, match="needs an fp32 model"):
        make_optimizer(model, "bf16")
    with pytest.raises(ValueError, match="does not match the optimizer AdamW"):
        train_step(model, optimizer, inputs, targets, precision="bf16")
    with pytest.raises(ValueError, match="needs seq_len \\+ 1 = 11 tokens"):
        next(text_batches(torch.arange(10), batch=1, seq_len=10))
