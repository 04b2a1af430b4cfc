"""Checks for lab 07 (the block pool): seeded sequences of allocate / free / fork / prepare_write
calls replayed on the learner's pool and on the reference, compared step by step (what each call
returned or raised, the free count and every block's reference count); then the learner's pool
behind a paged KV cache, serving a small random model and SmolLM2 with forked sequences."""

from grading.registry import register_shortcuts

from . import (  # noqa: F401  (each task's module registers its checks, in task order)
    task1_allocate,
    task2_free,
    task3_fork,
    task4_copy_on_write,
    task4_in_a_model,
)

# The reference pool: an answer importing it is not run, and a call into any of its methods
# while a check drives the learner's pool is a shortcut. `pool_replay.new_pool` also refuses a pool built on it.
register_shortcuts("lab07", ["infra_lib.serving.block_pool:BlockPool"])
