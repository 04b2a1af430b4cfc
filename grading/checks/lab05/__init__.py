"""Checks for lab 05 (training from scratch, then parallelism): the learner writes the ZeRO memory
calculator ``zero_memory_per_device``, ``shard_bounds`` (which part of a tensor a rank owns),
``ring_all_reduce(tensor, comm)`` over point-to-point ``comm.exchange``, and the pieces under one
training step: ``softmax_backward``, ``rms_norm_backward`` and ``adamw_update``, which a last check
plugs into the course's autograd to train a tiny Llama next to the reference pieces.

The ring is run on a ``ThreadGroup``: every rank a thread of the learner's kernel, exchanging
tensors through queues, so a check needs no process (the grader's kernel limits them, and a
function defined in a notebook cannot be sent to a spawned one) and counts the bytes each rank
sent. Each case runs the learner's function on seeded tensors of 1 to 8 ranks; every rank's
tensor must then hold the sum over the ranks (in place, what ``dist.all_reduce`` gives), and on
sizes the world size divides every rank must have sent 2 (W - 1) / W of the tensor. A rank that
raises, or waits for a message no rank sent, stops the case with a time-out that names the
ranks; the remaining cases are skipped so that a check stays short.

``run_on_process_group`` runs the learner's answer cells on a real gloo process group, for the
lab's last cell: the answers travel as source text and each worker executes them.
"""

from __future__ import annotations

from grading.registry import register_shortcuts

# The autograd's ops and ``train_tiny`` are the stack the last check runs the learner's pieces in: they
# are no reference, and stay whole in the graded kernel; only the three formulas are stubbed there.
register_shortcuts(
    "lab05",
    [
        "infra_lib.training.zero:zero_memory_per_device",
        "infra_lib.training.zero:zero_table",
        "infra_lib.training.zero:shard_bounds",
        "infra_lib.training.collectives:ring_all_reduce",
        "infra_lib.training.autograd:softmax_backward",
        "infra_lib.training.autograd:rms_norm_backward",
        "infra_lib.training.scratch_train:adamw_update",
    ],
)

from . import (  # noqa: E402,F401  (register the checks)
    task1_zero_memory,
    task2_shard_bounds,
    task3_ring_all_reduce,
    task4_softmax_backward,
    task5_rms_norm_backward,
    task6_adamw_update,
    training_run,
)
from .process_group import answer_source, run_on_process_group  # noqa: E402,F401  (the lab's last cell imports them)
