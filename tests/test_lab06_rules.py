"""Lab 06's stated rules that a check must hold: each answer below is the instructor's with one rule of
the lab's text broken; the check that holds the rule fails it with a message naming the rule, and the
instructor's answer passes."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import REPO, answer_cells, check_fails, solution_namespace

from grading import check
from grading.check import INTERACTIVE_SEED
from grading.checks.lab06.task1_rms_norm import MEAN_HINT, NO_EPS_HINT
from grading.checks.lab06.task2_rope import INTERLEAVED_HINT
from grading.checks.lab06.task3_llama import GQA_HINT, TIED_HINT
from grading.checks.lab06.task6_cached_attention import MODEL_FIRST_HINT
from grading.checks.lab06.task7_greedy_decode import NO_GRAD_HINT, PREFILL_ONCE_HINT, TIE_HINT
from grading.registry import get_check

SOLUTION = REPO / "solutions" / "lab06_kv_cache" / "lab06_kv_cache.ipynb"


def _edited(cell: str, name: str, *edits: tuple[str, str]):
    """``name`` from the instructor's answer cell ``cell`` with lines of its source replaced (each edit must apply
    once)."""
    source = answer_cells(SOLUTION)[cell]
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {"torch": torch, "math": math}
    exec(source, namespace)
    return namespace[name]


def _greedy_decode(*edits: tuple[str, str]):
    """The instructor's greedy_decode with lines of its source replaced."""
    return _edited("task7_greedy_decode", "greedy_decode", *edits)


@pytest.fixture(scope="module")
def answers() -> dict:
    return solution_namespace(SOLUTION, torch=torch, math=math)


def test_the_instructor_answers_pass_the_checks_that_hold_these_rules(answers):
    for check_id in ("lab06.rms_norm", "lab06.rms_norm_edges"):
        check(check_id, answers["rms_norm"])
    for check_id in ("lab06.rope", "lab06.rope_any_positions"):
        check(check_id, answers["rope"])
    for check_id in ("lab06.llama_tiny", "lab06.llama_configs"):
        check(check_id, answers["Llama"])
    check(
        "lab06.cached_attention_in_model", {"Llama": answers["Llama"], "cached_attention": answers["cached_attention"]}
    )
    check("lab06.repeat_kv", answers["repeat_kv"])
    check("lab06.greedy_decode", answers["greedy_decode"])
    check("lab06.greedy_decode_stop", answers["greedy_decode"])


def test_copies_made_in_the_default_dtype_fail_the_rule_that_repeat_kv_keeps_xs_dtype(answers):
    def float32_copies(x, group):
        out = torch.empty(x.shape[0], x.shape[1] * group, *x.shape[2:])  # torch's default dtype, not x's
        out.copy_(answers["repeat_kv"](x, group))
        return out

    message = check_fails("lab06.repeat_kv", float32_copies)
    assert "repeat_kv changed the dtype of the keys and values" in message, message
    assert "expected dtype bfloat16, got float32" in message and "and dtype bfloat16" in message


def test_a_prompt_fed_a_token_at_a_time_fails_the_rule_that_it_is_prefilled_once():
    token_by_token = _greedy_decode(
        (
            "        logits = model(torch.tensor([prompt]), cache, last_only=True)\n",
            "        for token in prompt:\n"
            "            logits = model(torch.tensor([[token]]), cache, last_only=True)\n",
        )
    )
    message = check_fails("lab06.greedy_decode", token_by_token)
    assert "greedy_decode called the model another number of times than a cached loop needs" in message, message
    assert f"hint: {PREFILL_ONCE_HINT}" in message


def test_a_loop_that_records_gradients_fails_the_rule_to_run_under_inference_mode():
    with_grad = _greedy_decode(("    with torch.inference_mode():\n", "    if True:\n"))
    message = check_fails("lab06.greedy_decode", with_grad)
    assert "greedy_decode ran the model with gradient recording on" in message, message
    assert f"hint: {NO_GRAD_HINT}" in message


def test_the_highest_id_on_a_tie_fails_the_rule_that_greedy_takes_the_lowest():
    highest_on_tie = _greedy_decode(
        (
            "            token = int(logits[0, -1].argmax())\n",
            "            token = sorted(range(logits.shape[-1]), key=lambda i: float(logits[0, -1, i]))[-1]\n",
        )
    )
    check("lab06.greedy_decode", highest_on_tie)  # without ties it is greedy decoding
    message = check_fails("lab06.greedy_decode_stop", highest_on_tie)
    assert "greedy_decode produced different tokens where two logits tie for the highest" in message, message
    assert f"hint: {TIE_HINT}" in message


def test_decode_steps_in_a_fresh_cache_fail_the_rule_that_each_call_continues_the_cached_sequence():
    fresh_cache = _greedy_decode(
        (
            "            logits = model(torch.tensor([[token]]), cache, last_only=True)\n",
            "            logits = model(torch.tensor([[token]]), DenseKVCache.for_model(model.config, capacity=4), "
            "last_only=True)\n",
        )
    )
    message = check_fails("lab06.greedy_decode", fresh_cache)
    assert "greedy_decode fed the model a sequence that does not continue the prompt" in message, message
    assert "model call 2 put token" in message and "at position 0, where the prompt holds" in message
    assert "hint: each call's tokens continue the sequence its cache holds" in message
    assert "(a fresh cache, or none, starts again at position 0)" in message


def test_a_loop_past_max_new_tokens_is_named_where_it_left_the_greedy_answer():
    too_long = _greedy_decode(("len(generated) == max_new_tokens:", "len(generated) == max_new_tokens + 2:"))
    message = check_fails("lab06.greedy_decode", too_long)
    assert "greedy_decode generated more tokens than max_new_tokens" in message, message
    case = get_check("lab06.greedy_decode").inputs(INTERACTIVE_SEED)
    assert f"fed back new token {case['new_tokens'] + 1}" in message


def test_a_wrong_choice_is_named_at_the_first_token_that_differs():
    least_likely = _greedy_decode(("token = int(logits[0, -1].argmax())", "token = int(logits[0, -1].argmin())"))
    message = check_fails("lab06.greedy_decode", least_likely)
    assert "greedy_decode produced different tokens\n" in message, message
    assert "the first 0 tokens agree, then new token 1, fed back to the model in call 2" in message


def test_the_decode_checks_run_no_model_in_the_learners_kernel(answers, monkeypatch):
    """The stand-in model answers from the reference's greedy path recorded when the inputs are made: the learner's
    side runs neither the decoder nor any attention (in the sandbox the reference's attention is a stub)."""
    from grading.check import drive
    from infra_lib.model.model import Llama

    for check_id in ("lab06.greedy_decode", "lab06.greedy_decode_stop"):
        registered = get_check(check_id)
        inputs = registered.inputs(INTERACTIVE_SEED)
        expected = drive(registered, registered.reference(), inputs)
        with monkeypatch.context() as patch:
            patch.setattr(Llama, "forward", lambda *args, **kwargs: pytest.fail("the learner's side ran the decoder"))
            learner = drive(registered, answers["greedy_decode"], inputs)
        assert learner.data == expected.data
        for record, result in zip(inputs["records"], learner.data):
            prompt_length = result["prompt_length"]
            assert result["tokens"] == record["path"][prompt_length : prompt_length + len(result["tokens"])]
            if record["stop_id"] is not None:
                assert result["tokens"][-1] == record["stop_id"]


def test_the_recorded_path_is_the_decoders_own_greedy_answer():
    from grading.checks.lab06 import tiny_model
    from infra_lib.model.generation import greedy_decode

    case = get_check("lab06.greedy_decode").inputs(3)
    for prompt, record in zip(case["prompts"], case["records"]):
        assert record["path"] == prompt + greedy_decode(tiny_model(case["seed"]), prompt, case["new_tokens"] + 1)
        assert len(record["logits"]) == len(record["path"]) - 1


# --- tasks 1 to 3: the model ------------------------------------------------------------------------------------

_INTERLEAVED = (
    "    first, second = x[..., :half], x[..., half:]\n",
    "    first, second = x[..., 0::2], x[..., 1::2]  # neighbours as pairs\n",
)


@pytest.mark.parametrize(
    "edits, check_id, what, hint",
    [
        pytest.param(
            [("torch.sqrt(mean_square + eps)", "torch.sqrt(mean_square)")],
            "lab06.rms_norm_edges",
            "rms_norm's output differs",
            NO_EPS_HINT,
            id="no-eps",
        ),
        pytest.param(
            [("    mean_square =", "    x = x - x.mean(dim=-1, keepdim=True)\n    mean_square =")],
            "lab06.rms_norm",
            "rms_norm's output differs",
            MEAN_HINT,
            id="mean-subtracted",
        ),
        pytest.param(
            [
                _INTERLEAVED,
                (
                    "torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)",
                    "torch.stack([first * cos - second * sin, second * cos + first * sin], dim=-1).flatten(-2)",
                ),
            ],
            "lab06.rope",
            "rope's output differs",
            INTERLEAVED_HINT,
            id="interleaved-pairs",
        ),
    ],
)
def test_a_slip_in_the_norm_or_rope_function_fails_its_task_with_its_own_hint(edits, check_id, what, hint):
    cell, name = ("task1_rms_norm", "rms_norm") if check_id.startswith("lab06.rms") else ("task2_rope", "rope")
    message = check_fails(check_id, _edited(cell, name, *edits))
    assert what in message, message
    assert f"hint: {hint}" in message, message


_STACKED = "return torch.stack([first * cos - second * sin, second * cos + first * sin], dim=-1).flatten(-2)\n"
_LLAMA_SLIPS = {
    "no-eps": ([("+ self.eps)", ")")], "your model's layers[0].input_layernorm(x) differs from RMSNorm", NO_EPS_HINT),
    "mean-subtracted": (
        [
            (
                "        return x * torch.rsqrt(",
                "        x = x - x.mean(dim=-1, keepdim=True)\n        return x * torch.rsqrt(",
            )
        ],
        "your model's layers[0].input_layernorm(x) differs from RMSNorm",
        MEAN_HINT,
    ),
    "interleaved-pairs": (
        [
            (
                "        first, second = x[..., :half], x[..., half:]\n",
                "        first, second = x[..., 0::2], x[..., 1::2]\n",
            ),
            ("return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)\n", _STACKED),
        ],
        "your model's rope(x, positions) differs",
        INTERLEAVED_HINT,
    ),
    "tiled-kv-heads": (
        [
            (
                "k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)",
                "k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)",
            )
        ],
        "your model's logits differ",
        GQA_HINT,
    ),
    "untied": (
        [("            self.lm_head.weight = self.embed_tokens.weight\n", "            pass\n")],
        "your model's logits do not follow its embedding table",
        TIED_HINT,
    ),
}


@pytest.mark.parametrize("slip", list(_LLAMA_SLIPS))
def test_a_slip_in_the_model_fails_task_3_with_its_own_hint(slip, answers):
    """Each usual slip is named with its own hint; the model's own attention and tying play no part in task 6's
    check inside the model, while its norms and rope do (that check then names task 3 as the cause)."""
    edits, what, hint = _LLAMA_SLIPS[slip]
    llama = _edited("task3_llama", "Llama", *edits)
    message = check_fails("lab06.llama_tiny", llama)
    assert what in message, message
    assert f"hint: {hint}" in message, message
    in_model = {"Llama": llama, "cached_attention": answers["cached_attention"]}
    if slip in ("tiled-kv-heads", "untied"):
        check("lab06.cached_attention_in_model", in_model)
    elif slip != "no-eps":  # eps 1e-5 is far below the small model's activations inside the decoder
        message = check_fails("lab06.cached_attention_in_model", in_model)
        assert "your Llama (task 3) gives other logits than the course's model" in message, message
        assert f"hint: {MODEL_FIRST_HINT}" in message


def test_a_model_with_other_parameter_names_is_told_which(answers):
    renamed = _edited(
        "task3_llama",
        "Llama",
        ("        self.norm = RMSNorm(", "        self.final_norm = RMSNorm("),
        ("self.lm_head(self.norm(x))", "self.lm_head(self.final_norm(x))"),
    )
    message = check_fails("lab06.llama_tiny", renamed)
    assert "your Llama's parameters are not the contract's" in message, message
    assert "missing ['norm.weight']" in message and "not in the contract ['final_norm.weight']" in message


def test_the_model_checks_never_build_the_course_model_in_the_learners_kernel(answers, monkeypatch):
    """The course's Llama is task 3's reference, a stub in the graded sandbox and a shortcut under the call monitor:
    the learner's side of every check that runs a decoder builds the learner's class from weights instead."""
    from grading.check import drive
    from infra_lib.model.model import Llama

    pieces = {"Llama": answers["Llama"], "cached_attention": answers["cached_attention"]}
    for check_id, implementation in (
        ("lab06.llama_tiny", answers["Llama"]),
        ("lab06.llama_configs", answers["Llama"]),
        ("lab06.cached_attention_in_model", pieces),
    ):
        registered = get_check(check_id)
        inputs = registered.inputs(INTERACTIVE_SEED)
        with monkeypatch.context() as patch:
            patch.setattr(Llama, "__init__", lambda *args, **kwargs: pytest.fail("the learner's side built Llama"))
            learner = drive(registered, implementation, inputs)
        assert learner.error is None, learner.error
