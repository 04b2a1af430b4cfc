"""The router in front of replicas: the routing policies on synthetic hashes, then `infra-lab serve
--replicas 2` itself: streams relayed intact, the prefix cache's own keys, a replica killed mid-run,
and SIGTERM leaving no process behind.

The policy tests are pure and fast. The rest share one `infra-lab serve --replicas 2 --router
round-robin` started once for the module (each replica at most two sequences in a batch, so a third
request waits in its queue); the kill test and the SIGTERM test end it, so they come last.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from conftest import REPO, SMOLLM2, wait_until_serving

from infra_lib.serving.prefix_cache import HashPrefixCache, chained_block_hashes
from infra_lib.serving.router import (
    REPLICA_HEADER,
    LeastLoadedPolicy,
    NoReplicaAvailable,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    make_policy,
    prompt_block_hashes,
)

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SERVED = [SMOLLM2, pytest.mark.xdist_group("router")]


def hashes(*labels: str) -> list[bytes]:
    return [label.encode() for label in labels]


# --- the policies, pure --------------------------------------------------------------------------


def test_round_robin_takes_replicas_in_turn_and_skips_those_out_of_rotation():
    policy = RoundRobinPolicy()
    assert [policy.choose([], [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert [policy.choose([], [0, None, 0]) for _ in range(3)] == [2, 0, 2]
    with pytest.raises(NoReplicaAvailable):
        policy.choose([], [None, None])


def test_least_loaded_picks_the_fewest_outstanding_and_spreads_ties():
    policy = LeastLoadedPolicy()
    assert policy.choose([], [3, 1, 2]) == 1
    assert policy.choose([], [5, None, 4]) == 2
    assert [policy.choose([], [0, 0]) for _ in range(4)] == [0, 1, 0, 1], "an idle pool must not send all to one"


def test_prefix_policy_follows_the_longest_run_of_leading_hashes():
    policy = PrefixAwarePolicy()
    policy.observe(hashes("sys", "a1", "a2"), 1)
    policy.observe(hashes("sys", "b1"), 0)
    assert policy.choose(hashes("sys", "a1", "a2", "a3"), [0, 0]) == 1  # 3 blocks on 1, 1 on 0
    assert policy.choose(hashes("sys", "b1", "b2"), [0, 0]) == 0  # 2 blocks on 0, 1 on 1
    assert policy.match_length(hashes("sys", "x", "a2"), 1) == 1, "a match stops at the first block not sent"
    # the same block after another history is another hash: nothing matches, least-loaded decides
    assert policy.choose(hashes("other", "a1"), [2, 1]) == 1
    assert policy.choose(hashes("other", "a1"), [1, 2]) == 0


def test_prefix_policy_skips_a_replica_over_the_load_bound():
    policy = PrefixAwarePolicy(slack=0.5)
    hot = hashes("sys", "hot")
    policy.observe(hot, 0)
    assert policy.choose(hot, [3, 2]) == 0, "3 <= 1.5 x mean 2.5: within the bound, the cache wins"
    assert policy.choose(hot, [5, 1]) == 1, "5 > 1.5 x mean 3: over the bound, skipped"
    assert policy.choose(hot, [1, 0]) == 1, "1 > 1.5 x mean 0.5"
    capped = PrefixAwarePolicy(slack=10, max_outstanding=4)
    capped.observe(hot, 0)
    assert capped.choose(hot, [4, 3]) == 1, "at the absolute cap the replica is skipped"
    assert capped.choose(hot, [5, 4]) == 1, "all over the cap: the least loaded serves"
    assert capped.choose(hot, [None, 9]) == 1, "a replica out of rotation is never chosen, however warm"


def test_a_hot_prefix_spreads_over_replicas_as_load_builds():
    policy = PrefixAwarePolicy(slack=0.5)
    loads = [0, 0, 0]
    for _ in range(30):  # one system prompt for everyone, no request finishing
        chosen = policy.choose(hashes("hot"), loads)
        policy.observe(hashes("hot"), chosen)
        loads[chosen] += 1
    assert max(loads) <= 1.5 * (sum(loads) / 3) + 1, loads


def test_prefix_policy_memory_is_bounded_least_recently_sent_first_and_forgets_a_replica():
    policy = PrefixAwarePolicy(max_hashes=3)
    policy.observe(hashes("a", "b"), 0)
    policy.observe(hashes("c"), 1)
    policy.observe(hashes("a"), 0)  # "a" is used again: "b" is now the oldest
    policy.observe(hashes("d"), 1)
    assert len(policy) == 3
    assert policy.match_length(hashes("a", "b"), 0) == 1, "b was forgotten first"
    policy.forget(0)
    assert policy.match_length(hashes("a"), 0) == 0 and policy.match_length(hashes("c"), 1) == 1


def test_make_policy_names_and_bad_options():
    assert [make_policy(n).name for n in ("round-robin", "least-loaded", "prefix")] == [
        "round-robin",
        "least-loaded",
        "prefix",
    ]
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")
    with pytest.raises(ValueError, match="slack"):
        PrefixAwarePolicy(slack=-1)


def test_prompt_block_hashes_are_the_keys_a_prefix_cache_can_hit():
    cache = HashPrefixCache(16)
    tokens = list(range(100, 148))  # 48 tokens: 3 full blocks
    cache.insert(tokens, [7, 8, 9])
    # match() never hits the block holding the prompt's last token, so neither does the router
    assert len(prompt_block_hashes(tokens, 16)) == len(cache.match(tokens)) == 2
    assert len(prompt_block_hashes(tokens + [1], 16)) == len(cache.match(tokens + [1])) == 3
    assert prompt_block_hashes(tokens + [1], 16) == chained_block_hashes(tokens, 16)
    assert prompt_block_hashes(tokens[:16], 16) == []


# --- infra-lab serve --replicas 2 ----------------------------------------------------------------


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """`infra-lab serve --replicas 2 --router round-robin` in its own process, with its replicas and their pids."""
    import psutil

    from infra_lib.serving.server import free_port

    port, log_path = free_port(), tmp_path_factory.mktemp("router") / "router.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "course_tools.cli", "serve", "--replicas", "2", "--router", "round-robin"]
            + ["--port", str(port), "--max-num-seqs", "2", "--kv-blocks", "128"],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until_serving(process, port, log_path, "infra-lab serve --replicas 2")
        url = f"http://127.0.0.1:{port}"
        replicas = [r["url"] for r in httpx.get(url + "/health").json()["replicas"]]
        pids = [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
        yield url, process, replicas, pids, log_path
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(20)
        for pid in pids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def stream_chat(url: str, max_tokens: int, started: dict | None = None, key=None) -> dict:
    """One streamed greedy chat request through ``url``: its replica, text, chunks and any error event."""
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    out = {"text": "", "chunks": 0, "error": None, "done": False}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        out["status"], out["replica"] = response.status_code, response.headers.get(REPLICA_HEADER)
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                break
            data = json.loads(line[len("data: ") :])
            if "error" in data:
                out["error"] = data["error"]
                break
            delta = data["choices"][0]["delta"]
            if "content" in delta:
                out["text"] += delta["content"]
                out["chunks"] += 1
                if started is not None:
                    started[key] = out["replica"]
    return out


@pytest.mark.usefixtures("routed")
class TestServeReplicas:
    pytestmark = SERVED

    def test_a_stream_through_the_router_equals_the_replicas_own_answer(self, routed):
        from openai import OpenAI

        url, _, replicas, _, _ = routed
        direct = OpenAI(base_url=replicas[1] + "/v1", api_key="unused", max_retries=0)
        expected = direct.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16)
        routed_client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for _ in range(2):  # round-robin: once on each replica
            deltas, reasons, usage = [], [], None
            stream = routed_client.chat.completions.create(
                model=MODEL,
                messages=QUESTION,
                temperature=0,
                max_tokens=16,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    deltas.append(choice.delta.content or "")
                    reasons += [choice.finish_reason] if choice.finish_reason else []
            assert "".join(deltas) == expected.choices[0].message.content
            assert "Paris" in "".join(deltas)
            assert reasons == [expected.choices[0].finish_reason]
            assert usage.completion_tokens == expected.usage.completion_tokens
        whole = routed_client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0
        )
        assert (
            whole.choices[0].text
            == direct.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
            .choices[0]
            .text
        )
        assert [m.id for m in routed_client.models.list().data] == [MODEL]

    def test_a_replicas_own_errors_reach_the_client_unchanged(self, routed):
        url, _, replicas, _, _ = routed
        for body in ({"model": "nope", "messages": QUESTION}, {"model": MODEL, "messages": []}):
            for stream in (False, True):
                sent = body | {"stream": stream}
                via_router = httpx.post(url + "/v1/chat/completions", json=sent, timeout=60)
                direct = httpx.post(replicas[0] + "/v1/chat/completions", json=sent, timeout=60)
                assert via_router.status_code == direct.status_code >= 400
                assert via_router.json() == direct.json() and set(direct.json()["error"]) >= {"message", "code"}

    def test_the_routers_hashes_are_what_the_replicas_prefix_cache_hits(self, routed, smollm2):
        """A prompt sent twice to one replica: the second finds exactly the router's blocks cached."""
        from infra_lib.serving.observability import parse_metrics
        from infra_lib.serving.router import Router

        _, _, replicas, _, _ = routed
        messages = [
            {"role": "system", "content": "You answer in one short sentence about European geography."},
            {"role": "user", "content": "Which river flows through Vienna, Budapest and Belgrade?"},
        ]
        body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}).encode()
        router_hashes = Router(replicas, "prefix", smollm2.tokenizer).request_hashes(body, chat=True)
        assert len(router_hashes) >= 2

        def hits() -> float:
            return parse_metrics(httpx.get(replicas[0] + "/metrics").text)["vllm:prefix_cache_hits_total"]

        httpx.post(replicas[0] + "/v1/chat/completions", content=body, timeout=60).raise_for_status()
        before = hits()
        httpx.post(replicas[0] + "/v1/chat/completions", content=body, timeout=60).raise_for_status()
        assert hits() - before == 16 * len(router_hashes)

    def test_a_client_that_hangs_up_frees_its_request_on_the_replica(self, routed):
        url, _, replicas, _, _ = routed
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
            served_by = int(response.headers[REPLICA_HEADER])
            for line in response.iter_lines():  # hang up at the first token, 399 before the end
                if '"content"' in line:
                    break
        deadline = time.monotonic() + 20
        while httpx.get(replicas[served_by] + "/health").json()["outstanding"] or any(
            r["outstanding"] for r in httpx.get(url + "/router/stats").json()["replicas"]
        ):
            assert time.monotonic() < deadline, "the abandoned request still runs on its replica"
            time.sleep(0.05)

    def test_a_replica_killed_mid_run_fails_only_its_streaming_requests(self, routed):
        """Five streams in turn (the victim runs two and queues one, the other replica runs two); the
        victim dies once its two stream. Those two end with an error naming it, its queued one is
        retried on the survivor, and every other request, then and later, succeeds."""
        import psutil

        url, _, replicas, pids, _ = routed

        def outstanding() -> list[int]:
            return [r["outstanding"] for r in httpx.get(url + "/router/stats").json()["replicas"]]

        started: dict[int, str] = {}
        sent_to = []
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            futures = []
            for i in range(5):
                before = outstanding()
                futures.append(pool.submit(stream_chat, url, 40, started, i))
                deadline = time.monotonic() + 60
                while (now := outstanding()) == before:
                    assert time.monotonic() < deadline, "the router did not send the request on"
                    time.sleep(0.02)
                sent_to.append(next(r for r in (0, 1) if now[r] > before[r]))
            victim, survivor = sent_to[0], 1 - sent_to[0]
            assert sent_to == [victim, survivor] * 2 + [victim], f"round-robin sent the requests to {sent_to}"
            deadline = time.monotonic() + 60
            while not {0, 2} <= set(started):  # the victim's two running streams have tokens out
                assert time.monotonic() < deadline, f"no tokens from replica {victim} yet: {started}"
                time.sleep(0.02)
            assert httpx.get(replicas[victim] + "/health").json()["outstanding"] == 3, "one request waits in its queue"
            port = int(replicas[victim].rsplit(":", 1)[1])
            listening = {c.laddr.port: c.pid for c in psutil.net_connections("inet") if c.status == "LISTEN"}
            assert listening[port] in pids
            psutil.Process(listening[port]).kill()
            results = [f.result(timeout=120) for f in futures]

        for i in (0, 2):
            error = results[i]["error"]
            assert results[i]["chunks"] >= 1 and error is not None, results[i]
            assert error["code"] == "replica_failed", error
            assert f"replica {victim} ({replicas[victim]})" in error["message"], error
        for i in (1, 3, 4):
            assert results[i]["error"] is None and results[i]["done"], results[i]
            assert results[i]["chunks"] == 40 and results[i]["replica"] == str(survivor), results[i]
        stats = httpx.get(url + "/router/stats").json()
        assert stats["retried"] == 1 and stats["failed_mid_stream"] == 2, stats
        assert stats["replicas"][victim]["up"] is False and stats["replicas"][survivor]["up"] is True
        later = [stream_chat(url, 4) for _ in range(3)]
        assert all(r["done"] and r["error"] is None and r["replica"] == str(survivor) for r in later), later

    def test_sigterm_stops_the_router_and_every_replica(self, routed):
        import psutil

        url, process, _, pids, log_path = routed
        assert len(pids) >= 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log_path.read_text()
        deadline = time.monotonic() + 20
        while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
            assert time.monotonic() < deadline, f"replica processes {pids} outlived the router"
            time.sleep(0.1)
        assert "stopped the router and its replicas" in log_path.read_text()


def test_with_no_replica_up_a_request_gets_a_503_that_says_so():
    from infra_lib.serving.router import Router, create_router_app
    from infra_lib.serving.server import ServerThread, free_port

    nowhere = f"http://127.0.0.1:{free_port()}"
    with ServerThread(create_router_app(Router([nowhere], "prefix"))) as thread:
        answer = httpx.post(thread.url + "/v1/chat/completions", json={"model": MODEL, "messages": QUESTION})
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert error["code"] == "no_replica_available" and nowhere in error["message"], error
        assert httpx.get(thread.url + "/health").status_code == 503


@pytest.mark.parametrize(
    "options, refusal",
    [
        (["--replicas", "0"], "--replicas must be a positive integer, got 0"),
        (["--replicas", "2", "--model", "/no/such.gguf"], "no such file"),
    ],
)
def test_serve_with_replicas_refuses_bad_options_before_starting_any(options, refusal):
    result = subprocess.run(
        [sys.executable, "-m", "course_tools.cli", "serve", *options],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and refusal in result.stderr and "starting" not in result.stdout
