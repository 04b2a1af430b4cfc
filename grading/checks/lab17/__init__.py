"""Checks for lab 17 (serving beyond one engine): a prefix-cache-aware router under a load bound, the two halves
of prefill/decode disaggregation's KV handoff, a tensor-parallel MLP and the top-k gate of a mixture of experts.

The router is driven two ways: through scripted and random calls whose every choice is compared with the course's
policy, and on seeded chat workloads in the routing simulator (``infra_lib.ops.router_sim``), where its prefix-cache
hit rate and its balance are compared with the course's. The handoff's halves are checked on seeded paged stores
and pools, then together between a prefill engine and a decode engine on the small random decoder. The MLP's ranks
are threads of the kernel sharing a real summing all-reduce. ``run_tp_mlp_on_process_group`` runs the learner's
MLP split on a real gloo group for the lab's last cells.
"""

from __future__ import annotations

from grading.registry import register_shortcuts

register_shortcuts(
    "lab17",
    [
        "infra_lib.serving.router:PrefixAwarePolicy",
        "infra_lib.serving.router:LeastLoadedPolicy",
        "infra_lib.serving.router:RoundRobinPolicy",
        "infra_lib.serving.disaggregated:pack_kv",
        "infra_lib.serving.disaggregated:install_kv",
        "infra_lib.serving.tensor_parallel_decode:shard_mlp",
        "infra_lib.serving.tensor_parallel_decode:tp_mlp_forward",
        "infra_lib.serving.moe:top_k_gating",
    ],
)

from . import (  # noqa: E402,F401  (each task's module registers its checks, in task order)
    task1_router_rules,
    task1_router_workloads,
    task2_pack_kv,
    task3_in_engines,
    task3_install_kv,
    task4_tp_mlp,
    task5_gating,
)
from .process_group import run_tp_mlp_on_process_group  # noqa: E402,F401  (the lab's last cell imports it)
