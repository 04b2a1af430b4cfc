"""Answers to labs 06-08 written from the learner notebooks' text alone, the plain way a learner writes them.

Lab 06: ``rms_norm``, ``rope``, ``Llama``, ``causal_mask``, ``repeat_kv``, ``cached_attention``; lab 07:
``BlockPool`` and ``forward_step``; lab 08: ``schedule`` and ``engine_step``. Nothing here is tuned for
speed where the labs' text does not ask for it: attention is the plain softmax of masked scores, the
batched step attends one sequence at a time, and the scheduler and the engine step follow the rules in
the order the text gives them.

Kept so that the capstone's race (``benchmarks/capstone.py``) and the tests can measure how close a learner
who follows the labs gets to the course's engine: ``engine_pieces()`` gives the pieces by the names the
capstone's engine takes, ``lab_functions()`` gives them per lab, in the shape lab 16's checks take.
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.nn.functional as F
from torch import nn

from infra_lib.serving.errors import OutOfBlocks
from infra_lib.serving.scheduler_output import SchedulerOutput

# --- lab 06: the model and its KV cache ---------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x normalised to unit root mean square over its last dimension, then scaled by weight."""
    mean_square = (x * x).mean(dim=-1, keepdim=True)
    return x / torch.sqrt(mean_square + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [batch, heads, t, head_dim] rotated by the rotary embedding at positions [t] (rotate-half layout)."""
    hd = x.shape[-1]
    half = hd // 2
    i = torch.arange(half, device=x.device, dtype=torch.float32)
    speeds = theta ** (-2 * i / hd)  # [hd/2]
    angles = positions.to(x.device, torch.float32)[:, None] * speeds[None, :]  # [t, hd/2]
    cos, sin = torch.cos(angles).to(x.dtype), torch.sin(angles).to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def causal_mask(t: int, s: int) -> torch.Tensor:
    """[t, s] booleans: True where query i (at position s - t + i) may see key j."""
    rows = torch.arange(t)[:, None] + (s - t)
    cols = torch.arange(s)[None, :]
    return cols <= rows


def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """Repeat each key/value head `group` times in a row, for the query heads that share it."""
    if group == 1:
        return x
    return torch.repeat_interleave(x, group, dim=1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention of q [batch, n_heads, t, hd] over the last-aligned keys/values
    [batch, n_kv_heads, s, hd]: query i sits at position s - t + i."""
    group = q.shape[1] // keys.shape[1]
    keys, values = repeat_kv(keys, group), repeat_kv(values, group)
    t, s = q.shape[2], keys.shape[2]
    scores = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~causal_mask(t, s).to(q.device), float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, d: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, intermediate, bias=False)
        self.up_proj = nn.Linear(d, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(d, config.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, config.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, config.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.n_heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        batch, t, _ = x.shape
        q = self.q_proj(x).view(batch, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        positions = torch.arange(t, device=x.device)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, t, cfg.n_heads * cfg.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """A Llama-family decoder with the parameter names and shapes of lab 06's contract."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [batch, heads, t, head_dim] rotated at positions [t], base config.rope_theta."""
        return rope(x, positions, self.config.rope_theta)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [batch, t, vocab] of tokens [batch, t], the whole sequence at once (no cache)."""
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x)).float()


def cached_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache) -> torch.Tensor:
    """Append this call's keys/values to `cache`, then causal GQA attention over all cached tokens."""
    keys, values = cache.append(k_new, v_new)
    return attend(q, keys, values)


# --- lab 07: the block pool and the batched step --------------------------------------------------------


class BlockPool:
    """Reference-counted KV blocks with an LRU free queue and copy-on-write."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks  # how many block tables hold each block
        self.free_queue = deque(range(num_blocks))  # the blocks with count 0; the front is handed out next

    def _check_id(self, block_id: int) -> int:
        """``block_id``, or ValueError when it is not a block of this pool."""
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id!r} is not in 0..{self.num_blocks - 1}")
        return block_id

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def ref_count(self, block_id: int) -> int:
        return self.ref_counts[self._check_id(block_id)]

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if type(n) is not int or n < 0:
            raise ValueError(f"allocate needs a non-negative int, got {n!r}")
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free, self.num_blocks)
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, block_ids: list[int]) -> None:
        times = {}
        for b in block_ids:
            self._check_id(b)
            times[b] = times.get(b, 0) + 1
        for b, n in times.items():
            if n > self.ref_counts[b]:
                raise ValueError(f"block {b} freed {n} times but held {self.ref_counts[b]} times (double free)")
        for b in block_ids:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue.append(b)

    def fork(self, block_ids: list[int]) -> list[int]:
        for b in block_ids:
            if self.ref_counts[self._check_id(b)] == 0:
                raise ValueError(f"block {b} is free: only held blocks can be shared")
        for b in block_ids:
            self.ref_counts[b] += 1
        return list(block_ids)

    def prepare_write(self, block_id: int) -> tuple[int, int | None]:
        if self.ref_counts[self._check_id(block_id)] == 0:
            raise ValueError(f"block {block_id} is free: nobody can write into it")
        if self.ref_counts[block_id] == 1:
            return block_id, None
        if not self.free_queue:
            raise OutOfBlocks(1, 0, self.num_blocks)
        new_id = self.free_queue.popleft()
        self.ref_counts[new_id] = 1
        self.ref_counts[block_id] -= 1
        return new_id, block_id


def forward_step(model, store, batch):
    """One forward pass over one scheduler plan: writes each scheduled token's keys and values (after RoPE)
    into its slot of ``store`` in every layer, and returns the logits ``[num_sampling, vocab]`` of the last
    scheduled token of each sequence whose ``samples`` is true, in batch order."""
    cfg = model.config
    n_heads, n_kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    bs = store.block_size
    device = model.embed_tokens.weight.device

    def slot(seq, p):
        return seq.block_table.blocks[p // bs] * bs + p % bs

    ids, positions, slots = [], [], []
    for seq, s in batch:
        for p in range(s.start, s.context_len):
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(slot(seq, p))
    n = len(ids)
    if n == 0:
        return torch.zeros(0, cfg.vocab_size, device=device)
    positions = torch.tensor(positions, device=device)
    slots = torch.tensor(slots, device=device)
    context_slots = [torch.tensor([slot(seq, p) for p in range(s.context_len)], device=device) for seq, s in batch]

    x = model.embed_tokens(torch.tensor([ids], device=device))  # [1, n, d]
    for i, layer in enumerate(model.layers):
        h = layer.input_layernorm(x)
        attn = layer.self_attn
        q = attn.q_proj(h).view(1, n, n_heads, hd).transpose(1, 2)
        k = attn.k_proj(h).view(1, n, n_kv, hd).transpose(1, 2)
        v = attn.v_proj(h).view(1, n, n_kv, hd).transpose(1, 2)
        q, k = model.rope(q, positions), model.rope(k, positions)
        k_rows = store.k[i].view(-1, n_kv, hd)  # one row per slot
        v_rows = store.v[i].view(-1, n_kv, hd)
        k_rows[slots] = k[0].transpose(0, 1).to(k_rows.dtype)
        v_rows[slots] = v[0].transpose(0, 1).to(v_rows.dtype)
        outs, row = [], 0
        for (_, s), ctx in zip(batch, context_slots):
            keys = k_rows[ctx].permute(1, 0, 2).unsqueeze(0).to(q.dtype)  # [1, n_kv, context_len, hd]
            values = v_rows[ctx].permute(1, 0, 2).unsqueeze(0).to(q.dtype)
            outs.append(attend(q[:, :, row : row + s.num_tokens], keys, values))
            row += s.num_tokens
        out = torch.cat(outs, dim=2).transpose(1, 2).reshape(1, n, n_heads * hd)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))

    last_rows, row = [], 0
    for _, s in batch:
        row += s.num_tokens
        if s.samples:
            last_rows.append(row - 1)
    if not last_rows:
        return torch.zeros(0, cfg.vocab_size, device=device)
    hidden = model.norm(x[0, last_rows])
    return model.lm_head(hidden).float()


# --- lab 08: the scheduler and the engine step ----------------------------------------------------------


def finish_plan(self, out: SchedulerOutput) -> SchedulerOutput:
    """Given by lab 08: counts the step, books the scheduled tokens and the queue sizes, returns ``out``."""
    self.num_steps += 1
    self._scheduled = {s.seq_id: s.num_tokens for s in out.scheduled}
    out.num_running, out.num_waiting, out.num_free_blocks = len(self.running), len(self.waiting), self.pool.num_free
    return out


def schedule(self) -> SchedulerOutput:
    """Plan one engine step: running sequences oldest first (preempting the newest when blocks run
    out), then admissions from the waiting queue in arrival order, within the token budget."""
    budget = self.config.max_num_batched_tokens
    out = SchedulerOutput(self.num_steps, budget)
    left = budget

    # running sequences first, oldest first
    for seq in list(self.running):
        if seq not in self.running:
            break  # preempted for an older one: it and everything after it wait
        if left == 0:
            break
        n = min(seq.num_uncomputed_tokens, left)
        preempted_self = False
        while not self.can_reserve(seq, n):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim.seq_id)
            if victim is seq:
                preempted_self = True
                break
        if preempted_self:
            break
        self.reserve(seq, n)
        out.add(seq, n)
        left -= n

    # then admissions, first come first served, only in a step that preempted nobody
    if not out.preempted:
        while self.waiting and left > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self.cached_tokens(seq)
            todo = seq.num_tokens - cached
            if self.config.enable_chunked_prefill:
                n = min(todo, left)
            elif todo <= left:
                n = todo
            else:
                break
            if not self.can_admit(seq, n):
                break
            self.admit(seq, n)
            out.admitted.append(seq.seq_id)
            out.num_cached_tokens[seq.seq_id] = cached
            out.add(seq, n)
            left -= n

    return finish_plan(self, out)


def engine_step(engine) -> list:
    """One step of the engine: plan, run the model, append the sampled tokens, end the requests that
    stop, and return the outputs of the requests that got a token, with what the step added."""
    out = engine.scheduler.schedule()
    batch = engine.begin_step(out)
    if not batch:
        return []
    sampled = engine.runner.run(batch)
    engine.scheduler.commit(out)

    outputs = []
    for seq, _ in batch:
        if seq.seq_id not in sampled:
            continue
        token = int(sampled[seq.seq_id])
        shown_before = engine.output(seq.seq_id).text
        seq.append_token(token)
        engine.record_token(seq)
        decoder = engine.decoder(seq.seq_id)
        seq.text += decoder.push(token)

        stop_token = token in seq.stop_ids
        at_length = seq.num_tokens >= seq.max_tokens
        if stop_token or at_length:
            seq.text += decoder.flush()
        cut = None
        for stop in seq.stop_strings:
            found = seq.text.find(stop)
            if found != -1 and (cut is None or found < cut):
                cut = found
        if cut is not None:
            seq.text = seq.text[:cut]
            engine.finish(seq, "stop")
        elif stop_token:
            engine.finish(seq, "stop")
        elif at_length:
            engine.finish(seq, "length")

        shown_after = engine.output(seq.seq_id).text
        outputs.append(engine.output(seq.seq_id, [token], shown_after[len(shown_before) :]))
    return outputs


# --- the pieces, by name and per lab ----------------------------------------------------------------------


def engine_pieces() -> dict:
    """The pieces by the names the capstone's engine takes."""
    return {
        "Llama": Llama,
        "cached_attention": cached_attention,
        "BlockPool": BlockPool,
        "forward_step": forward_step,
        "schedule": schedule,
        "engine_step": engine_step,
    }


def lab06() -> dict:
    return {
        "rms_norm": rms_norm,
        "rope": rope,
        "Llama": Llama,
        "causal_mask": causal_mask,
        "repeat_kv": repeat_kv,
        "cached_attention": cached_attention,
    }


def lab07() -> dict:
    return {"BlockPool": BlockPool, "forward_step": forward_step}


def lab08() -> dict:
    return {"schedule": schedule, "engine_step": engine_step}


def lab_functions() -> dict:
    """One function per lab returning that lab's pieces, the shape lab 16's checks take."""
    return {"lab06_kv_cache": lab06, "lab07_paged_kv": lab07, "lab08_scheduler": lab08}
