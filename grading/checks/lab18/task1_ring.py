"""Lab 18 task 1: ring attention. ``ring_attention_step(q, k_block, v_block, state, causal_kind)`` folds one K/V block
into the online softmax state ``(row_max, row_sum, acc)``; ``ring_attention(q, k, v, comm, causal=True)`` passes the
blocks around the ring and finishes the output; the bonus ``ring_attention_backward`` returns dq, dk, dv.

The step is driven on seeded block sequences from the empty state; its state after every step is compared with the
course's. The ring and the backward run every rank as a thread of the kernel, exchanging tensors through a
``ThreadGroup`` whose ``exchange`` records, per rank, the bytes sent, the peers and the calls; a rank left waiting for
a message no rank sent stops its case after ``RANK_TIMEOUT_S`` and is named. Each rank's output (or gradients) is
compared with full attention on the whole sequence, computed by the driver in plain torch and read from the reference's
side only (the reference's own ring must match it too, else the course is at fault). The driver also computes what the
usual mistakes give (the max not rescaled, the masks wrong across ranks, the output left unnormalised); the
comparison names the one a learner's data matches.
"""

from __future__ import annotations

import math
import random
import threading

from grading.check import TRAFFIC
from grading.checks.common import array_mismatch, reference
from grading.checks.lab18.tasks import RING_SECTION, TASKS
from grading.registry import Check, Mismatch, ReferenceFailed, register

TASK = TASKS[1]
RANK_TIMEOUT_S = 3.0  # these rings take milliseconds; a rank still waiting after this never gets its message
_TOLERANCE = {"float32": (1e-5, 1e-4), "float64": (1e-10, 1e-9)}  # (atol, rtol)

STATE_HINT = (
    "the state is (row_max, row_sum, acc): row_max [B, H, t] the largest scaled score each query row has met, "
    "row_sum [B, H, t] the sum of exp(score - row_max) over the keys met, acc [B, H, t, D] the same weights times the "
    f"values; each step returns the state after one more block ({RING_SECTION})"
)
HINTS = {
    "no_rescale": (
        "the running max must rescale what is already accumulated: when a block raises a row's max, the sum and the "
        "accumulator gathered under the old max are too large by exp(old max - new max) and must shrink by it before "
        f"the block's own terms are added ({RING_SECTION})"
    ),
    "strict_diagonal": (
        "in the diagonal block query i sees keys 0..i of its own slice, itself included: only keys after it are hidden"
    ),
    "past_hidden": (
        "the diagonal mask hides the future: query i sees keys j <= i of its own slice, not j >= i (a causal model "
        "reads only what came before)"
    ),
    "diagonal_unmasked": (
        "a 'diagonal' block is the queries' own slice of the sequence: query i must not see keys after it, so the "
        "block needs the causal mask that a 'full' block does not"
    ),
    "full_masked": "a 'full' block is wholly visible (an earlier rank's keys, or no causal mask): mask nothing in it",
    "unscaled": "scores are q . k / sqrt(head_dim), as in full attention, before the max and the exponentials",
    "all_diagonal": (
        "only a rank's own block is diagonal: a block from an earlier rank lies wholly in the queries' past, so all "
        "its keys are visible ('full'); the mask inside a block applies where query and keys share a slice "
        f"({RING_SECTION})"
    ),
    "no_skip": (
        "under the causal mask a block from a later rank lies wholly in the queries' future: fold none of it in (skip "
        "its compute) while still forwarding it around the ring"
    ),
    "own_block": (
        "the queries need every earlier rank's keys: each of the W - 1 blocks that reach a rank around the ring is "
        "folded in (or skipped, when the causal mask hides it), not only the rank's own"
    ),
    "unmasked": (
        "with causal=True the whole sequence is causal: later ranks' blocks are skipped and the own block masked"
    ),
    "masked": "with causal=False every query sees every key: every block, the own one too, is 'full'",
    "unnormalised": (
        "the final normalisation: after the last block the output of each query row is acc divided by row_sum, the "
        "softmax's denominator"
    ),
    "deadlock": (
        "every rank calls exchange exactly W - 1 times, sending to rank + 1 and receiving from rank - 1, also at steps "
        "whose block it skips: its neighbour's receive waits for the block it forwards, and a block reaches the rank j "
        "places along the ring in j hops"
    ),
    "traffic": (
        "each rank forwards its own K and V block and every block it receives, W - 1 exchanges with rank + 1 in all, "
        "so each block is sent exactly W - 1 times and every rank sends (W - 1) x (its K and V bytes); sending a block "
        "straight to every rank (an all-gather) or a W-th time around moves the same keys at more cost or out of ring "
        "order"
    ),
    "values": (
        "each rank's output is full attention of its query slice over the whole sequence: its own block under the "
        "diagonal mask, earlier ranks' blocks whole, later ranks' not at all, merged with the online softmax and "
        f"normalised once at the end ({RING_SECTION})"
    ),
    "backward": (
        "dq, dk, dv of a rank's slice are full attention's gradients: each visible block's probabilities are "
        "recomputed from the saved lse (no second softmax), the softmax's backward subtracts each query row's dot "
        "product of its output gradient with its output, the causal rule of the forward holds again, and the dK/dV "
        f"partial sums travel the ring with their block ({RING_SECTION})"
    ),
    "home": (
        "after W - 1 steps each rank holds the complete dK/dV of the block of rank + 1: one more hop to rank + 1 "
        "takes every block's gradients home"
    ),
    "backward_traffic": (
        "the backward sends, per rank, W - 1 exchanges of K, V and their dK, dV partial sums, then one of dK, dV "
        "home: (W - 1) x 4 + 2 blocks"
    ),
}


# --- cases ----------------------------------------------------------------------------------------------------


def _step_case(rng, batch, heads, t, head_dim, dtype, steps, refuse=None) -> dict:
    """steps: [kind, key rows, magnitude] per block (magnitude scales the block's keys: a larger one raises the max);
    refuse: a causal_kind the step must refuse with ValueError afterwards."""
    return {
        "refuse": refuse,
        "batch": batch,
        "heads": heads,
        "t": t,
        "head_dim": head_dim,
        "dtype": dtype,
        "steps": steps,
        "seed": rng.randrange(10**6),
    }


def step_cases(rng: random.Random) -> list[dict]:
    """Own block then earlier blocks whose keys raise the max, or lower it; a non-causal start; one query row."""
    t = rng.choice([3, 5])
    return [
        _step_case(rng, 1, 2, t, 8, "float32", [["diagonal", t, 1.0], ["full", t, 3.0], ["full", t, 0.5]]),
        _step_case(rng, 2, 3, 4, 5, "float64", [["full", 4, 1.0], ["full", 4, 4.0], ["diagonal", 4, 0.3]]),
        _step_case(rng, 1, 1, 1, 4, "float32", [["diagonal", 1, 1.0], ["full", 1, 5.0]]),
    ]


def step_edge_cases(rng: random.Random) -> list[dict]:
    """head_dim 1, scores near 10^2 (exp overflows float32 without the max), six steps, key blocks of another length,
    and a causal_kind to refuse."""
    return [
        _step_case(rng, 1, 1, 6, 1, "float32", [["diagonal", 6, 1.0], ["full", 6, 2.0]]),
        _step_case(rng, 2, 2, 3, 16, "float32", [["diagonal", 3, 30.0], ["full", 3, 60.0], ["full", 3, 10.0]]),
        _step_case(rng, 1, 2, 4, 6, "float64", [["diagonal", 4, 1.0]] + [["full", 4, m] for m in (2, 0.5, 6, 1, 9)]),
        _step_case(rng, 3, 1, 2, 3, "float64", [["full", 5, 1.0], ["full", 1, 7.0], ["diagonal", 2, 2.0]], "causal"),
    ]


def _ring_case(rng, world, t, dtype="float32", causal=True, batch=1, heads=2, head_dim=8, magnitude=1.0) -> dict:
    return {
        "world": world,
        "t": t,
        "dtype": dtype,
        "causal": causal,
        "batch": batch,
        "heads": heads,
        "head_dim": head_dim,
        "magnitude": magnitude,
        "seed": rng.randrange(10**6),
    }


def ring_cases(rng: random.Random) -> list[dict]:
    """2, 3 and 4 ranks with odd slices, float64 on 4, and a non-causal ring."""
    return [
        _ring_case(rng, 2, rng.choice([3, 5])),
        _ring_case(rng, 3, 3, batch=2, heads=3, head_dim=4),
        _ring_case(rng, 4, rng.choice([5, 7]), dtype="float64", head_dim=16),
        _ring_case(rng, 3, 4, causal=False),
    ]


def ring_edge_cases(rng: random.Random) -> list[dict]:
    """One rank, one position per rank, five ranks, scores near 10^2 in float32, a non-causal float64 ring."""
    return [
        _ring_case(rng, 1, 6),
        _ring_case(rng, 4, 1, heads=1),
        _ring_case(rng, 5, 3, batch=2),
        _ring_case(rng, 3, 5, magnitude=25.0),
        _ring_case(rng, 4, 3, dtype="float64", causal=False, heads=3, head_dim=5),
    ]


def traffic_cases(rng: random.Random) -> list[dict]:
    return [_ring_case(rng, w, rng.choice([2, 3, 5]), batch=2) for w in (2, 3, 4)]


def backward_cases(rng: random.Random) -> list[dict]:
    return [
        _ring_case(rng, 2, 3),
        _ring_case(rng, 3, 5, dtype="float64", heads=3, head_dim=4),
        _ring_case(rng, 4, 3, batch=2),
    ]


def backward_edge_cases(rng: random.Random) -> list[dict]:
    return [_ring_case(rng, 1, 4), _ring_case(rng, 4, 1, dtype="float64"), _ring_case(rng, 3, 2, causal=False)]


# --- tensors and what attention gives under a rule ---------------------------------------------------------------


def step_tensors(case: dict):
    """q [B, H, t, D] and the case's (k, v) blocks, seeded."""
    import torch

    gen = torch.Generator().manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    shape = (case["batch"], case["heads"])
    q = torch.randn(*shape, case["t"], case["head_dim"], generator=gen, dtype=dtype)
    blocks = []
    for _, rows, magnitude in case["steps"]:
        k = magnitude * torch.randn(*shape, rows, case["head_dim"], generator=gen, dtype=dtype)
        blocks.append((k, torch.randn(*shape, rows, case["head_dim"], generator=gen, dtype=dtype)))
    return q, blocks


def ring_tensors(case: dict):
    """Full-sequence q, k, v and a gradient for the output, [B, H, W * t, D], seeded."""
    import torch

    gen = torch.Generator().manual_seed(case["seed"])
    shape = (case["batch"], case["heads"], case["world"] * case["t"], case["head_dim"])
    q, k, v, grad = (torch.randn(*shape, generator=gen, dtype=getattr(torch, case["dtype"])) for _ in range(4))
    return q * case["magnitude"], k, v, grad


def _visible(t: int, s: int, kind: str, rule: str):
    """Which keys of a block each query row sees: [t, s] bool, under the right rule or a mistaken one."""
    import torch

    query, key = torch.arange(t)[:, None], torch.arange(s)[None, :]
    diagonal = {"strict_diagonal": key < query, "past_hidden": key >= query, "diagonal_unmasked": key >= 0}
    if kind == "diagonal":
        return diagonal.get(rule, key <= query).expand(t, s)
    return (key <= query if rule == "full_masked" and s == t else key >= 0).expand(t, s)


def state_sequence(q, blocks, kinds, rule: str = "right", rescale: bool = True) -> list:
    """The (row_max, row_sum, acc) after each block: in closed form over all blocks so far (what any right answer
    holds), or, with ``rescale`` False, the online update that forgets to shrink the old terms."""
    import torch

    scale = 1.0 if rule == "unscaled" else 1 / math.sqrt(q.shape[-1])
    states, scores_so_far, values_so_far = [], [], []
    for (k, v), kind in zip(blocks, kinds):
        scores = (q @ k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~_visible(q.shape[2], k.shape[2], kind, rule), -math.inf)
        if rescale:
            scores_so_far.append(scores)
            values_so_far.append(v)
            everything = torch.cat(scores_so_far, dim=-1)
            top = everything.amax(-1)
            weights = torch.exp(everything - top[..., None])
            states.append((top, weights.sum(-1), weights @ torch.cat(values_so_far, dim=2)))
        else:
            top = scores.amax(-1) if not states else torch.maximum(states[-1][0], scores.amax(-1))
            weights = torch.exp(scores - top[..., None])
            old = states[-1] if states else (None, 0.0, 0.0)
            states.append((top, old[1] + weights.sum(-1), old[2] + weights @ v))
    return states


def _slice_visibility(world: int, t: int, rule: str):
    """[W t, W t] bool: which keys each query sees across the ranks' slices, under the causal rule or a mistake."""
    import torch

    pos = torch.arange(world * t)
    rank, local = pos // t, pos % t
    rq, rk, lq, lk = rank[:, None], rank[None, :], local[:, None], local[None, :]
    rules = {
        "causal": pos[None, :] <= pos[:, None],
        "all_diagonal": (rk <= rq) & (lk <= lq),
        "no_skip": (rk != rq) | (lk <= lq),
        "own_block": (rk == rq) & (lk <= lq),
        "own_block_full": rk == rq,
    }
    return rules.get(rule, torch.ones(world * t, world * t, dtype=torch.bool))


def _attention(q, k, v, visible) -> tuple:
    """(out, lse, unnormalised acc) of attention under a [S, S] visibility."""
    import torch

    scores = ((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])).masked_fill(~visible, -math.inf)
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - top)
    acc = weights @ v
    return acc / weights.sum(-1, keepdim=True), torch.logsumexp(scores, dim=-1), acc


def _ring_order_unrescaled(q, k, v, case: dict) -> list:
    """Each rank's output when the step forgets to rescale, blocks folded in the ring's order (own first)."""
    world, t = case["world"], case["t"]
    outputs = []
    for rank in range(world):
        mine = q[:, :, rank * t : (rank + 1) * t]
        origins = [(rank - s) % world for s in range(world)]
        if case["causal"]:
            origins = [o for o in origins if o <= rank]
        kinds = ["diagonal" if case["causal"] and o == rank else "full" for o in origins]
        blocks = [(k[:, :, o * t : (o + 1) * t], v[:, :, o * t : (o + 1) * t]) for o in origins]
        _, total, acc = state_sequence(mine, blocks, kinds, rescale=False)[-1]
        outputs.append((acc / total[..., None]).tolist())
    return outputs


def _slices(x, world: int) -> list:
    return [part.tolist() for part in x.chunk(world, dim=2)]


def ring_expectations(case: dict) -> dict:
    """Full attention's output per rank, and what each usual mistake gives (read from the reference's side)."""
    q, k, v, _ = ring_tensors(case)
    world, t = case["world"], case["t"]
    right = "causal" if case["causal"] else "none"
    out, _, acc = _attention(q, k, v, _slice_visibility(world, t, right))
    variants = {"unnormalised": _slices(acc, world), "no_rescale": _ring_order_unrescaled(q, k, v, case)}
    wrong_rules = (
        ("all_diagonal", "no_skip", "own_block", "unmasked") if case["causal"] else ("own_block_full", "masked")
    )
    for rule in wrong_rules:
        visibility = _slice_visibility(world, t, "causal" if rule == "masked" else rule)
        variants["own_block" if rule == "own_block_full" else rule] = _slices(_attention(q, k, v, visibility)[0], world)
    return {"full": _slices(out, world), "variants": variants}


# --- ranks as threads ---------------------------------------------------------------------------------------------


class RankStopped(BaseException):
    """Raised in a rank's thread that its group gave up on."""


class RecordingComm:
    """A rank's communicator as the learner's code sees it (``rank``, ``world_size``, ``exchange``, ``bytes_sent``):
    the ``ThreadComm`` underneath moves the tensors; this records every call."""

    def __init__(self, comm, stopped: threading.Event):
        self._comm, self._stopped = comm, stopped
        self.rank, self.world_size = comm.rank, comm.world_size
        self.calls: list[tuple] = []  # (to, source) of each exchange
        self.waiting = False
        self.returned = False
        self.thread = threading.current_thread()

    @property
    def bytes_sent(self) -> int:
        return self._comm.bytes_sent

    def exchange(self, send, to, recv, source) -> None:
        """Send ``send`` to rank ``to`` and receive into ``recv`` from rank ``source``, both at once."""
        if self._stopped.is_set():
            raise RankStopped()
        self.calls.append((to, source))
        self.waiting = True
        try:
            self._comm.exchange(send, to, recv, source)
        finally:
            self.waiting = False


def _stop_running(comms: list) -> None:
    """Raise ``RankStopped`` in each rank thread still running its own code (a loop that never ends): it would take
    the processor from every later check. A rank blocked in a receive ends with the receive's own time-out."""
    import ctypes

    running = [c.thread for c in comms if not c.returned and not c.waiting and c.thread.is_alive()]
    for thread in running:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(RankStopped))
    for thread in running:
        thread.join(1.0)


def _hung(comms: list) -> str:
    """What the ranks were doing when the group stopped waiting for them."""
    waiting = [c for c in comms if not c.returned and c.waiting]
    running = [c.rank for c in comms if not c.returned and not c.waiting]
    if running and not waiting:
        return (
            f"ranks {running} were still running your code after {RANK_TIMEOUT_S:g} s, outside exchange (a loop that "
            "never ends?)"
        )
    said = "; ".join(
        f"rank {c.rank} sent to {c.calls[-1][0]!r} and waits for {c.calls[-1][1]!r} "
        f"(its exchange number {len(c.calls)})"
        for c in waiting
    )
    done = "; ".join(f"rank {c.rank} returned after {len(c.calls)} exchange(s)" for c in comms if c.returned)
    return (
        f"deadlock: ranks {[c.rank for c in waiting]} were waiting in exchange after {RANK_TIMEOUT_S:g} s for a "
        f"message no rank sent: {said}" + (f"; {done}" if done else "")
    )


def run_ranks(world: int, on_rank) -> tuple[list, str | None]:
    """``on_rank(comm)`` on ``world`` threads sharing a ``ThreadGroup``: (per rank its result and calls, the reason the
    group failed or None). The stub's NotImplementedError and a MemoryError propagate."""
    from infra_lib.training.collectives import ThreadGroup

    stopped = threading.Event()
    comms: list = [None] * world

    def target(comm):
        recording = comms[comm.rank] = RecordingComm(comm, stopped)
        result = on_rank(recording)
        recording.returned = True
        return result

    try:
        results = ThreadGroup(world).run(target, timeout_s=RANK_TIMEOUT_S)
        failure = None
    except TimeoutError:
        results, failure = [None] * world, _hung([c for c in comms if c is not None])
    except RuntimeError as exc:  # a rank raised: the group names it
        if isinstance(exc.__cause__, (NotImplementedError, MemoryError)):
            raise exc.__cause__ from None
        results, failure = [None] * world, f"{exc}"[:400]
    finally:
        stopped.set()
        _stop_running([c for c in comms if c is not None])
    calls = [[list(pair) for pair in c.calls] if c is not None else [] for c in comms]
    sent = [c.bytes_sent if c is not None else 0 for c in comms]
    return [{"result": r, "calls": c, "bytes": b} for r, c, b in zip(results, calls, sent)], failure


# --- drivers ------------------------------------------------------------------------------------------------------


def _state_record(state) -> dict:
    """A state as plain data, or the form it came in."""
    import torch

    if not isinstance(state, (tuple, list)) or len(state) != 3 or not all(isinstance(x, torch.Tensor) for x in state):
        kind = type(state).__name__
        return {"form": f"a {kind} of {len(state)} items" if isinstance(state, (tuple, list)) else f"a {kind}"}
    return {
        "form": "ok",
        "shapes": [list(x.shape) for x in state],
        "dtypes": [str(x.dtype).replace("torch.", "") for x in state],
        "values": [x.detach().tolist() for x in state],
    }


def drive_step(step, cases: list[dict]) -> list[dict]:
    import torch

    if not callable(step):
        raise TypeError(f"check(...) needs your ring_attention_step function, got a {type(step).__name__}")
    records = []
    for case in cases:
        q, blocks = step_tensors(case)
        kinds = [kind for kind, _, _ in case["steps"]]
        state = (
            torch.full(q.shape[:-1], -math.inf, dtype=q.dtype),
            torch.zeros(q.shape[:-1], dtype=q.dtype),
            torch.zeros_like(q),
        )
        record: dict = {"states": []}
        for (k, v), kind in zip(blocks, kinds):
            try:
                state = step(q.clone(), k.clone(), v.clone(), state, kind)
            except (NotImplementedError, MemoryError):
                raise
            except Exception as exc:  # the learner's code may raise anything
                record["error"] = f"{type(exc).__name__}: {exc}"[:300]
                break
            record["states"].append(_state_record(state))
            if record["states"][-1]["form"] != "ok":
                break
        if case.get("refuse") and "error" not in record:
            record["refused"] = _refusal(step, q, blocks[0], state, case["refuse"])
        record["closed"] = [[x.tolist() for x in s] for s in state_sequence(q, blocks, kinds)]
        record["variants"] = {
            rule: [[x.tolist() for x in s] for s in state_sequence(q, blocks, kinds, rule)]
            for rule in ("strict_diagonal", "past_hidden", "diagonal_unmasked", "full_masked", "unscaled")
        }
        record["variants"]["no_rescale"] = [
            [x.tolist() for x in s] for s in state_sequence(q, blocks, kinds, rescale=False)
        ]
        records.append(record)
    return records


def _refusal(step, q, block, state, kind: str) -> str:
    """What the step did with a causal_kind outside the contract: the exception's type name, or "nothing"."""
    try:
        step(q.clone(), block[0].clone(), block[1].clone(), state, kind)
    except (NotImplementedError, MemoryError):
        raise
    except Exception as exc:  # the learner's code may raise anything
        return type(exc).__name__
    return "nothing"


def _rank_slice(x, case: dict, rank: int):
    t = case["t"]
    return x[:, :, rank * t : (rank + 1) * t].clone()


def drive_ring(ring, cases: list[dict]) -> list[dict]:
    """Each case on a ThreadGroup: per rank its output (values, dtype), exchanges and bytes; after a case that failed
    the rest are skipped."""
    import torch

    if not callable(ring):
        raise TypeError(f"check(...) needs your ring_attention function, got a {type(ring).__name__}")
    records: list[dict] = []
    for case in cases:
        if records and records[-1].get("failed"):
            records.append({"skipped": True, "failed": True})
            continue
        q, k, v, _ = ring_tensors(case)

        def on_rank(comm):
            mine = [_rank_slice(x, case, comm.rank) for x in (q, k, v)]
            with torch.no_grad():
                out = ring(*mine, comm, causal=case["causal"])
            if not isinstance(out, torch.Tensor):
                return {"returned": f"a {type(out).__name__}"}
            return {"returned": "a tensor", "dtype": str(out.dtype).replace("torch.", ""), "values": out.tolist()}

        ranks, failure = run_ranks(case["world"], on_rank)
        record = {"ranks": ranks, "failure": failure, "failed": failure is not None, **ring_expectations(case)}
        records.append(record)
    return records


def drive_backward(backward, cases: list[dict]) -> list[dict]:
    """Each case on a ThreadGroup: per rank the dq, dk, dv it returned, from full attention's out and lse."""
    import torch

    if not callable(backward):
        raise TypeError(f"check(...) needs your ring_attention_backward function, got a {type(backward).__name__}")
    records: list[dict] = []
    for case in cases:
        if records and records[-1].get("failed"):
            records.append({"skipped": True, "failed": True})
            continue
        q, k, v, grad_out = ring_tensors(case)
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        visible = _slice_visibility(case["world"], case["t"], "causal" if case["causal"] else "none")
        out, lse, _ = _attention(*full, visible)
        out.backward(grad_out)
        given = [x.detach() for x in (q, k, v, out, lse[..., None], grad_out)]

        def on_rank(comm):
            mine = [_rank_slice(x, case, comm.rank) for x in given]
            mine[4] = mine[4][..., 0]  # lse [B, H, t]
            grads = backward(*mine, comm, causal=case["causal"])
            if not isinstance(grads, (tuple, list)) or len(grads) != 3:
                return {"returned": f"a {type(grads).__name__}"}
            if not all(isinstance(g, torch.Tensor) for g in grads):
                return {"returned": "not three tensors"}
            return {"returned": "ok", "values": [g.detach().tolist() for g in grads]}

        ranks, failure = run_ranks(case["world"], on_rank)
        expected = [[_rank_slice(x.grad, case, r).tolist() for x in full] for r in range(case["world"])]
        records.append({"ranks": ranks, "failure": failure, "failed": failure is not None, "full": expected})
    return records


# --- comparisons --------------------------------------------------------------------------------------------------


def describe_step_case(case: dict) -> str:
    steps = ", ".join(f"{kind} ({rows} keys{f', keys x{m:g}' if m != 1 else ''})" for kind, rows, m in case["steps"])
    return (
        f"q [{case['batch']}, {case['heads']}, {case['t']}, {case['head_dim']}] torch.{case['dtype']}, blocks folded "
        f"in from the empty state: {steps}"
    )


def describe_ring_case(case: dict) -> str:
    shape = [case["batch"], case["heads"], case["t"], case["head_dim"]]
    extra = f", queries scaled by {case['magnitude']:g}" if case["magnitude"] != 1 else ""
    return (
        f"{case['world']} rank(s), causal={case['causal']}, each rank's q, k, v {shape} torch.{case['dtype']} "
        f"(a sequence of {case['world'] * case['t']}){extra}"
    )


def _near(got, want, dtype: str) -> bool:
    import numpy as np

    atol, rtol = _TOLERANCE[dtype]
    try:
        a, b = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    except (TypeError, ValueError):
        return False
    return a.shape == b.shape and bool(np.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True))


_STEP_VARIANTS = ("no_rescale", "unscaled", "strict_diagonal", "past_hidden", "diagonal_unmasked", "full_masked")
_STATE_NAMES = ("row_max", "row_sum", "acc")


def compare_step(got, expected, cases) -> Mismatch | None:
    import numpy as np

    if type(got) is not list or len(got) != len(cases):
        return Mismatch("the check recorded the wrong number of cases")
    for mine, theirs, case in zip(got, expected, cases):
        where, dtype = describe_step_case(case), case["dtype"]
        for state, closed in zip(theirs["states"], theirs["closed"]):
            if not all(_near(a, b, dtype) for a, b in zip(state["values"], closed)):
                raise ReferenceFailed(f"the course's ring_attention_step differs from attention on {where}")
        for i, state in enumerate(mine["states"]):
            at = f"{where}: after block {i + 1}"
            if state["form"] != "ok":
                return Mismatch(
                    "ring_attention_step must return (row_max, row_sum, acc)",
                    f"on {at} it returned {state['form']}",
                    hint=STATE_HINT,
                )
            want = [list(x) for x in theirs["closed"][i]]
            shapes = [list(np.asarray(x).shape) for x in want]
            if state["shapes"] != shapes:
                return Mismatch(
                    "the state's tensors have the wrong shapes",
                    f"on {at} (row_max, row_sum, acc) have shapes {state['shapes']}, expected {shapes}",
                    hint=STATE_HINT,
                )
            if state["dtypes"] != [dtype] * 3:
                return Mismatch(
                    "the state's tensors must be in q's dtype",
                    f"on {at} (row_max, row_sum, acc) are {state['dtypes']}, q is {dtype}",
                    hint=STATE_HINT,
                )
            if all(_near(a, b, dtype) for a, b in zip(state["values"], want)):
                continue
            for rule in _STEP_VARIANTS:
                steps = theirs["variants"][rule][: i + 1]
                if all(all(_near(a, b, dtype) for a, b in zip(s["values"], w)) for s, w in zip(mine["states"], steps)):
                    return Mismatch(
                        f"ring_attention_step's state is what {_STEP_WORDS[rule]} gives", f"on {at}", hint=HINTS[rule]
                    )
            name = next(n for n, a, b in zip(_STATE_NAMES, state["values"], want) if not _near(a, b, dtype))
            found = array_mismatch(
                state["values"][_STATE_NAMES.index(name)],
                want[_STATE_NAMES.index(name)],
                f"the state's {name} differs from the course's",
                at,
                *_TOLERANCE[dtype],
            )
            return Mismatch(
                found.what if found else f"the state's {name} differs",
                found.detail if found else f"on {at}",
                hint=STATE_HINT,
            )
        if "error" in mine:
            return Mismatch(
                "ring_attention_step raised an error",
                f"on {where}, block {len(mine['states']) + 1}: {mine['error']}",
                hint=STATE_HINT,
            )
        if case.get("refuse") and mine.get("refused") != "ValueError":
            return Mismatch(
                "ring_attention_step did not refuse a causal_kind outside the contract with ValueError",
                f"on {where}: causal_kind={case['refuse']!r} raised {mine.get('refused')}",
                hint="causal_kind is 'diagonal' or 'full'; anything else is a caller's mistake, refused (ValueError)",
            )
    return None


_STEP_WORDS = {
    "no_rescale": "an update that does not rescale the old sum and accumulator when the max rises",
    "unscaled": "scores without the 1 / sqrt(head_dim) scale",
    "strict_diagonal": "a diagonal mask that also hides each query's own key",
    "past_hidden": "a diagonal mask that hides the past instead of the future",
    "diagonal_unmasked": "a 'diagonal' block left unmasked",
    "full_masked": "a 'full' block masked as if it were diagonal",
}
_RING_WORDS = {
    "unnormalised": "the accumulator left undivided by the row sums",
    "no_rescale": "a step that does not rescale by the running max",
    "all_diagonal": "every earlier rank's block masked as if it were the own, diagonal block",
    "no_skip": "later ranks' blocks folded in (the future visible)",
    "own_block": "only the rank's own block folded in",
    "unmasked": "attention without the causal mask",
    "masked": "the causal mask applied although causal=False",
}


def _group_failure(record: dict, where: str, what: str) -> Mismatch | None:
    if record.get("skipped"):
        return Mismatch("an earlier case failed", "")
    failure = record["failure"]
    if failure is None:
        return None
    if failure.startswith("deadlock"):
        return Mismatch(
            f"{what}: a rank waited for a message that never came", f"on {where}: {failure}", hint=HINTS["deadlock"]
        )
    return Mismatch(f"{what}: a rank failed", f"on {where}: {failure}", hint=HINTS["values"])


def _ring_values(mine: dict, theirs: dict, case: dict) -> Mismatch | None:
    """The first rank whose output differs from full attention, named by the mistake it matches."""
    where, dtype = describe_ring_case(case), case["dtype"]
    for rank, (r, want) in enumerate(zip(theirs["ranks"], theirs["full"])):
        if not _near(r["result"]["values"], want, dtype):
            raise ReferenceFailed(f"the course's ring_attention differs from full attention on {where}, rank {rank}")
    for rank, (r, want) in enumerate(zip(mine["ranks"], theirs["full"])):
        result = r["result"]
        if result.get("returned") != "a tensor":
            return Mismatch(
                "ring_attention must return a tensor",
                f"on {where}: rank {rank} returned {result.get('returned')}",
                hint=HINTS["values"],
            )
        if result["dtype"] != dtype:
            return Mismatch(
                "ring_attention must return q's dtype",
                f"on {where}: rank {rank} returned torch.{result['dtype']}",
                hint=HINTS["values"],
            )
        if _near(result["values"], want, dtype):
            continue
        for name, outputs in theirs["variants"].items():
            if all(_near(rr["result"]["values"], o, dtype) for rr, o in zip(mine["ranks"], outputs)):
                return Mismatch(f"each rank's output is {_RING_WORDS[name]}", f"on {where}", hint=HINTS[name])
        found = array_mismatch(
            result["values"], want, f"rank {rank}'s output differs from full attention", f"{where}", *_TOLERANCE[dtype]
        )
        return Mismatch(found.what, found.detail, hint=HINTS["values"])
    return None


def compare_ring(got, expected, cases) -> Mismatch | None:
    if type(got) is not list or len(got) != len(cases):
        return Mismatch("the check recorded the wrong number of cases")
    for mine, theirs, case in zip(got, expected, cases):
        problem = _group_failure(mine, describe_ring_case(case), "ring_attention") or _ring_values(mine, theirs, case)
        if problem:
            return problem
    return None


def _traffic_problem(mine: dict, theirs: dict, case: dict, formula: int, hint: str) -> Mismatch | None:
    world, where = case["world"], describe_ring_case(case)
    for rank, (r, e) in enumerate(zip(mine["ranks"], theirs["ranks"])):
        right_left = [(rank + 1) % world, (rank - 1) % world]
        if e["bytes"] != formula:
            raise ReferenceFailed(f"the course's ring sent {e['bytes']} bytes on {where}, its formula says {formula}")
        peers = sorted({tuple(p) for p in r["calls"]})
        if any(list(p) != right_left for p in peers):
            return Mismatch(
                "a rank exchanged with other ranks than its ring neighbours",
                f"on {where}: rank {rank} exchanged with (to, from) {peers}; in a ring it sends to {right_left[0]} and "
                f"receives from {right_left[1]} only",
                hint=hint,
                reason=TRAFFIC,
            )
        if r["bytes"] != formula:
            note = ""
            if world > 1 and r["bytes"] == formula * world // (world - 1):
                note = "; that is W exchanges: the W-th sends each block back to the rank it came from"
            elif r["bytes"] == 0 and world > 1:
                note = "; nothing went through exchange: in a process group only exchange moves data between ranks"
            return Mismatch(
                "a rank sent a different number of bytes than the ring does",
                f"on {where}: rank {rank} sent {r['bytes']} bytes in {len(r['calls'])} exchange(s); the ring sends "
                f"{formula} bytes over W - 1 = {world - 1} step(s){note}",
                hint=hint,
                reason=TRAFFIC,
            )
    return None


def compare_traffic(got, expected, cases) -> Mismatch | None:
    if type(got) is not list or len(got) != len(cases):
        return Mismatch("the check recorded the wrong number of cases")
    for mine, theirs, case in zip(got, expected, cases):
        problem = _group_failure(mine, describe_ring_case(case), "ring_attention") or _ring_values(mine, theirs, case)
        if problem:
            return Mismatch(
                "the traffic is measured on a correct ring: " + problem.what, problem.detail, hint=problem.hint
            )
        itemsize = 8 if case["dtype"] == "float64" else 4
        block = case["batch"] * case["heads"] * case["t"] * case["head_dim"] * itemsize
        problem = _traffic_problem(mine, theirs, case, (case["world"] - 1) * 2 * block, HINTS["traffic"])
        if problem:
            return problem
    return None


def compare_backward(got, expected, cases) -> Mismatch | None:
    if type(got) is not list or len(got) != len(cases):
        return Mismatch("the check recorded the wrong number of cases")
    for mine, theirs, case in zip(got, expected, cases):
        where, dtype, world = describe_ring_case(case), case["dtype"], case["world"]
        problem = _group_failure(mine, where, "ring_attention_backward")
        if problem:
            return Mismatch(
                problem.what,
                problem.detail,
                hint=HINTS["deadlock"] if "never came" in problem.what else HINTS["backward"],
            )
        for rank, r in enumerate(theirs["ranks"]):
            if not all(_near(a, b, dtype) for a, b in zip(r["result"]["values"], theirs["full"][rank])):
                raise ReferenceFailed(
                    f"the course's ring_attention_backward differs from autograd on {where}, rank {rank}"
                )
        for rank, r in enumerate(mine["ranks"]):
            result = r["result"]
            if result.get("returned") != "ok":
                return Mismatch(
                    "ring_attention_backward must return (dq, dk, dv)",
                    f"on {where}: rank {rank} returned {result.get('returned')}",
                    hint=HINTS["backward"],
                )
            for name, a, b in zip(("dq", "dk", "dv"), result["values"], theirs["full"][rank]):
                if _near(a, b, dtype):
                    continue
                home = theirs["full"][(rank + 1) % world]
                if (
                    world > 1
                    and name != "dq"
                    and all(_near(x, y, dtype) for x, y in zip(result["values"][1:], home[1:]))
                ):
                    return Mismatch(
                        f"rank {rank}'s dk and dv are those of rank {(rank + 1) % world}'s block",
                        f"on {where}",
                        hint=HINTS["home"],
                    )
                found = array_mismatch(
                    a, b, f"rank {rank}'s {name} differs from full attention's gradient", where, *_TOLERANCE[dtype]
                )
                return Mismatch(found.what, found.detail, hint=HINTS["backward"])
        itemsize = 8 if dtype == "float64" else 4
        block = case["batch"] * case["heads"] * case["t"] * case["head_dim"] * itemsize
        formula = ((world - 1) * 4 + 2) * block if world > 1 else 0
        problem = _traffic_problem(mine, theirs, case, formula, HINTS["backward_traffic"])
        if problem:
            return problem
    return None


def ring_parts(name: str, drive) -> dict:
    """The fields every check of this task shares: the task, the course's function it compares with, the driver."""
    return {"task": TASK, "reference": reference("infra_lib.training.context_parallel", name), "drive": drive}


register(
    Check(
        check_id="lab18.ring_step",
        make_inputs=step_cases,
        compare=compare_step,
        hint=HINTS["no_rescale"],
        **ring_parts("ring_attention_step", drive_step),
    )
)

register(
    Check(
        check_id="lab18.ring_step_edges",
        make_inputs=step_edge_cases,
        compare=compare_step,
        hint=HINTS["no_rescale"] + "; scores near 10^2 overflow exp unless the max is subtracted first",
        **ring_parts("ring_attention_step", drive_step),
    )
)

register(
    Check(
        check_id="lab18.ring_forward",
        make_inputs=ring_cases,
        compare=compare_ring,
        hint=HINTS["values"],
        **ring_parts("ring_attention", drive_ring),
    )
)

register(
    Check(
        check_id="lab18.ring_forward_edges",
        make_inputs=ring_edge_cases,
        compare=compare_ring,
        hint=HINTS["values"] + "; one rank has no neighbour to exchange with, and a slice may hold one position",
        **ring_parts("ring_attention", drive_ring),
    )
)

register(
    Check(
        check_id="lab18.ring_traffic",
        make_inputs=traffic_cases,
        compare=compare_traffic,
        hint=HINTS["traffic"],
        **ring_parts("ring_attention", drive_ring),
    )
)

register(
    Check(
        check_id="lab18.ring_backward",
        make_inputs=backward_cases,
        compare=compare_backward,
        hint=HINTS["backward"],
        **ring_parts("ring_attention_backward", drive_backward),
    )
)

register(
    Check(
        check_id="lab18.ring_backward_edges",
        make_inputs=backward_edge_cases,
        compare=compare_backward,
        hint=HINTS["backward"] + "; one rank sends nothing",
        **ring_parts("ring_attention_backward", drive_backward),
    )
)
