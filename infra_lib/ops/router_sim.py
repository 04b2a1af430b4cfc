"""Routing policies raced on a simulated fleet: no HTTP, no model, no clock, the same result every run.

A real router (``infra_lib.serving.router``) in front of replicas takes minutes to show what a policy does
to the prefix cache. ``simulate_routing`` shows it in milliseconds: the replicas are reduced to what
routing changes, a prefix cache and a queue of outstanding requests each, and time is a number that
advances from event to event.

    users (closed loop)      each takes the next conversation and sends its turns one after another,
                             a turn ``think_time`` (mean, drawn from the seed) after the previous answer
    the policy               ``choose(request_hashes, replica_loads)`` then ``observe``, as the router
                             calls them: the hashes are the prompt's block hashes as a replica's prefix
                             cache looks them up, the loads each replica's outstanding requests
    each replica             an LRU cache of ``cache_blocks`` block hashes: a request hits the longest
                             run of its leading hashes found there, then every full block of its prompt
                             is cached; it is outstanding for its service time (``ServiceModel``), longer
                             for the prompt tokens it missed and for the requests already outstanding
    a replica that dies      (``failures``) leaves the rotation at its time: its load reads ``None``, its
                             cache is gone, the policy is told (``forget``) and its outstanding requests
                             are sent again to the others

What comes out (``RoutingResult``): the prefix-cache hit rate (blocks found over blocks looked up), the
ideal hit rate of one cache that holds every block ever sent (no policy can beat it: each replica holds
a part of what was sent before), how many requests each replica served and the largest share, and each
replica's peak load. ``token_chat_workload`` draws the traffic: conversations over a few shared system
prompts, each turn's prompt the whole history so far, as token ids.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from infra_lib.serving.prefix_cache import chained_block_hashes
from infra_lib.serving.router import RoutingPolicy, prompt_block_hashes

Conversation = tuple[tuple[int, ...], ...]  # one prompt per turn, each extending the one before


def token_chat_workload(
    num_conversations: int,
    turns: int,
    *,
    seed: int = 0,
    num_system_prompts: int = 3,
    system_tokens: int = 96,
    user_tokens: tuple[int, int] = (8, 32),
    reply_tokens: tuple[int, int] = (16, 64),
    vocab_size: int = 49152,
) -> list[Conversation]:
    """Multi-turn chats as token ids, drawn from ``seed``.

    Conversation ``c`` opens with system prompt ``c % num_system_prompts`` (``system_tokens`` ids); turn
    ``t``'s prompt is the system prompt, every earlier turn's user message and scripted reply, then turn
    ``t``'s user message (lengths drawn uniformly from ``user_tokens`` and ``reply_tokens``, inclusive).
    One system prompt is the hot-prefix workload: every request shares its first blocks.
    """
    if num_conversations < 1 or turns < 1:
        raise ValueError(f"num_conversations and turns must be positive, got {num_conversations} and {turns}")
    if num_system_prompts < 1 or system_tokens < 0 or vocab_size < 2:
        raise ValueError(
            f"need at least one system prompt, system_tokens >= 0 and vocab_size >= 2, got {num_system_prompts}, "
            f"{system_tokens} and {vocab_size}"
        )
    for name, (low, high) in (("user_tokens", user_tokens), ("reply_tokens", reply_tokens)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {(low, high)}")
    rng = random.Random(seed)

    def draw(lengths: tuple[int, int]) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(rng.randint(*lengths))]

    systems = [[rng.randrange(vocab_size) for _ in range(system_tokens)] for _ in range(num_system_prompts)]
    conversations = []
    for c in range(num_conversations):
        history, prompts = list(systems[c % num_system_prompts]), []
        for _ in range(turns):
            history += draw(user_tokens)
            prompts.append(tuple(history))
            history += draw(reply_tokens)
        conversations.append(tuple(prompts))
    return conversations


@dataclass(frozen=True)
class ServiceModel:
    """How long a request stays outstanding, in the simulation's time units:
    ``(missed prompt tokens x prefill_per_token + output_tokens x decode_per_token) x (1 + per_outstanding x
    requests already outstanding on its replica)``."""

    prefill_per_token: float = 1.0
    decode_per_token: float = 8.0
    output_tokens: int = 16
    per_outstanding: float = 0.25

    def __post_init__(self):
        if min(self.prefill_per_token, self.decode_per_token, self.output_tokens, self.per_outstanding) < 0:
            raise ValueError(f"every cost of a ServiceModel must be >= 0, got {self}")

    def time(self, missed_tokens: int, outstanding: int) -> float:
        work = missed_tokens * self.prefill_per_token + self.output_tokens * self.decode_per_token
        return work * (1 + self.per_outstanding * outstanding)


@dataclass(frozen=True)
class RoutingResult:
    """One simulated run. ``choices``: the replica of each routed request in order (a request sent again
    after its replica died counts again); ``peak_loads``: each replica's most outstanding requests at once."""

    policy: str
    hit_blocks: int
    lookup_blocks: int
    ideal_hit_blocks: int
    requests_per_replica: tuple[int, ...]
    peak_loads: tuple[int, ...]
    retried: int
    mean_latency: float
    makespan: float
    choices: tuple[int, ...]

    @property
    def requests(self) -> int:
        return len(self.choices)

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0

    @property
    def max_share(self) -> float:
        """The largest fraction of the requests one replica served."""
        return max(self.requests_per_replica) / self.requests if self.requests else 0.0

    @property
    def peak_load(self) -> int:
        return max(self.peak_loads)


class InvalidChoice(ValueError):
    """A policy chose something other than a replica in rotation."""


def _leading_run(hashes: Sequence[bytes], held) -> int:
    return next((i for i, h in enumerate(hashes) if h not in held), len(hashes))


def simulate_routing(
    policy: RoutingPolicy,
    conversations: Sequence[Conversation],
    n_replicas: int,
    *,
    block_size: int = 16,
    cache_blocks: int = 256,
    concurrency: int = 8,
    think_time: float = 50.0,
    service: ServiceModel = ServiceModel(),
    failures: Mapping[int, float] | None = None,
    seed: int = 0,
) -> RoutingResult:
    """Play ``conversations`` through ``policy`` onto ``n_replicas`` simulated replicas (see the module's docstring).

    Args:
        policy: a ``RoutingPolicy`` (fresh: its state is the run's).
        conversations: what ``token_chat_workload`` returns.
        n_replicas: how many replicas.
        block_size: the replicas' KV block (and the hashes' block).
        cache_blocks: how many block hashes each replica's prefix cache holds (least recently used leave first).
        concurrency: users, each sending one conversation's turns at a time.
        think_time: the mean pause before each turn (exponential, from ``seed``); 0 for none.
        service: the service-time model.
        failures: replica -> the time it dies (at least one replica must live).
        seed: the think times' seed.

    Raises:
        InvalidChoice: the policy chose a replica out of rotation, out of range, or not an integer.
    """
    failures = dict(failures or {})
    if n_replicas < 1 or concurrency < 1 or block_size < 1 or cache_blocks < 0 or think_time < 0:
        raise ValueError(
            "n_replicas, concurrency and block_size must be positive and cache_blocks, think_time >= 0, got "
            f"{n_replicas}, {concurrency}, {block_size}, {cache_blocks}, {think_time}"
        )
    if any(not 0 <= r < n_replicas for r in failures) or len(failures) >= n_replicas:
        raise ValueError(f"failures {failures} must name replicas in 0..{n_replicas - 1} and leave one alive")
    rng = random.Random(seed)
    loads: list[int | None] = [0] * n_replicas
    caches = [OrderedDict() for _ in range(n_replicas)]
    seen: set[bytes] = set()
    peaks, served, choices = [0] * n_replicas, [0] * n_replicas, []
    hit = lookups = ideal = retried = 0
    latencies: list[float] = []
    events: list[tuple] = []  # (time, order, kind, value)
    running: dict[int, tuple[int, int, float]] = {}  # attempt -> (user, replica, sent at)
    order = iter(range(10**12))
    queue = list(range(len(conversations)))[::-1]
    position: dict[int, tuple[int, int]] = {}  # user -> (conversation, turn)

    def pause() -> float:
        return rng.expovariate(1 / think_time) if think_time else 0.0

    def push(time: float, kind: str, value: int) -> None:
        heapq.heappush(events, (time, next(order), kind, value))

    def route(now: float, user: int, sent_at: float) -> None:
        nonlocal hit, lookups, ideal
        conversation, turn = position[user]
        prompt = conversations[conversation][turn]
        hashes = prompt_block_hashes(prompt, block_size)
        chosen = policy.choose(list(hashes), list(loads))
        if type(chosen) is not int or not 0 <= chosen < n_replicas or loads[chosen] is None:
            raise InvalidChoice(
                f"{type(policy).__name__}.choose returned {chosen!r} for request {len(choices)} with replica_loads "
                f"{loads}: it must return the index (an int) of a replica whose load is not None"
            )
        policy.observe(list(hashes), chosen)
        cache = caches[chosen]
        found = _leading_run(hashes, cache)
        for h in hashes[:found]:
            cache.move_to_end(h)
        hit, lookups, ideal = hit + found, lookups + len(hashes), ideal + _leading_run(hashes, seen)
        for h in chained_block_hashes(prompt, block_size):
            cache[h] = None
            cache.move_to_end(h)
            seen.add(h)
        while len(cache) > cache_blocks:
            cache.popitem(last=False)
        attempt = len(choices)
        choices.append(chosen)
        served[chosen] += 1
        push(now + service.time(len(prompt) - found * block_size, loads[chosen]), "finish", attempt)
        running[attempt] = (user, chosen, sent_at)
        loads[chosen] += 1
        peaks[chosen] = max(peaks[chosen], loads[chosen])

    def next_turn(now: float, user: int) -> None:
        conversation, turn = position.get(user, (None, None))
        if conversation is not None and turn + 1 < len(conversations[conversation]):
            position[user] = (conversation, turn + 1)
        elif queue:
            position[user] = (queue.pop(), 0)
        else:
            return
        push(now + pause(), "send", user)

    for user in range(concurrency):
        next_turn(0.0, user)
    for replica, at in sorted(failures.items()):
        push(at, "fail", replica)
    now = 0.0
    while events:
        now, _, kind, value = heapq.heappop(events)
        if kind == "send":
            route(now, value, now)
        elif kind == "finish" and value in running:
            user, replica, sent_at = running.pop(value)
            loads[replica] -= 1
            latencies.append(now - sent_at)
            next_turn(now, user)
        elif kind == "fail":
            loads[value], caches[value] = None, OrderedDict()
            policy.forget(value)
            for attempt in sorted(a for a, (_, replica, _) in running.items() if replica == value):
                user, _, sent_at = running.pop(attempt)
                retried += 1
                route(now, user, sent_at)
    return RoutingResult(
        policy=getattr(policy, "name", type(policy).__name__),
        hit_blocks=hit,
        lookup_blocks=lookups,
        ideal_hit_blocks=ideal,
        requests_per_replica=tuple(served),
        peak_loads=tuple(peaks),
        retried=retried,
        mean_latency=math.fsum(latencies) / len(latencies) if latencies else 0.0,
        makespan=now,
        choices=tuple(choices),
    )
