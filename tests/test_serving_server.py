"""The OpenAI-compatible server on SmolLM2: the official client, raw HTTP errors, disconnects, load.

One server (one engine thread) serves the module; tests that need other limits start their own
app on the same loaded model. Every test ends with no request outstanding and no KV block held.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from conftest import REPO, SMOLLM2, wait_until_serving

pytestmark = SMOLLM2

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def wait_idle(engine, timeout_s: float = 30.0) -> None:
    """Wait until the engine holds no request, then check that every KV block is back in the pool."""
    deadline = time.monotonic() + timeout_s
    while engine.num_outstanding or engine.engine.has_unfinished():
        assert time.monotonic() < deadline, f"{engine.num_outstanding} requests still outstanding after {timeout_s} s"
        time.sleep(0.02)
    time.sleep(0.05)  # let the engine thread finish the step it is in
    pool = engine.engine.scheduler.pool
    assert pool.num_free == engine.engine.config.num_blocks, (
        f"{engine.engine.config.num_blocks - pool.num_free} KV blocks leaked"
    )
    engine.engine.check_invariants()


@pytest.fixture(scope="module")
def server(smollm2):
    from infra_lib.serving.server import ServerThread, build_engine, create_app

    engine = build_engine(smollm2.model, smollm2.tokenizer, max_num_seqs=32, kv_blocks=384)
    app = create_app(engine, MODEL)
    with ServerThread(app) as thread:
        yield thread, engine, app
    assert not engine.is_alive, "the engine thread outlived its server"


@pytest.fixture
def client(server):
    from openai import OpenAI

    thread, engine, _ = server
    yield OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0)
    wait_idle(engine)


def test_openai_client_streamed_deltas_equal_the_whole_greedy_answer(client, smollm2):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    assert whole.choices[0].message.content.startswith("The capital of France is Paris")
    assert whole.usage.prompt_tokens == len(smollm2.tokenizer.encode_chat(QUESTION))

    deltas, finish_reasons, usage, chunks = [], [], None, 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            assert not chunk.choices, "the usage chunk carries no choices"
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content is not None:
                deltas.append(choice.delta.content)
            if choice.finish_reason is not None:
                finish_reasons.append(choice.finish_reason)
        chunks += 1
    assert "".join(deltas) == whole.choices[0].message.content
    assert finish_reasons == [whole.choices[0].finish_reason] == ["stop"]
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == len(deltas)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_raw_stream_ends_with_done_after_one_finish_reason(server):
    thread, engine, _ = server
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", thread.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert reasons == ["length"]
    assert all("usage" not in c for c in chunks), "usage appears only when stream_options asks for it"
    assert sum("content" in c["choices"][0]["delta"] for c in chunks) == 5
    wait_idle(engine)


def test_completions_endpoint_stop_strings_lengths_and_seeds(client):
    prompt = "The capital of France is"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == whole.choices[0].text and whole.choices[0].text.strip()
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12

    word = whole.choices[0].text.split()[1]
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[word])
    assert word not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    assert whole.choices[0].text.startswith(stopped.choices[0].text)

    sampled = [
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, temperature=1.0, top_p=0.9, seed=7, max_tokens=16
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1], "the same seed must give the same sampled answer"

    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 3


def test_models_health_and_metrics_endpoints(server):
    thread, _, _ = server
    models = httpx.get(thread.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["object"] == "list"
    assert httpx.get(thread.url + "/health").json()["status"] == "ok"
    text = httpx.get(thread.url + "/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
    ):
        assert name in text, f"/metrics lacks {name}"


BAD_REQUESTS = [
    ("malformed JSON", b'{"model": "SmolLM2-135M-Instruct", "messages": [', 400, "invalid_json", None),
    ("messages is a string", {"model": MODEL, "messages": "hi"}, 400, None, "messages"),
    ("no messages", {"model": MODEL, "messages": []}, 400, None, "messages"),
    ("temperature is a word", {"model": MODEL, "messages": QUESTION, "temperature": "hot"}, 400, None, "temperature"),
    ("temperature too high", {"model": MODEL, "messages": QUESTION, "temperature": 9}, 400, None, "temperature"),
    ("max_tokens zero", {"model": MODEL, "messages": QUESTION, "max_tokens": 0}, 400, None, "max_tokens"),
    ("max_tokens a float", {"model": MODEL, "messages": QUESTION, "max_tokens": 2.5}, 400, None, "max_tokens"),
    ("n above one", {"model": MODEL, "messages": QUESTION, "n": 2}, 400, None, "n"),
    ("unknown role", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, None, None),
    ("five stop strings", {"model": MODEL, "messages": QUESTION, "stop": list("abcde")}, 400, None, "stop"),
    ("empty stop string", {"model": MODEL, "messages": QUESTION, "stop": ""}, 400, None, "stop"),
    ("no model", {"messages": QUESTION}, 400, None, "model"),
    ("unknown model", {"model": "gpt-9", "messages": QUESTION}, 404, "model_not_found", "model"),
    ("body is a list", [1, 2, 3], 400, None, None),
]


@pytest.mark.parametrize("name,body,status,code,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors_and_never_reach_the_engine(server, name, body, status, code, param):
    thread, engine, _ = server
    arrived = len(engine.engine.events.events(kind="arrived"))
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        thread.url + "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param, error
    assert len(engine.engine.events.events(kind="arrived")) == arrived, f"{name} reached the engine"


def test_oversize_prompts_are_refused_before_running(server, smollm2):
    thread, engine, _ = server
    long_text = "word " * 9000  # more tokens than the model's 8192 positions
    response = httpx.post(
        thread.url + "/v1/completions", json={"model": MODEL, "prompt": long_text, "max_tokens": 4}, timeout=60
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    # fits the context but not the KV pool (384 blocks of 16 tokens)
    response = httpx.post(
        thread.url + "/v1/completions", json={"model": MODEL, "prompt": "word " * 3000, "max_tokens": 4000}, timeout=60
    )
    assert response.status_code == 400 and "blocks" in response.json()["error"]["message"]
    response = httpx.post(thread.url + "/v1/completions", json={"model": MODEL, "prompt": [10**9], "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    wait_idle(engine)
    assert not engine.engine.has_unfinished()


CONTEXT = 8192  # SmolLM2's context length


def _long_request(smollm2, endpoint: str, words: int, **fields) -> tuple[dict, int]:
    """A request on ``endpoint`` whose prompt repeats a word ``words`` times, and its prompt's token count."""
    text = "word " * words
    if endpoint == "chat":
        messages = [{"role": "user", "content": text}]
        return {"model": MODEL, "messages": messages, **fields}, len(smollm2.tokenizer.encode_chat(messages))
    return {"model": MODEL, "prompt": text, **fields}, len(smollm2.tokenizer.encode(text))


def _refusal(thread, engine, endpoint: str, body: dict) -> dict:
    """POST ``body``; check the answer is an OpenAI 400 error the engine never saw, and return the error."""
    arrived = len(engine.engine.events.events(kind="arrived"))
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    response = httpx.post(thread.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json"), "a refusal is never an event stream"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["code"] == "context_length_exceeded", error
    assert len(engine.engine.events.events(kind="arrived")) == arrived, "the refused request reached the engine"
    return error


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_max_tokens_past_the_context_left_by_the_prompt_is_a_400_with_the_figures(server, smollm2, endpoint, stream):
    thread, engine, _ = server
    body, n = _long_request(smollm2, endpoint, 8000, stream=stream, temperature=0)
    assert 8000 <= n < CONTEXT - 100
    for field, asked in (("max_tokens", 200), ("max_tokens", CONTEXT - n + 1), ("max_completion_tokens", 200)):
        error = _refusal(thread, engine, endpoint, {**body, field: asked})
        assert error["param"] == field
        for figure in (CONTEXT, n, asked):  # the context length, the prompt's tokens, what was asked for
            assert str(figure) in error["message"], (figure, error["message"])
    wait_idle(engine)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_prompt_that_fills_the_context_alone_is_a_400_with_the_figures(server, smollm2, endpoint):
    thread, engine, _ = server
    body, n = _long_request(smollm2, endpoint, 8300)
    assert n > CONTEXT
    for extra in ({}, {"max_tokens": 4}, {"stream": True}):
        error = _refusal(thread, engine, endpoint, {**body, **extra})
        assert error["param"] == ("messages" if endpoint == "chat" else "prompt")
        assert str(CONTEXT) in error["message"] and str(n) in error["message"], error["message"]
    # exactly the context: no room left for one output token
    ids = smollm2.tokenizer.encode("word " * 8300)[:CONTEXT]
    error = _refusal(thread, engine, "completions", {"model": MODEL, "prompt": ids})
    assert str(CONTEXT) in error["message"]
    wait_idle(engine)


@pytest.fixture(scope="module")
def short_context(smollm2):
    """A server on the same model with its context cut to 48 tokens (the chat question takes 37), so a
    request can reach the context's end in a few decode steps."""
    from infra_lib.serving.server import ServerThread, build_engine, create_app

    engine = build_engine(smollm2.model, smollm2.tokenizer, max_num_seqs=4, kv_blocks=16)
    engine.engine.runner.max_position = 48  # what the server reads as the model's context length
    with ServerThread(create_app(engine, MODEL, max_tokens_default=256)) as thread:
        yield thread, engine


def test_requests_that_fit_the_context_run_and_the_default_caps_at_what_fits(short_context, smollm2):
    thread, engine = short_context
    n = len(smollm2.tokenizer.encode_chat(QUESTION))
    room = 48 - n
    assert 0 < room < 256
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "ignore_eos": True}
    url = thread.url + "/v1/chat/completions"
    exact = httpx.post(url, json={**body, "max_tokens": room}, timeout=60)  # the prompt and the output fill it
    assert exact.status_code == 200, exact.text
    assert exact.json()["usage"] == {"prompt_tokens": n, "completion_tokens": room, "total_tokens": 48}
    default = httpx.post(url, json=body, timeout=60)  # no max_tokens: 256 lowered to the room left
    assert default.status_code == 200, default.text
    assert default.json()["usage"]["completion_tokens"] == room
    assert default.json()["choices"][0]["finish_reason"] == "length"
    over = httpx.post(url, json={**body, "max_tokens": room + 1}, timeout=60)
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    normal = httpx.post(url, json={**body, "max_tokens": 3}, timeout=60)
    assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 3
    wait_idle(engine)


def test_a_full_queue_answers_429(smollm2, tmp_path):
    from infra_lib.ops import run_load
    from infra_lib.serving.server import ServerThread, build_engine, create_app

    engine = build_engine(smollm2.model, smollm2.tokenizer, max_num_seqs=1, kv_blocks=64, max_queue_len=1)
    with ServerThread(create_app(engine, MODEL)) as thread:
        result = run_load(thread.url, ["Hello"] * 6, model=MODEL, max_tokens=12, progress=False)
        assert result.status_counts.get("429", 0) >= 1, result.status_counts
        assert result.status_counts.get("200", 0) >= 2, result.status_counts
        refused = [t for t in result.timings if t.error.startswith("429")]
        assert all("busy" in t.error for t in refused)
        saved = json.loads(json.dumps(result.to_json(tmp_path / "load.json")))
        assert json.loads((tmp_path / "load.json").read_text())["status_counts"] == result.status_counts
        assert len(saved["requests"]) == 6 and saved["config"]["max_tokens"] == 12 and "machine" in saved
        wait_idle(engine)


def test_a_client_that_hangs_up_aborts_its_request(server):
    thread, engine, app = server
    aborted = app.state.serving.metrics.snapshot().get('vllm:request_success_total{finished_reason="abort"}', 0)
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # a whole (non-streamed) answer the client stops waiting for
        httpx.post(thread.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    with httpx.stream("POST", thread.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if '"content"' in line:
                break  # hang up mid-stream
    wait_idle(engine, timeout_s=20)
    after = app.state.serving.metrics.snapshot()['vllm:request_success_total{finished_reason="abort"}']
    assert after - aborted == 2


def test_gauges_fall_back_to_idle_when_a_stream_is_aborted_with_no_request_after_it(server):
    """An abort frees its sequence between steps; the gauges must follow then, not at the next request."""
    from infra_lib.serving.observability import parse_metrics

    thread, engine, _ = server
    wait_idle(engine)

    def gauges():
        m = parse_metrics(httpx.get(thread.url + "/metrics").text)
        return m["vllm:num_requests_running"], m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"]

    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", thread.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        # The line iterator stays referenced: a `for` that breaks out of `r.iter_lines()` lets the
        # generator be closed at once, and closing it closes the connection (an abort, mid-test).
        lines_read = r.iter_lines()
        contents, lines = 0, []
        while contents < 2:
            line = next(lines_read, None)
            assert line is not None, f"the stream ended before its second token: {lines}"
            lines.append(line)
            contents += '"content"' in line
        running, _, usage = gauges()
        finished = [e.data for e in engine.engine.events.events(kind="finished")][-1:]
        assert running == 1 and usage > 0, f"mid-stream the gauges show the request: {running=}, {usage=}, {finished=}"
        arrived = len(engine.engine.events.events(kind="arrived"))
    # the connection is closed: poll /metrics only (a bounded wait; no request reaches the engine)
    deadline = time.monotonic() + 20
    while gauges() != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gauges() == (0, 0, 0), "running, waiting and KV usage after the abort"
    assert len(engine.engine.events.events(kind="arrived")) == arrived
    assert engine.engine.events.events(kind="finished")[-1].data["reason"] == "abort"
    wait_idle(engine)


def test_load_with_hundreds_of_streams_some_hanging_up_leaks_nothing(server, smollm2):
    from infra_lib.ops import run_load
    from infra_lib.serving.observability import parse_metrics

    thread, engine, _ = server
    before = parse_metrics(httpx.get(thread.url + "/metrics").text)
    n, hang_ups = 200, {i: 2 for i in range(0, 200, 10)}
    # Each chat prompt shares its first 32 tokens (two KV blocks, prefix-cached after the first wave):
    # a stream prefills only its number and the template's tail.
    prompts = [f"Give me one word about the number {i}" for i in range(n)]
    result = run_load(thread.url, prompts, model=MODEL, max_tokens=6, disconnect_after=hang_ups, progress=False, seed=1)
    assert result.status_counts == {"200": n - len(hang_ups), "disconnected": len(hang_ups)}, result.status_counts
    summary = result.summary
    assert summary["completed"] == n - len(hang_ups) and summary["failed"] == 0
    assert summary["total_output_tokens"] == 6 * (n - len(hang_ups))
    wait_idle(engine, timeout_s=60)

    after = parse_metrics(httpx.get(thread.url + "/metrics").text)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta['vllm:request_success_total{finished_reason="length"}'] == n - len(hang_ups)
    assert delta['vllm:request_success_total{finished_reason="abort"}'] == len(hang_ups)
    lengths = [len(smollm2.tokenizer.encode_chat([{"role": "user", "content": p}])) for p in prompts]
    assert [t.prompt_tokens for i, t in enumerate(result.timings) if i not in hang_ups] == [
        n_ for i, n_ in enumerate(lengths) if i not in hang_ups
    ]
    assert delta["vllm:prompt_tokens_total"] == sum(lengths)  # hung-up requests were admitted too
    assert delta["vllm:generation_tokens_total"] >= summary["total_output_tokens"] + 2 * len(hang_ups)
    assert delta["vllm:time_to_first_token_seconds_count"] == n
    assert delta["vllm:e2e_request_latency_seconds_count"] == n
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    again = httpx.post(
        thread.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] >= 1


def test_server_metrics_agree_with_what_the_client_measured(server):
    from infra_lib.ops import run_load
    from infra_lib.serving.observability import parse_metrics

    thread, engine, _ = server
    wait_idle(engine)
    before = parse_metrics(httpx.get(thread.url + "/metrics").text)
    result = run_load(
        thread.url,
        [f"Count to {i}." for i in range(8)],
        model=MODEL,
        max_tokens=8,
        rate=4.0,
        max_concurrency=4,
        progress=False,
    )
    wait_idle(engine)
    # a request's clock starts when it leaves the client: never more than 4 clocks run at once
    for t in result.timings:
        in_flight = sum(1 for o in result.timings if o.send_time <= t.send_time < o.end_time)
        assert in_flight <= 4, f"{in_flight} requests in flight with max_concurrency=4"
    after = parse_metrics(httpx.get(thread.url + "/metrics").text)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta["vllm:prompt_tokens_total"] == result.summary["total_input_tokens"]
    assert delta["vllm:generation_tokens_total"] == result.summary["total_output_tokens"] == 64
    assert delta["vllm:inter_token_latency_seconds_count"] == 8 * 7

    def mean(name):
        return delta[f"vllm:{name}_sum"] / delta[f"vllm:{name}_count"]

    # the client starts its clock before the HTTP request and stops it after the SSE chunk arrives,
    # so the server's span of each request lies inside the client's
    assert mean("time_to_first_token_seconds") <= result.summary["mean_ttft_ms"] / 1000 + 0.005
    assert mean("e2e_request_latency_seconds") <= result.summary["mean_e2el_ms"] / 1000 + 0.005
    # the gaps between tokens are the same gaps seen from both ends (delivery jitter averages out)
    server_itl, client_itl = mean("inter_token_latency_seconds"), result.summary["mean_itl_ms"] / 1000
    assert abs(client_itl - server_itl) < 0.25 * server_itl + 0.01, (client_itl, server_itl)


def test_infra_lab_serve_answers_the_openai_client(tmp_path, smollm2):
    """`infra-lab serve` as a learner starts it: its engine steps in C by default (this machine builds
    the step), giving the PyTorch engine's greedy answer, and it says which at start."""
    from openai import OpenAI

    from infra_lib.model import SamplingParams
    from infra_lib.serving import LLM, SchedulerConfig
    from infra_lib.serving.server import free_port

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "serve.log", "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "course_tools.cli",
            "serve",
            "--port",
            str(port),
            "--max-num-seqs",
            "4",
            "--kv-blocks",
            "128",
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until_serving(process, port, tmp_path / "serve.log", "infra-lab serve")
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        answer = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)
        assert "Paris" in answer.choices[0].message.content
        config = SchedulerConfig(max_num_seqs=4, num_blocks=128)
        pytorch = LLM(smollm2.model, smollm2.tokenizer, config).generate(
            [QUESTION], SamplingParams(max_new_tokens=12), use_tqdm=False
        )[0]
        assert answer.choices[0].message.content == pytorch.text
        printed = (tmp_path / "serve.log").read_text()
        assert "client = OpenAI(base_url=" in printed and "engine steps in C, the model's fp32 weights" in printed
    finally:
        process.terminate()
        process.wait(20)
        log.close()


def test_serve_runs_its_steps_in_c_by_default_and_says_where_not(monkeypatch):
    """The default is the C step with fp32 weights where it builds; where it cannot, PyTorch, saying why;
    --pytorch and --native choose; a learner's engine runs its own pieces (in PyTorch)."""
    import infra_lib.serving.server as server

    assert server.choose_step(None, False, False) == (
        "fp32",
        "engine steps in C, the model's fp32 weights (the PyTorch engine's answers); --pytorch runs them in PyTorch",
    )
    assert server.choose_step(None, True, False) == (None, "engine steps in PyTorch (--pytorch)")
    assert server.choose_step("int8", False, False) == ("int8", "engine steps in C, int8 weights (--native int8)")
    assert server.choose_step(None, False, True) == (None, "")
    with pytest.raises(SystemExit, match="give one or the other"):
        server.choose_step("fp32", True, False)
    monkeypatch.setattr(
        server, "native_decode_available", lambda: (False, "no C compiler found (looked for $CC, cc)\nmore")
    )
    assert server.choose_step(None, False, False) == (
        None,
        "engine steps in PyTorch: the C step cannot be built here (no C compiler found (looked for $CC, cc))",
    )


def test_serve_rejects_bad_options():
    result = subprocess.run(
        [sys.executable, "-m", "course_tools.cli", "serve", "--kv-blocks", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "--kv-blocks must be a positive integer" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "course_tools.cli", "serve", "--model", "/no/such.gguf"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "no such file" in result.stderr


def test_serve_load_benchmark_writes_json(tmp_path):
    from conftest import run_benchmark

    result = run_benchmark("serve_load", tmp_path / "serve_load.json")
    runs = result["runs"]
    assert runs["sequential"]["completed"] == result["plan"]["sequential_requests"]
    from infra_lib.model.native_decode import native_decode_available

    served = native_decode_available()[0]  # infra-lab serve's default, its steps in C, where they build
    assert ("open_loop_served" in runs) == served and (result["served_over_before"] is not None) == served
    assert result["served_missing"] is None if served else "cannot be built" in result["served_missing"]
    for name in ("open_loop", "open_loop_after", *(["open_loop_served"] if served else [])):  # the same trace
        assert runs[name]["completed"] + runs[name]["disconnected"] == result["plan"]["num_requests"], name
        assert runs[name]["failed"] == 0 and runs[name]["disconnected"] >= 1, name
        assert runs[name]["leaked_blocks"] == 0, name
    assert runs["sequential"]["leaked_blocks"] == 0
    assert result["engine_alive_after"] and result["throughput_vs_sequential"] > 0
    weights = result["weights"]
    assert weights["after"]["bytes_per_step"] < weights["before"]["bytes_per_step"] / 3.5  # int8 against fp32
    assert result["throughput_after_over_before"] == pytest.approx(
        runs["open_loop_after"]["output_throughput"] / runs["open_loop"]["output_throughput"]
    )
    for when in ("before", "after", *(["served"] if served else [])):  # the SLO sweep: the same rates for each
        rows = result["slo_sweep"][when]
        assert [row["rate"] for row in rows] == result["plan"]["slo_rates"]
        for row in rows:
            assert row["completed"] == result["plan"]["slo_requests"] and row["failed"] == 0
            assert row["within_slo_at_p99"] == (
                row["p99_ttft_ms"] <= result["slo_ms"]["ttft"] and row["p99_tpot_ms"] <= result["slo_ms"]["tpot"]
            )
        best = result["at_slo"][when]
        within = [row for row in rows if row["within_slo_at_p99"]]
        assert best["highest_rate_within_slo"] == (max(row["rate"] for row in within) if within else None)
    assert result["seed"] == 0 and "machine_info" in result


def test_readme_client_example_answers_right(server, capsys):
    """The README's client snippet, run as written against this server, prints the right answer."""
    import re

    thread, engine, _ = server
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Serving the model over HTTP") :]
    snippet = re.search(r"```python\n(from openai import OpenAI\n.*?)```", section, re.S).group(1)
    assert "temperature=0" in snippet and "http://127.0.0.1:8000/v1" in snippet
    exec(snippet.replace("http://127.0.0.1:8000/v1", thread.url + "/v1"), {})
    assert capsys.readouterr().out.startswith("The capital of France is Paris")
    wait_idle(engine)


def test_a_slow_dependency_in_front_of_the_server_is_diagnosed_as_one(smollm2):
    """Chapter 11's drill, asserted: a delay in the handler, before the engine, shows at the client and
    not inside the engine, and the diagnosis names it. One request at a time, with two-token answers:
    the engine waits out each request's delay idle, so it stays mostly idle even when other programs
    slow its steps down (at a set rate, a loaded machine kept it 98% busy and the rule saw no
    dependency)."""
    from infra_lib.ops import run_load
    from infra_lib.ops.diagnose import diagnose, window_stats
    from infra_lib.serving.server import ServerThread, build_engine, create_app

    engine = build_engine(smollm2.model, smollm2.tokenizer, max_num_seqs=8, kv_blocks=64)
    with ServerThread(create_app(engine, MODEL, downstream_delay_s=2.0)) as thread:
        result = run_load(
            thread.url,
            ["Hello", "What is 2 + 2?", "Name a colour."],
            model=MODEL,
            max_concurrency=1,
            max_tokens=2,
            seed=1,
            progress=False,
        )
        wait_idle(engine)
    assert result.status_counts == {"200": 3}
    stats = window_stats(engine.engine.events, result.timings)
    assert stats["busy_fraction"] < 0.9 and stats["p99_ttft_ms"] - stats["engine_p99_ttft_ms"] > 1900, stats
    diagnosis = diagnose(stats)
    assert diagnosis.fault == "slow_dependency", str(diagnosis)
