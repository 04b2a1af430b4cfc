"""Checks for lab 18 (training at scale that survives failure): the ring-attention step and its ring (the backward
as a bonus), the checkpoint and resume of a training loop graded by killing the process that runs it, and the LoRA
linear layer with its merge and unmerge.

The ring's ranks are threads of the kernel exchanging tensors through a recording comm, so that its traffic is
counted and a deadlock is named at once. The training loop's ranks are processes forked from the kernel (two at
most), joined through a file store; one is killed with SIGKILL at a seeded step and the job resumes from the
learner's checkpoint.
"""

from __future__ import annotations

from grading.registry import register_shortcuts

register_shortcuts(
    "lab18",
    [
        "infra_lib.training.context_parallel:ring_attention_step",
        "infra_lib.training.context_parallel:ring_attention",
        "infra_lib.training.context_parallel:ring_attention_forward",
        "infra_lib.training.context_parallel:ring_attention_backward",
        "infra_lib.training.context_parallel:RingAttention",
        "infra_lib.training.context_parallel:finish_state",
        "infra_lib.training.context_parallel:empty_state",
        "infra_lib.training.context_parallel:block_kind",
        "infra_lib.training.context_parallel:block_pairs",
        "infra_lib.training.context_parallel:ulysses_attention",
        "infra_lib.training.elastic:save_checkpoint",
        "infra_lib.training.elastic:load_checkpoint",
        "infra_lib.model.lora:LoRALinear",
        "infra_lib.serving.multi_lora:MultiLoRALinear",
    ],
)

from . import (  # noqa: E402,F401  (each task's module registers its checks, in task order)
    task1_ring,
    task2_resume,
    task3_lora,
)
