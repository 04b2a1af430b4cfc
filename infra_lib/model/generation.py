"""Generation: one request from text to text, a token at a time.

    tokenize -> prefill (the whole prompt in one forward pass, filling the KV cache)
             -> decode  (one forward pass per new token, reading the cache)
             -> detokenize (bytes back to text, streamed as tokens arrive)

``stream()`` yields each token as soon as it exists; ``generate()`` collects them and the time
each stage took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from infra_lib.model.cache import DenseKVCache, KVCache
from infra_lib.model.model import Llama
from infra_lib.model.sampling import SamplingParams, sample
from infra_lib.model.tokenizer import Tokenizer

Prompt = "str | list[dict] | list[int]"


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, the text it completes (may be empty while a multi-byte
    character is unfinished), its index, and seconds since the request started."""

    token_id: int
    text: str
    index: int
    at: float


@dataclass
class Generation:
    """A finished request: tokens, text, why it stopped, and the stage times in seconds."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens)
    tokenize_s: float
    prefill_s: float
    decode_s: list[float] = field(default_factory=list)  # one entry per decode step
    detokenize_s: float = 0.0
    token_times: list[float] = field(default_factory=list)  # TokenEvent.at of each token

    @property
    def ttft_s(self) -> float:
        """Time to first token: tokenize + prefill (the first token comes out of prefill)."""
        return self.token_times[0] if self.token_times else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return len(self.decode_s) / sum(self.decode_s) if self.decode_s else float("nan")

    @property
    def total_s(self) -> float:
        return self.tokenize_s + self.prefill_s + sum(self.decode_s) + self.detokenize_s


def placement(model) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of a model's weights (CPU float32 for a stand-in without parameters)."""
    parameters = getattr(model, "parameters", None)
    weight = next(parameters(), None) if callable(parameters) else None
    return (weight.device, weight.dtype) if weight is not None else (torch.device("cpu"), torch.float32)


def prompt_ids(tokenizer: Tokenizer, prompt) -> list[int]:
    """Token ids for a prompt: a ``str`` is one user message in the chat template, a list of
    ``{"role", "content"}`` dicts a conversation, a list of ints already token ids."""
    if isinstance(prompt, str):
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return tokenizer.encode_chat(prompt)
    if (
        isinstance(prompt, (list, tuple))
        and prompt
        and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
    ):
        return list(prompt)
    raise ValueError("prompt must be a non-empty str, list of chat messages, or list of token ids")


@torch.inference_mode()
def stream(
    model: Llama,
    tokenizer: Tokenizer,
    prompt,
    params: SamplingParams = SamplingParams(),
    use_cache: bool = True,
    timings: Generation | None = None,
) -> Iterator[TokenEvent]:
    """Yield the generated tokens of one request, one ``TokenEvent`` at a time.

    Args:
        prompt: see ``prompt_ids``.
        params: sampling and stopping rules.
        use_cache: with False every step recomputes the whole sequence (to measure what the
            KV cache saves).
        timings: a ``Generation`` to fill with stage times as the stream runs (``generate`` uses it).
    """
    start = time.perf_counter()
    ids = prompt_ids(tokenizer, prompt)
    tokenized = time.perf_counter()
    context = model.config.max_position
    if len(ids) >= context:
        raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {context}")
    budget = min(params.max_new_tokens, context - len(ids))
    stops = set(params.stop_ids if params.stop_ids is not None else (tokenizer.eos_id,))
    generator = params.generator()
    decoder = tokenizer.stream_decoder(skip_special=True)
    device, dtype = placement(model)  # inputs and the cache live where the weights do
    cache: KVCache | None = (
        DenseKVCache.for_model(model.config, capacity=len(ids) + budget, dtype=dtype, device=device)
        if use_cache
        else None
    )
    record = timings if timings is not None else Generation(ids, [], "", "length", 0.0, 0.0)
    record.prompt_ids, record.tokenize_s = ids, tokenized - start

    sequence = list(ids)
    step_input = torch.tensor([ids], device=device)
    for index in range(budget):
        t0 = time.perf_counter()
        logits = model(step_input if use_cache else torch.tensor([sequence], device=device), cache, last_only=True)
        token = int(sample(logits[:, -1].float().cpu(), params, generator)[0])  # sampled on the CPU generator
        t1 = time.perf_counter()
        if index == 0:
            record.prefill_s = t1 - t0
        else:
            record.decode_s.append(t1 - t0)
        text = decoder.push(token)
        record.detokenize_s += time.perf_counter() - t1
        sequence.append(token)
        record.token_ids.append(token)
        record.text += text
        at = time.perf_counter() - start
        record.token_times.append(at)
        yield TokenEvent(token, text, index, at)
        if token in stops:
            record.finish_reason = "stop"
            break
        step_input = torch.tensor([[token]], device=device)
    tail = decoder.flush()
    if tail:
        record.text += tail
        yield TokenEvent(-1, tail, len(record.token_ids), time.perf_counter() - start)


def generate(
    model: Llama,
    tokenizer: Tokenizer,
    prompt,
    params: SamplingParams = SamplingParams(),
    use_cache: bool = True,
    on_token: Callable[[TokenEvent], None] | None = None,
) -> Generation:
    """Run one request to the end; ``on_token`` sees each token as it is produced (streaming)."""
    record = Generation([], [], "", "length", 0.0, 0.0)
    for event in stream(model, tokenizer, prompt, params, use_cache, timings=record):
        if on_token is not None:
            on_token(event)
    return record


@torch.inference_mode()
def greedy_decode(model: Llama, prompt: list[int], max_new_tokens: int, stop_id: int | None = None) -> list[int]:
    """The plainest cached decode loop: prefill the prompt once, then feed back one token per step.

    Returns the generated ids, ending with ``stop_id`` if it was produced.
    """
    device, dtype = placement(model)
    cache = DenseKVCache.for_model(model.config, capacity=len(prompt) + max_new_tokens, dtype=dtype, device=device)
    logits = model(torch.tensor([prompt], device=device), cache, last_only=True)  # prefill: [1, 1, vocab]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token == stop_id or len(out) == max_new_tokens:
            break
        logits = model(torch.tensor([[token]], device=device), cache, last_only=True)  # decode: one new token
    return out


def print_stream(event: TokenEvent) -> None:
    """An ``on_token`` that prints the text as it arrives."""
    print(event.text, end="", flush=True)
