"""Checks for lab 05 (the learner's trainer): a reverse-mode autograd engine (``Value`` and its
``backward``), the ops a Llama needs with their backward, ``adamw_update``, and a training check in
which the learner's whole namespace trains a tiny Llama next to torch.autograd and torch's AdamW;
then ``shard_bounds`` (which part of a tensor a rank owns), ``ring_all_reduce(tensor, comm)`` over
point-to-point ``comm.exchange``, ``DDP`` (buckets all-reduced from gradient hooks) and a ZeRO
stage-1 step (``reduce_scatter``, ``all_gather``, ``ZeroAdamW``).

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

# The course's Value is the learner's task 1: stubbed in the graded kernel, so every library op (each builds
# a Value) is out of reach too. The op functions are not listed: their names (exp, add, matmul) are ordinary words
# in any tensor code. The plumbing and train_tiny are the stack the training check runs the learner's code in.
register_shortcuts(
    "lab05",
    [
        "infra_lib.training.zero:shard_bounds",
        "infra_lib.training.collectives:ring_all_reduce",
        "infra_lib.training.autograd:Value",
        "infra_lib.training.scratch_train:adamw_update",
        "infra_lib.training.ddp:DDP",
        "infra_lib.training.ddp:gradient_buckets",
        "infra_lib.training.zero:reduce_scatter",
        "infra_lib.training.zero:all_gather",
        "infra_lib.training.zero:ZeroAdamW",
    ],
)

from . import (  # noqa: E402,F401  (register the checks)
    adamw_update,
    autograd_engine,
    autograd_ops,
    ddp,
    ring_all_reduce,
    shard_bounds,
    training_run,
    zero_step,
)
from .process_group import answer_source, run_on_process_group  # noqa: E402,F401  (the lab's last cell imports them)
