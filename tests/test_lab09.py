"""Lab 09's checks name the classic mistakes of group-wise quantisation and of the speculative
acceptance rule; the statistical check passes a correct rule that draws its random numbers its own
way and rejects a rule whose output is not distributed as the target."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import REPO, check_fails, solution_namespace

from grading import check
from grading.check import RECORD_ENV, SEED_ENV
from grading.registry import all_checks

SOLUTION = REPO / "solutions" / "lab09_spec_quant" / "lab09_spec_quant.ipynb"


@pytest.fixture(scope="module")
def solution() -> dict:
    """The instructor's answers, run as the notebook runs them (setup first, then every answer cell)."""
    import math

    return solution_namespace(SOLUTION, torch=torch, math=math)


_fails = check_fails


# --- tasks 1 and 2: quantisation ----------------------------------------------------------------------


def _quantize(
    *,
    scale_of=lambda groups: groups.abs().amax(-1) / 127,
    rounding=torch.round,
    validate=True,
    refuse_non_finite=True,
    refuse_bool=True,
):
    def quantize(w, group_size):
        if validate and (
            not isinstance(w, torch.Tensor)
            or w.dim() != 2
            or not w.is_floating_point()
            or type(group_size) not in (int, bool)
            or group_size < 1
            or w.shape[1] % group_size
        ):
            raise ValueError("invalid weight or group size")
        if refuse_non_finite and isinstance(w, torch.Tensor) and not torch.isfinite(w).all():
            raise ValueError("w holds nan or inf")
        if refuse_bool and isinstance(group_size, bool):
            raise ValueError("a bool is no group size")
        groups = w.float().reshape(w.shape[0], -1, group_size)
        scales = scale_of(groups)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.clamp(rounding(groups / safe[..., None]), -127, 127).to(torch.int8)
        return q.reshape(w.shape), scales

    return quantize


def test_task1_half_up_rounding_and_multiplying_by_the_inverse_scale_pass():
    def half_up(w, group_size):
        if (
            type(group_size) is not int
            or group_size < 1
            or not isinstance(w, torch.Tensor)
            or w.dim() != 2
            or not w.is_floating_point()
            or w.shape[1] % group_size
            or not torch.isfinite(w).all()
        ):
            raise ValueError("invalid")
        groups = w.float().reshape(w.shape[0], -1, group_size)
        amax = groups.abs().amax(-1)
        inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        q = torch.floor(groups * inverse[..., None] + 0.5).clamp(-127, 127).to(torch.int8)
        return q.reshape(w.shape), amax / 127

    for check_id in ("lab09.quantize_int8", "lab09.quantize_int8_edges", "lab09.quantize_int8_llm_rows"):
        check(check_id, half_up)


def test_task1_truncation_and_a_missing_division_are_named():
    text = _fails("lab09.quantize_int8", _quantize(rounding=lambda x: x))  # .to(torch.int8) truncates
    assert "wrong int8 values" in text and "cut toward zero" in text and "w / scale =" in text
    text = _fails("lab09.quantize_int8", _quantize(scale_of=lambda g: g.abs().amax(-1)))
    assert "wrong scales" in text and "divide by 127" in text


@pytest.mark.parametrize(
    "scale_of, named",
    [
        (lambda g: g.abs().amax(-1) / 128, "you divided by 128"),
        (lambda g: g.amax(-1) / 127, "ABSOLUTE value"),
        (lambda g: g.abs().amax(dim=(-1, -2), keepdim=True).squeeze(-1).expand(g.shape[:2]) / 127, "one scale per row"),
    ],
)
def test_task1_wrong_scales_are_named(scale_of, named):
    assert named in _fails("lab09.quantize_int8_llm_rows", _quantize(scale_of=scale_of))


def test_task1_invalid_weights_must_raise_value_error():
    text = _fails("lab09.quantize_int8_edges", _quantize(validate=False))
    assert "should raise ValueError on an invalid input" in text and "group_size=48" in text


@pytest.mark.parametrize(
    "refuse_non_finite, refuse_bool, named",
    [
        (False, True, "] = nan), group_size=16: it returned a result"),
        (True, False, "group_size=True: it returned a result"),
    ],
)
def test_task1_non_finite_weights_and_a_bool_group_size_must_raise(refuse_non_finite, refuse_bool, named):
    """The task states both: a weight holding nan or inf, and group_size=True, raise ValueError."""
    text = _fails("lab09.quantize_int8_edges", _quantize(refuse_non_finite=refuse_non_finite, refuse_bool=refuse_bool))
    assert "should raise ValueError on an invalid input" in text and named in text


def test_task2_tiled_scales_and_division_are_named():
    text = _fails("lab09.dequantize_int8", lambda q, s, g: q.float() * s.repeat(1, g))
    assert "tiled" in text and "repeat_interleave" in text
    text = _fails("lab09.dequantize_roundtrip", lambda q, s, g: q.float() / s.repeat_interleave(g, 1))
    assert "you divided by the scale" in text
    text = _fails("lab09.dequantize_roundtrip", lambda q, s, g: q.float() * s.repeat_interleave(g, 1))
    assert "should raise ValueError" in text  # scales of the wrong shape: a broadcast error, not a ValueError


def test_task2_a_q_that_is_not_int8_must_raise():
    def any_dtype(q, scales, group_size):
        if scales.shape != (q.shape[0], q.shape[1] // group_size) or q.shape[1] % group_size:
            raise ValueError("scales do not fit q")
        return q.float() * scales.repeat_interleave(group_size, 1)

    check("lab09.dequantize_int8", any_dtype)
    text = _fails("lab09.dequantize_roundtrip", any_dtype)
    assert "should raise ValueError on an invalid input" in text and "(torch.int32)" in text


# --- task 3 ------------------------------------------------------------------------------------------


def test_task3_gamma_terms_and_a_equal_to_one_are_named():
    text = _fails("lab09.expected_tokens", lambda a, g: (1 - a**g) / (1 - a))
    assert "sums gamma terms" in text
    text = _fails("lab09.expected_tokens_edges", lambda a, g: (1 - a ** (g + 1)) / (1 - a))
    assert "ZeroDivisionError" in text and "E = gamma + 1" in text

    def summed(a, g):
        if not 0 <= a <= 1 or g < 0:
            raise ValueError(a)
        return float(sum(a**i for i in range(g + 1)))

    check("lab09.expected_tokens", summed)
    check("lab09.expected_tokens_edges", summed)


def test_task3_a_negative_gamma_must_raise():
    def closed_form(a, g):
        if not 0 <= a <= 1:
            raise ValueError(a)
        return float(g + 1) if a == 1 else (1 - a ** (g + 1)) / (1 - a)

    check("lab09.expected_tokens", closed_form)
    text = _fails("lab09.expected_tokens_edges", closed_form)
    assert "should raise ValueError on an invalid input" in text and "gamma=-" in text


# --- task 4: the acceptance rule ------------------------------------------------------------------------


def _rule(*, accept="ratio", resample="residual", bonus="p", stop_at_rejection=True, upfront=False, uniform="own"):
    """A rule with one deliberate change from the correct one. ``uniform``: "own" (a draw per judged token
    from the generator), "shared" (one draw for the whole step) or "python" (Python's random module)."""
    import random

    def rule(p, q, draft_tokens, generator=None):
        uniforms = torch.rand(len(draft_tokens), generator=generator) if upfront else None
        shared = float(torch.rand((), generator=generator))
        accepted, replacement = [], None
        for i, x in enumerate(draft_tokens):
            u = {
                "own": lambda: float(uniforms[i]) if upfront else float(torch.rand((), generator=generator)),
                "shared": lambda: shared,
                "python": random.random,
            }[uniform]()
            ratio = float(p[i, x]) / float(q[i, x])
            if {"ratio": u < ratio, "reversed": u > ratio, "swapped": u * ratio < 1}[accept]:  # swapped: u < q / p
                accepted.append(x)
                continue
            residual = torch.clamp(p[i] - q[i], min=0)
            dist = {"residual": residual / residual.sum() if residual.sum() > 0 else p[i], "p": p[i]}[resample]
            replacement = int(torch.multinomial(dist, 1, generator=generator))
            if stop_at_rejection:
                return accepted, replacement
        if replacement is not None:
            return accepted, replacement
        last = len(draft_tokens)
        if bonus == "argmax":
            return accepted, int(p[last].argmax())
        if bonus == "previous":
            return accepted, int(torch.multinomial(p[max(last - 1, 0)], 1, generator=generator))
        return accepted, int(torch.multinomial(p[last], 1, generator=generator))

    return rule


def test_task4_a_correct_rule_with_its_own_random_draws_passes_every_check(solution):
    rule = _rule(upfront=True)  # the same rule, consuming the generator in another order
    for check_id in (
        "lab09.accept_greedy",
        "lab09.accept_distribution",
        "lab09.accept_distribution_more",
        "lab09.accept_own_generator",
        "lab09.speculative_greedy",
    ):
        check(check_id, rule)


def test_task4_a_rule_drawing_from_the_global_generator_fails():
    """It passes every check of what comes out, yet a seeded speculative run is not reproducible."""
    from infra_lib.serving.speculative import accept_or_resample

    def global_draws(p, q, draft_tokens, generator=None):
        return accept_or_resample(p, q, draft_tokens, None)

    check("lab09.accept_distribution", global_draws)
    text = _fails("lab09.accept_own_generator", global_draws)
    assert "drew from torch's global random generator" in text and "not reproducible" in text


def test_task4_a_rule_drawing_from_pythons_random_fails():
    text = _fails("lab09.accept_own_generator", _rule(uniform="python"))
    assert "the same generator seed gave different steps in two runs" in text


def test_task4_the_swapped_ratio_is_named():
    """Keeping a draft token with probability min(1, q/p) is named, not left as a bare chi-square table."""
    text = _fails("lab09.accept_distribution", _rule(accept="swapped"))
    assert "min(1, q(x) / p(x)), the ratio upside down" in text and "chi-square p-value" in text


def test_task4_resampling_from_p_is_caught_statistically_and_named():
    """Drawing the replacement from p instead of max(0, p - q) is invisible on one-hot distributions."""
    rule = _rule(resample="p")
    check("lab09.accept_greedy", rule)
    for check_id in ("lab09.accept_distribution", "lab09.accept_distribution_more"):
        text = _fails(check_id, rule)
        assert "you drew the replacement from p" in text and "max(0, p - q)" in text
        assert "chi-square p-value" in text and "total variation distance" in text and "yours" in text


def test_task4_a_reversed_comparison_fails_every_check():
    rule = _rule(accept="reversed")
    assert "you rejected draft token" in _fails("lab09.accept_greedy", rule)
    assert "u > p(x) / q(x)" in _fails("lab09.accept_distribution", rule)
    text = _fails("lab09.speculative_greedy", rule)
    assert "differs from plain greedy decoding" in text and "must be rejected" in text


def test_task4_continuing_after_a_rejection_is_named():
    rule = _rule(stop_at_rejection=False)
    text = _fails("lab09.accept_distribution", rule)
    assert "not the draft's first tokens" in text and "stop at the first rejection" in text


@pytest.mark.parametrize("bonus, named", [("argmax", "argmax of p[gamma]"), ("previous", "p[gamma - 1]")])
def test_task4_bonus_mistakes_are_named(bonus, named):
    assert named in _fails("lab09.accept_distribution", _rule(bonus=bonus))


def test_task4_a_missing_bonus_token_is_named():
    def no_bonus(p, q, draft_tokens, generator=None):
        accepted, token = _rule()(p, q, draft_tokens, generator)
        return (accepted, None) if len(accepted) == len(draft_tokens) else (accepted, token)

    assert "next_token = None" in _fails("lab09.accept_greedy", no_bonus)
    assert "the bonus token, drawn from p[gamma]" in _fails("lab09.accept_distribution", no_bonus)


def test_chi_square_accepts_the_truth_and_rejects_a_skewed_sample():
    from grading.checks.lab09.rule_distributions import chi_square_p_value

    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    assert chi_square_p_value([500, 300, 200, 0], probs) > 0.99
    assert chi_square_p_value([400, 300, 300, 0], probs) < 1e-6
    assert chi_square_p_value([499, 300, 200, 1], probs) == 0.0  # a token of probability 0 came out


def test_the_acceptance_rule_is_restored_after_the_loop_even_when_the_rule_raises():
    from grading.checks.lab09 import using_acceptance_rule
    from infra_lib.serving import speculative

    original = speculative.accept_or_resample

    def broken(p, q, draft_tokens, generator=None):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), using_acceptance_rule(broken):
        assert speculative.accept_or_resample is broken
        speculative.accept_or_resample(None, None, [], None)
    assert speculative.accept_or_resample is original
    assert "RuntimeError: boom" in _fails("lab09.speculative_greedy", broken)
    assert speculative.accept_or_resample is original


def test_inputs_are_plain_data_and_the_same_for_the_same_seed():
    for check_id, registered in all_checks().items():
        if check_id.startswith("lab09."):
            first = json.dumps(registered.inputs(7), sort_keys=True)
            assert first == json.dumps(registered.inputs(7), sort_keys=True), check_id
            assert first != json.dumps(registered.inputs(8), sort_keys=True), check_id


def test_under_the_grader_honest_answers_record_data_and_the_reference_is_a_shortcut(solution, tmp_path, monkeypatch):
    """The decoder check runs the course's loop, drafts and greedy decoding around the learner's rule:
    none of that counts as a shortcut, while calling the reference rule does."""
    from infra_lib.model.quant import quantize_symmetric
    from infra_lib.serving.speculative import accept_or_resample

    record = tmp_path / "answers.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(record))
    monkeypatch.setenv(SEED_ENV, "11")
    check("lab09.speculative_greedy", solution["accept_or_resample"])
    check("lab09.accept_greedy", solution["accept_or_resample"])
    check("lab09.accept_greedy", lambda p, q, d, g=None: accept_or_resample(p, q, d, g))
    check("lab09.quantize_int8", lambda w, g: quantize_symmetric(w, 8, g))
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [row["kind"] for row in rows] == [None, None, "reference shortcut", "reference shortcut"]


# --- rules each task states, each held by a check --------------------------------------------------------


def test_task1_a_group_size_that_is_no_positive_int_must_raise():
    def quantize(w, group_size):  # checks everything but the group size's type and sign
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point() or not torch.isfinite(w).all():
            raise ValueError("invalid weight")
        if isinstance(group_size, bool) or w.shape[1] % group_size:
            raise ValueError("invalid group size")
        return _quantize(validate=False)(w, int(group_size))

    text = _fails("lab09.quantize_int8_edges", quantize)
    assert "group_size=0: your code raised ZeroDivisionError" in text or "group_size=0: it raised" in text


def test_task2_a_group_size_that_does_not_divide_the_row_must_raise():
    def dequantize(q, scales, group_size):
        if q.dtype != torch.int8 or scales.shape != (q.shape[0], q.shape[1] // group_size):
            raise ValueError("scales do not fit q")
        return q.float()[:, : scales.shape[1] * group_size] * scales.repeat_interleave(group_size, 1)

    text = _fails("lab09.dequantize_roundtrip", dequantize)
    assert "should raise ValueError on an invalid input" in text and "group_size=48" in text


def test_task3_an_int_result_is_not_a_float():
    def exact(a, g):
        if not 0 <= a <= 1 or g < 0:
            raise ValueError(a)
        return g + 1 if a == 1 else (1 - a ** (g + 1)) / (1 - a)  # the int g + 1 at a = 1

    text = _fails("lab09.expected_tokens_edges", exact)
    assert "must return a float" in text and "got the int" in text


def test_task4_tensors_for_token_ids_are_named():
    def tensors(p, q, draft_tokens, generator=None):
        accepted, token = _rule()(p, q, draft_tokens, generator)
        return accepted, torch.tensor(token)

    text = _fails("lab09.accept_greedy", tensors)
    assert "returned next_token as a Tensor" in text and "a Python int is needed" in text


def test_task4_changing_p_in_place_is_named():
    def in_place(p, q, draft_tokens, generator=None):
        result = _rule()(p, q, draft_tokens, generator)
        p.mul_(0.5)
        return result

    text = _fails("lab09.accept_greedy", in_place)
    assert "changed its inputs in place" in text and "p differed after the call" in text


def test_task4_one_uniform_draw_for_every_draft_token_is_caught():
    """Each judged token needs a draw of its own: sharing one couples the acceptances."""
    text = _fails("lab09.accept_distribution", _rule(uniform="shared"))
    assert "one uniform draw decided every draft token of a step" in text and "chi-square p-value" in text


def test_the_checks_compare_with_the_library_functions_themselves_and_the_sandbox_hides_their_rules(tmp_path):
    """The library holds the lab's input rules, so each check's reference is the library function with
    nothing around it; the sandbox's stub of the quantisation module covers the rules' helpers too."""
    import importlib

    from grading.hidden_reference import STUB_MESSAGE, hidden_files, targets
    from grading.registry import shortcut_functions
    from infra_lib.model import quant

    for check_id, registered in all_checks().items():
        if check_id.startswith("lab09."):
            module, name = registered.reference.target.split(":")
            assert registered.reference() is getattr(importlib.import_module(module), name), check_id
    hidden = set(targets("lab09_spec_quant"))
    for name in ("quantize_int8_groupwise", "dequantize_int8_groupwise", "_check_weight", "_check_group_size"):
        assert f"infra_lib.model.quant:{name}" in hidden, name
    assert "infra_lib.serving.speculative:expected_tokens_per_step" in hidden
    called = {(f.__module__, f.__name__) for f in shortcut_functions("lab09")}  # what the call monitor flags
    assert {("infra_lib.model.quant", "_check_weight"), ("infra_lib.model.quant", "_check_group_size")} <= called
    stub = hidden_files("lab09_spec_quant", tmp_path)[Path(quant.__file__).resolve()]
    namespace: dict = {"__name__": "stubbed_quant"}
    exec(compile(stub.read_text(), "quant.py", "exec"), namespace)
    for name, args in (("_check_weight", (torch.randn(2, 8), 4)), ("_check_group_size", (4, 8))):
        message = STUB_MESSAGE.format(name=f"infra_lib.model.quant.{name}", lab="lab09_spec_quant")
        with pytest.raises(RuntimeError, match=re.escape(message)):
            namespace[name](*args)
