"""Checks for lab 07 (the block pool): seeded sequences of allocate / free / fork / prepare_write
calls replayed on the learner's pool and on the reference, compared step by step (what each call
returned or raised, the free count and every block's reference count); then the learner's pool
behind a paged KV cache, serving a small random model and SmolLM2 with forked sequences; and the
batched step over the paged store on plans the course's scheduler makes."""

from grading.registry import register_shortcuts

from . import (  # noqa: F401  (each task's module registers its checks, in task order)
    task1_allocate,
    task2_free,
    task3_fork,
    task4_copy_on_write,
    task4_in_a_model,
    task5_forward_step,
)

# The reference pool and the reference step: an answer importing either is not run, and a call into any of
# their methods while a check drives the learner's pool or step is a shortcut. `pool_replay.new_pool` also
# refuses a pool built on the reference's. The step's inputs (the scheduler's plans, made with the course's
# pool) are made by the grader, outside the graded kernel.
register_shortcuts("lab07", ["infra_lib.serving.block_pool:BlockPool", "infra_lib.serving.model_runner:ModelRunner"])
