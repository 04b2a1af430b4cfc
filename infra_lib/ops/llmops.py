"""LLMOps on the course's server: a model registry, an evaluation gate, a canary rollout, a rollback.

A new version of a model (another weight format, a fine-tune, a new build) reaches users in three
steps, each of which can stop it:

1. **Registry** (``Registry``): every version has a card with what was measured on it (perplexity,
   the RAG evidence score, decode speed, weight memory) and a stage: ``candidate``, ``production``,
   ``previous`` (the production it replaced), ``rejected`` (failed the gate) or ``rolled back``.
   The registry is one JSON file; every change of stage is an event with its reason.
2. **Evaluation gate** (``gate``): before it serves anyone, the candidate's quality must be within a
   tolerance of production's, on held-out text and on the RAG question set (how likely the model
   finds each question's evidence, given the retrieved passage).
3. **Canary** (``CanaryRouter``): an OpenAI-compatible front that sends a share of the traffic to
   the candidate's server and the rest to production's, records each version's requests, and asks
   a ``RolloutPolicy`` after every window of requests: roll back if the candidate's error rate or
   P99 latency crosses its threshold, else raise its share, and promote it once it has carried all
   the traffic for a window.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from fastapi import Request  # at module level: the routes' annotations are resolved here

STAGES = ("candidate", "production", "previous", "rejected", "rolled back")


# --- the version card and the registry ---------------------------------------------------------------


@dataclass
class VersionCard:
    """What was measured on one version of the model.

    Attributes:
        name: the version's id, e.g. ``smollm2-135m:int8``.
        weights: the weight format (``fp32``, ``int8 g64``, ``Q4_1 as stored``...).
        perplexity: on the held-out text (lower is better).
        evidence_nll: mean negative log-likelihood per token of the RAG questions' evidence, given
            the retrieved passage and the question (lower is better).
        tokens_per_s: greedy decode speed at batch 1 on this machine.
        weight_mb: the weights' memory.
    """

    name: str
    weights: str
    perplexity: float
    evidence_nll: float
    tokens_per_s: float
    weight_mb: float


class Registry:
    """The versions of a model, their cards and stages, in one JSON file (created on first write)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.exists():
            data = json.loads(self.path.read_text(encoding="utf-8"))
        else:
            data = {"versions": {}, "events": []}
        self.versions: dict[str, dict] = data["versions"]
        self.events: list[dict] = data["events"]

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.path.with_suffix(".tmp")
        scratch.write_text(json.dumps({"versions": self.versions, "events": self.events}, indent=1), encoding="utf-8")
        scratch.replace(self.path)

    def register(self, card: VersionCard) -> None:
        """Add a version as a candidate; ValueError if its name is taken."""
        if card.name in self.versions:
            raise ValueError(f"version {card.name!r} is already registered (stage {self.stage(card.name)!r})")
        self.versions[card.name] = {"card": asdict(card), "stage": "candidate"}
        self._event(card.name, "registered", "measured and added as a candidate")

    def card(self, name: str) -> VersionCard:
        return VersionCard(**self._get(name)["card"])

    def stage(self, name: str) -> str:
        return self._get(name)["stage"]

    @property
    def production(self) -> str | None:
        """The version serving everyone, or None before the first promotion."""
        return next((n for n, v in self.versions.items() if v["stage"] == "production"), None)

    def promote(self, name: str, why: str) -> None:
        """Make ``name`` production; the version it replaces becomes ``previous``."""
        current = self.production
        if current is not None and current != name:
            self._set(current, "previous", f"replaced by {name}")
        self._set(name, "production", why)

    def reject(self, name: str, why: str) -> None:
        self._set(name, "rejected", why)

    def roll_back(self, name: str, why: str) -> None:
        self._set(name, "rolled back", why)

    def _get(self, name: str) -> dict:
        if name not in self.versions:
            raise KeyError(f"no version {name!r} in the registry; known: {sorted(self.versions)}")
        return self.versions[name]

    def _set(self, name: str, stage: str, why: str) -> None:
        assert stage in STAGES, stage
        self._get(name)["stage"] = stage
        self._event(name, stage, why)

    def _event(self, name: str, event: str, why: str) -> None:
        self.events.append({"time": time.time(), "version": name, "event": event, "why": why})
        self._save()


# --- measuring a version -----------------------------------------------------------------------------


def evidence_nll(model, tokenizer, items: list[tuple[str, str, str]]) -> float:
    """Mean negative log-likelihood per token of each item's evidence, given its passage and question.

    ``items``: (passage, question, evidence). The prompt is a chat turn holding the passage and the
    question; the evidence is scored as the start of the model's reply. A version that reads its
    context worse (or is broken) finds the evidence less likely."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.inference_mode():
        for passage, question, evidence in items:
            prompt = tokenizer.encode_chat(
                [{"role": "user", "content": f"Passage:\n{passage}\n\nQuestion: {question}"}]
            )
            answer = tokenizer.encode(evidence, allow_special=False)
            ids = torch.tensor([prompt + answer], device=device)
            logits = model(ids)[0, len(prompt) - 1 : -1].float()
            total += float(F.cross_entropy(logits, ids[0, len(prompt) :], reduction="sum"))
            count += len(answer)
    return total / count


def decode_speed(model, prompt_ids: list[int], new_tokens: int = 16) -> float:
    """Greedy decode tokens per second at batch 1 (the prompt's prefill excluded)."""
    import torch

    from infra_lib.model import DenseKVCache

    cache = DenseKVCache.for_model(model.config, capacity=len(prompt_ids) + new_tokens + 1)
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids], device=device), cache, last_only=True)
        token = int(logits[0, -1].argmax())
        started = time.perf_counter()
        for _ in range(new_tokens):
            logits = model(torch.tensor([[token]], device=device), cache, last_only=True)
            token = int(logits[0, -1].argmax())
    return new_tokens / (time.perf_counter() - started)


def measure(
    name: str,
    weights: str,
    model,
    tokenizer,
    heldout_ids: list[int],
    rag_items: list[tuple[str, str, str]],
    *,
    decode_tokens: int = 16,
) -> VersionCard:
    """The card of one version: perplexity, RAG evidence score, decode speed and weight memory."""
    from infra_lib.model.quant import perplexity, weight_bytes

    return VersionCard(
        name=name,
        weights=weights,
        perplexity=perplexity(model, heldout_ids),
        evidence_nll=evidence_nll(model, tokenizer, rag_items),
        tokens_per_s=decode_speed(model, heldout_ids[:32], decode_tokens),
        weight_mb=weight_bytes(model) / 1e6,
    )


def rag_items(questions, documents, limit: int, window: int = 600) -> list[tuple[str, str, str]]:
    """(passage, question, evidence) for the first ``limit`` questions: the passage is the text around
    the evidence in its document (``window`` characters), the retrieval every version shares."""
    texts = {doc.doc_id: doc.text for doc in documents}
    items = []
    for q in questions[:limit]:
        text = texts[q.doc_id]
        start = max(0, q.start - window // 2)
        items.append((text[start : start + window], q.question, q.evidence))
    return items


# --- the evaluation gate -----------------------------------------------------------------------------


@dataclass
class GateResult:
    passed: bool
    reasons: list[str]


def gate(
    candidate: VersionCard,
    current: VersionCard,
    *,
    perplexity_tolerance: float = 0.05,
    evidence_tolerance: float = 0.05,
) -> GateResult:
    """Whether ``candidate`` may serve: its perplexity and its RAG evidence score no more than the
    tolerances (relative) worse than ``current``'s. Speed and memory are reported, not gated: a
    slower version is the canary's business.

    The rule, score by score: ``candidate_score <= current_score * (1 + tolerance)``, the product
    computed in floating point, so a score exactly on that limit passes (16.8 against 16.0 at 5%).
    A candidate score that is nan or infinite (an evaluation that diverged) fails. A current score
    of 0 allows nothing above 0.

    Raises:
        ValueError: a tolerance that is negative or not a finite number, or a current score that is
            nan, infinite or negative (production's card is broken: there is nothing to compare with).
    """
    scores = (
        ("perplexity", current.perplexity, candidate.perplexity, perplexity_tolerance),
        ("RAG evidence NLL", current.evidence_nll, candidate.evidence_nll, evidence_tolerance),
    )
    for what, theirs, _, tolerance in scores:
        if not (math.isfinite(tolerance) and tolerance >= 0):
            raise ValueError(f"the {what} tolerance must be a finite fraction >= 0 (0.05 is 5%), got {tolerance!r}")
        if not (math.isfinite(theirs) and theirs >= 0):
            raise ValueError(
                f"{current.name}'s {what} is {theirs!r}: the current version's scores must be finite "
                "and >= 0 to compare a candidate with; measure it again"
            )
    reasons = []
    for what, theirs, ours, tolerance in scores:
        limit = theirs * (1 + tolerance)
        ok = math.isfinite(ours) and ours <= limit
        reasons.append(
            f"{what} {ours:.3f} against {theirs:.3f} for {current.name} "
            f"({'within' if ok else 'past'} the limit {limit:.3f})"
        )
        if not ok:
            return GateResult(False, reasons)
    return GateResult(True, reasons)


# --- the canary --------------------------------------------------------------------------------------


@dataclass
class RolloutPolicy:
    """When a canary rolls back, moves on, or is promoted.

    Attributes:
        shares: the candidate's share of the traffic at each step, ending at 1.0.
        window: requests the candidate must have served at a step before the step is judged.
        max_error_rate: the candidate's share of failed requests that rolls it back.
        max_p99_ratio / max_p99_added_s: the candidate's P99 latency rolls it back once it is more
            than ``max_p99_ratio`` times production's or more than ``max_p99_added_s`` above it,
            whichever comes first: a ratio alone would forgive a fixed added delay whenever load
            slows production too, an addition alone would forgive a version twice as slow on a
            fast server.
        min_p99_s: below this P99 latency a ratio is noise, never a reason to roll back.
        baseline: production's latest requests in the rollout that its P99 is taken over.
    """

    shares: tuple[float, ...] = (0.1, 0.5, 1.0)
    window: int = 10
    max_error_rate: float = 0.1
    max_p99_ratio: float = 2.0
    max_p99_added_s: float = 1.0
    min_p99_s: float = 0.05
    baseline: int = 50

    def judge(self, candidate: list["Served"], production: list["Served"]) -> tuple[str, str]:
        """("rollback" | "advance", why) for one step's requests."""
        errors = sum(not s.ok for s in candidate) / max(1, len(candidate))
        if errors > self.max_error_rate:
            return "rollback", f"error rate {errors:.0%} above {self.max_error_rate:.0%}"
        ours = p99([s.latency_s for s in candidate if s.ok])
        theirs = p99([s.latency_s for s in production if s.ok])
        if (
            ours > self.min_p99_s
            and theirs > 0
            and ours > min(self.max_p99_ratio * theirs, theirs + self.max_p99_added_s)
        ):
            return "rollback", (
                f"P99 latency {ours * 1000:.0f} ms, {ours / theirs:.1f}x production's {theirs * 1000:.0f} ms "
                f"({(ours - theirs) * 1000:.0f} ms more)"
            )
        return "advance", (
            f"error rate {errors:.0%}, P99 {ours * 1000:.0f} ms against production's {theirs * 1000:.0f} ms"
            if theirs
            else f"error rate {errors:.0%}, P99 {ours * 1000:.0f} ms"
        )


def p99(values: list[float]) -> float:
    from infra_lib.ops.latency import percentile

    return percentile(values, 99) if values else 0.0


@dataclass
class Served:
    """One request the router forwarded."""

    version: str
    started: float
    latency_s: float
    ok: bool
    step: int
    share: float


@dataclass
class Rollout:
    """The state of one canary rollout (``CanaryRouter.rollout``, ``simulate_rollout``).

    ``judge``, when given, decides each step instead of ``policy.judge``: a function
    ``(candidate, production, policy) -> "rollback" | "advance"`` (or a ``(verdict, why)`` pair) over
    the step's candidate requests and production's baseline, both lists of ``Served``. Lab 10's
    ``canary_verdict`` plugs in here.
    """

    production: str
    candidate: str
    policy: RolloutPolicy
    step: int = 0
    outcome: str = "running"  # then "promoted" or "rolled back"
    served: list[Served] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    judge: Callable | None = None

    @property
    def share(self) -> float:
        """The candidate's share of new requests now (0 after a rollback, 1 after a promotion)."""
        if self.outcome == "rolled back":
            return 0.0
        if self.outcome == "promoted":
            return 1.0
        return self.policy.shares[self.step]

    def _verdict(self, ours: list[Served], baseline: list[Served]) -> tuple[str, str]:
        if self.judge is None:
            return self.policy.judge(ours, baseline)
        answer = self.judge(list(ours), list(baseline), self.policy)
        verdict, why = answer if isinstance(answer, tuple) and len(answer) == 2 else (answer, "")
        if verdict not in ("rollback", "advance"):
            raise ValueError(f"a rollout's judge must answer 'rollback' or 'advance', got {verdict!r:.60}")
        return verdict, str(why) or f"the judge said {verdict}"

    def record(self, served: Served, now: float | None = None) -> dict | None:
        """Add one finished request. Once the candidate has served ``policy.window`` requests at the
        current step, judge the step and move the rollout on: back (``"rolled back"``), to the next
        share, or, after the last share, ``"promoted"``. Returns that decision, or None."""
        self.served.append(served)
        if self.outcome != "running" or served.version != self.candidate:
            return None
        ours = [s for s in self.served if s.step == self.step and s.version == self.candidate]
        if len(ours) < self.policy.window:
            return None
        # Production's baseline: its latest requests of the rollout (at 100% the step has none of its own).
        baseline = [s for s in self.served if s.version == self.production][-self.policy.baseline :]
        verdict, why = self._verdict(ours, baseline)
        decision = {
            "time": time.time() if now is None else now,
            "step": self.step,
            "share": self.share,
            "verdict": verdict,
            "why": why,
        }
        self.decisions.append(decision)
        if verdict == "rollback":
            self.outcome = "rolled back"
        elif self.step + 1 < len(self.policy.shares):
            self.step += 1
        else:
            self.outcome = "promoted"
        return decision


# How each simulated candidate serves, against production's latency (log-normal, median 0.8 s):
# its median latency, a fixed delay added to every request, and its share of failed requests.
BEHAVIOURS = {
    "faster": {"median_s": 0.6, "delay_s": 0.0, "errors": 0.0},  # int8: less memory traffic per token
    "same": {"median_s": 0.8, "delay_s": 0.0, "errors": 0.0},
    "flaky": {"median_s": 0.8, "delay_s": 0.0, "errors": 0.2},  # one request in five fails
    "slow": {"median_s": 0.8, "delay_s": 2.0, "errors": 0.0},  # a slow dependency in front of it
    "sluggish": {"median_s": 1.9, "delay_s": 0.0, "errors": 0.0},  # 2.4x slower, with no fixed delay
}


def simulate_rollout(
    behaviour: str,
    policy: RolloutPolicy | None = None,
    judge: Callable | None = None,
    seed: int = 0,
    requests: int = 600,
    rate: float = 4.0,
) -> Rollout:
    """A canary rollout on a simulated clock: ``requests`` arrive at ``rate`` per second, each goes to
    the candidate with the rollout's share of the moment, and takes a seeded latency of its version
    (production: log-normal with a median of 0.8 s; the candidate: ``BEHAVIOURS[behaviour]``). Every
    request finishes in arrival order into ``Rollout.record``, as the router records them, until the
    rollout ends. The same seed gives the same requests whatever the judge decides, request by request."""
    if behaviour not in BEHAVIOURS:
        raise ValueError(f"unknown behaviour {behaviour!r}; one of {', '.join(BEHAVIOURS)}")
    if requests < 1 or rate <= 0:
        raise ValueError(f"need requests >= 1 and rate > 0, got {requests} and {rate}")
    rollout = Rollout("production", behaviour, policy or RolloutPolicy(), judge=judge)
    rng = random.Random(seed)
    for i in range(requests):
        pick, noise, fails = rng.random(), rng.gauss(0.0, 0.35), rng.random()
        started = i / rate
        if pick < rollout.share:
            b = BEHAVIOURS[behaviour]
            latency, ok = b["median_s"] * math.exp(noise) + b["delay_s"], fails >= b["errors"]
            version = rollout.candidate
        else:
            latency, ok, version = 0.8 * math.exp(noise), True, rollout.production
        rollout.record(Served(version, started, latency, ok, rollout.step, rollout.share), now=started + latency)
        if rollout.outcome != "running":
            break
    return rollout


class CanaryRouter:
    """An OpenAI-compatible front for two servers of the same API: each request goes to the candidate
    with the rollout's current share, else to production; streamed responses are passed through as
    they arrive. After every ``policy.window`` candidate requests the policy judges the step; a
    rollback or a promotion is written to the registry at once.

    Args:
        upstreams: version name -> the base URL of the server running it (both versions).
        registry: where the outcome is recorded (the candidate must be registered).
        seed: the random choice of version per request.
        judge: decides each step instead of ``policy.judge`` (see ``Rollout``).
    """

    def __init__(
        self,
        upstreams: dict[str, str],
        registry: Registry,
        candidate: str,
        policy: RolloutPolicy | None = None,
        seed: int = 0,
        judge: Callable | None = None,
    ):
        production = registry.production
        if production is None or production not in upstreams or candidate not in upstreams:
            raise ValueError(f"the router needs a server for production ({production}) and the candidate ({candidate})")
        if registry.stage(candidate) != "candidate":
            raise ValueError(f"{candidate} is {registry.stage(candidate)!r}, not a candidate")
        self.upstreams, self.registry = dict(upstreams), registry
        self.rollout = Rollout(production, candidate, policy or RolloutPolicy(), judge=judge)
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def _choose(self) -> tuple[str, int, float]:
        with self._lock:
            share, step = self.rollout.share, self.rollout.step
            use_candidate = self._random.random() < share
        return (self.rollout.candidate if use_candidate else self.rollout.production), step, share

    def _record(self, served: Served) -> None:
        with self._lock:
            rollout = self.rollout
            decision = rollout.record(served)
            if decision is None:
                return
            if rollout.outcome == "rolled back":
                self.registry.roll_back(rollout.candidate, f"canary at {decision['share']:.0%}: {decision['why']}")
            elif rollout.outcome == "promoted":
                self.registry.promote(rollout.candidate, f"canary served all traffic for a window: {decision['why']}")

    def app(self):
        """The FastAPI app: ``/v1/chat/completions`` and ``/v1/completions`` routed, ``/rollout`` its state."""
        import httpx
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(title="canary router")
        client = httpx.AsyncClient(timeout=httpx.Timeout(300.0))

        @app.get("/rollout")
        async def state():
            r = self.rollout
            return {
                "production": r.production,
                "candidate": r.candidate,
                "outcome": r.outcome,
                "share": r.share,
                "decisions": r.decisions,
                "served": {v: sum(s.version == v for s in r.served) for v in (r.production, r.candidate)},
            }

        async def forward(request: Request, path: str):
            version, step, share = self._choose()
            body = await request.body()
            started = time.perf_counter()
            upstream = client.build_request(
                "POST", self.upstreams[version] + path, content=body, headers={"content-type": "application/json"}
            )
            try:
                response = await client.send(upstream, stream=True)
            except httpx.HTTPError as exc:
                self._record(Served(version, started, time.perf_counter() - started, False, step, share))
                return JSONResponse(
                    {"error": {"message": f"upstream {version} failed: {exc}", "type": "upstream_error"}},
                    status_code=502,
                )

            async def relay():
                # Served well: a 200 whose body reached its end, or a stream that reached "data: [DONE]"
                # (a client may hang up as soon as it reads that line, before the upstream's body ends).
                ok, finished, tail = response.status_code == 200, False, b""
                try:
                    async for chunk in response.aiter_raw():
                        tail = (tail + chunk)[-64:]
                        finished = finished or b"data: [DONE]" in tail
                        yield chunk
                    finished = True
                finally:
                    await response.aclose()
                    self._record(Served(version, started, time.perf_counter() - started, ok and finished, step, share))

            return StreamingResponse(
                relay(),
                status_code=response.status_code,
                media_type=response.headers.get("content-type"),
                headers={"x-served-by": version},
            )

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await forward(request, "/v1/chat/completions")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await forward(request, "/v1/completions")

        return app
