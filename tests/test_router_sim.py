"""The routing simulator: a prefix-aware policy keeps the cache warm where round robin and least-loaded do not,
no policy beats one cache holding everything, the load bound keeps a hot prefix from pinning one replica, a
replica that dies is never chosen again and its requests are served elsewhere, and a run is the same every time."""

from __future__ import annotations

import pytest

from infra_lib.ops.router_sim import (
    InvalidChoice,
    ServiceModel,
    simulate_routing,
    token_chat_workload,
)
from infra_lib.serving.router import LeastLoadedPolicy, PrefixAwarePolicy, RoundRobinPolicy, live_replicas


def shared(seed: int = 1, systems: int = 3):
    return token_chat_workload(36, 4, seed=seed, num_system_prompts=systems)


class Recording(PrefixAwarePolicy):
    """The course's prefix policy, noting the loads it saw and what it chose, and the replicas it was told to forget."""

    def __init__(self, **options):
        super().__init__(**options)
        self.seen: list[tuple[list, int]] = []
        self.forgotten: list[int] = []

    def choose(self, request_hashes, replica_loads):
        chosen = super().choose(request_hashes, replica_loads)
        self.seen.append((list(replica_loads), chosen))
        return chosen

    def forget(self, replica):
        self.forgotten.append(replica)
        super().forget(replica)


class Pinning(PrefixAwarePolicy):
    """Longest match with no load bound: what the bound is there to prevent."""

    def choose(self, request_hashes, replica_loads):
        live = live_replicas(replica_loads)
        return min(live, key=lambda i: (-self.match_length(request_hashes, i), replica_loads[i], i))


@pytest.mark.parametrize("seed", [1, 7, 11])
def test_the_prefix_policy_hits_the_cache_far_more_than_round_robin_and_least_loaded(seed):
    conversations = shared(seed)
    runs = {
        policy.name: simulate_routing(policy, conversations, 4, concurrency=12, seed=seed)
        for policy in (RoundRobinPolicy(), LeastLoadedPolicy(), PrefixAwarePolicy())
    }
    prefix = runs["prefix"]
    assert prefix.hit_rate > runs["round-robin"].hit_rate + 0.1
    assert prefix.hit_rate > runs["least-loaded"].hit_rate + 0.05
    for run in runs.values():  # no policy beats one cache that holds every block ever sent
        assert 0 < run.hit_rate <= run.ideal_hit_rate <= 1
        assert run.requests == 36 * 4 == sum(run.requests_per_replica)
        assert run.ideal_hit_blocks == prefix.ideal_hit_blocks  # the bound depends on the traffic, not the policy


def test_a_run_is_the_same_every_time_and_its_seeds_change_it():
    conversations = shared()
    first = simulate_routing(PrefixAwarePolicy(), conversations, 4, concurrency=12, seed=3)
    assert simulate_routing(PrefixAwarePolicy(), conversations, 4, concurrency=12, seed=3) == first
    assert simulate_routing(PrefixAwarePolicy(), conversations, 4, concurrency=12, seed=4).choices != first.choices
    assert token_chat_workload(36, 4, seed=1) == conversations != token_chat_workload(36, 4, seed=2)


def test_the_load_bound_keeps_a_hot_prefix_from_pinning_one_replica():
    """Every request starts with the same system prompt: without the bound every one goes where it was first sent."""
    hot = shared(seed=5, systems=1)
    policy = Recording(slack=0.5)
    run = simulate_routing(policy, hot, 4, concurrency=12, seed=5)
    for loads, chosen in policy.seen:  # each choice was within (1 + slack) x the mean load
        assert loads[chosen] <= 1.5 * sum(loads) / len(loads)
    assert run.max_share <= 1.5 / 4 + 0.05
    assert max(run.peak_loads) > 1, "the loads must rise above one for the bound to matter"
    pinned = simulate_routing(Pinning(), hot, 4, concurrency=12, seed=5)
    assert pinned.max_share == 1.0 and pinned.hit_rate >= run.hit_rate


def test_a_replica_that_dies_is_forgotten_never_chosen_again_and_its_requests_are_sent_again():
    policy = Recording()
    run = simulate_routing(policy, shared(seed=2), 4, concurrency=12, failures={1: 1500.0}, seed=2)
    assert policy.forgotten == [1]
    died = next(i for i, (loads, _) in enumerate(policy.seen) if loads[1] is None)
    assert died > 0 and all(loads[1] is None and chosen != 1 for loads, chosen in policy.seen[died:])
    assert run.retried > 0 and run.requests == 36 * 4 + run.retried
    assert run.requests_per_replica[1] == sum(chosen == 1 for _, chosen in policy.seen[:died]) > 0


def test_a_choice_out_of_rotation_or_not_an_index_is_refused_by_name():
    class Stubborn(RoundRobinPolicy):
        def choose(self, request_hashes, replica_loads):
            return 1

    with pytest.raises(InvalidChoice, match=r"Stubborn.choose returned 1 .*\[0, None, 0\]"):
        simulate_routing(Stubborn(), shared(), 3, failures={1: 10.0})

    class Loose(RoundRobinPolicy):
        def choose(self, request_hashes, replica_loads):
            return "0"

    with pytest.raises(InvalidChoice, match="returned '0'"):
        simulate_routing(Loose(), shared(), 2)


def test_the_cache_capacity_decides_what_can_hit():
    conversations = shared()
    assert simulate_routing(PrefixAwarePolicy(), conversations, 2, cache_blocks=0).hit_blocks == 0
    one = simulate_routing(RoundRobinPolicy(), conversations, 1, cache_blocks=10**6)
    assert one.hit_blocks == one.ideal_hit_blocks > 0  # one replica that forgets nothing holds everything


def test_the_workload_extends_each_turn_and_shares_its_system_prompts():
    conversations = token_chat_workload(
        6, 3, seed=0, num_system_prompts=2, system_tokens=20, user_tokens=(2, 4), reply_tokens=(5, 5), vocab_size=50
    )
    for c, turns in enumerate(conversations):
        assert turns[0][:20] == conversations[c % 2][0][:20]
        for earlier, later in zip(turns, turns[1:]):
            assert later[: len(earlier)] == earlier and 2 + 5 <= len(later) - len(earlier) <= 4 + 5
        assert all(0 <= token < 50 for token in turns[-1])
    assert conversations[0][0][:20] != conversations[1][0][:20]
    for bad in (dict(num_conversations=0, turns=1), dict(num_conversations=1, turns=1, user_tokens=(3, 2))):
        with pytest.raises(ValueError):
            token_chat_workload(**bad)


def test_service_time_grows_with_the_missed_prompt_and_the_replicas_load():
    model = ServiceModel(prefill_per_token=1.0, decode_per_token=10.0, output_tokens=4, per_outstanding=0.5)
    assert model.time(missed_tokens=20, outstanding=0) == 60.0
    assert model.time(missed_tokens=20, outstanding=2) == 120.0
    with pytest.raises(ValueError, match="ServiceModel"):
        ServiceModel(per_outstanding=-1)
    with pytest.raises(ValueError, match="leave one alive"):
        simulate_routing(PrefixAwarePolicy(), shared(), 2, failures={0: 1.0, 1: 2.0})
