"""Checks for lab 09 (speculative decoding and quantisation): the learner writes
``quantize_int8_groupwise``, ``dequantize_int8_groupwise``, ``expected_tokens_per_step`` and the
acceptance rule ``accept_or_resample``.

The quantisation checks compare scales and int8 values on seeded weights (normal values with
outlier channels, all-zero groups, half-precision inputs, invalid arguments); an int8 value may be
one off only where ``w / scale`` sits on a rounding tie. The acceptance rule is checked three ways:
on one-hot (greedy) distributions, where its output is fixed; statistically, by running it thousands
of times on small seeded ``p`` and ``q`` and comparing what it emits with the target's exact
distributions (a chi-square test, and the accepted-length distribution); and plugged into the
course's ``speculative_decode`` on a small random model, whose greedy output must equal plain greedy
decoding. When a statistical check fails, the grader also fits the distributions that the classic
mistakes would produce, and names the mistake that fits.
"""

from grading.checks.lab09.tasks import QUANT, SPEC
from grading.registry import register_shortcuts

from . import (  # noqa: F401  (each task's module registers its checks, in task order)
    task1_quantize,
    task2_dequantize,
    task3_expected_tokens,
    task4_acceptance,
    task4_in_decoding,
    task4_statistics,
    task4_uses_its_generator,
)
from .task4_acceptance import using_acceptance_rule  # noqa: F401  (the lab's notebook uses it)

register_shortcuts(
    "lab09",
    [f"{SPEC}:{name}" for name in ("accept_or_resample", "expected_tokens_per_step", "predicted_speedup")]
    + [
        f"{QUANT}:{name}"
        for name in (
            "quantize_int8_groupwise",
            "dequantize_int8_groupwise",
            "quantize_symmetric",
            "dequantize_symmetric",
            "QuantLinear",
            "quantize_model",
            # the input rules of tasks 1 and 2, which the two above call
            "_check_weight",
            "_check_group_size",
        )
    ],
)
