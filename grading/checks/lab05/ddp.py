"""Lab 05 task 8: DDP, run on a ``ThreadGroup``: every rank a thread with its own copy of a model (a small MLP or
the tiny Llama, whose embedding is tied to its output layer), its slice of each global batch, and the course's
``BackgroundAllReduce`` as ``all_reduce_async`` (a per-rank FIFO thread summing over the ranks with
``comm.exchange``; not the learner's ring, so that task 8 does not depend on task 7).

The check's own hook on every parameter, registered before the learner's ``DDP`` is made, logs each gradient's
arrival; the ``all_reduce_async`` it hands over logs each launch with the flat tensor's size and a fingerprint of
its values. From that log and the gradients after ``finish()`` the comparison names: the buckets (reverse order,
greedy packing), when each bucket was launched (after ITS last gradient, before the next gradient arrived: "as
soon as"), what it carried, and the mean over the ranks against one process on the whole global batch.
"""

from __future__ import annotations

import math
import random

from grading.registry import Check, Mismatch, register

TASK = "lab05 task 8: DDP"
RANK_TIMEOUT_S = 10.0  # the whole case; a step of these models takes milliseconds
WAIT_TIMEOUT_S = 4.0  # one handle.wait(): every rank starts the same all-reduces, so this is a hang
TOLERANCE = 1e-5  # of a gradient's norm: float32 sums taken in another order
ONE_BUCKET = 10**9
LR = 0.1  # the plain SGD step between two backward passes


def _mlp(sizes: list[int], frozen: tuple = (), unused: bool = False) -> dict:
    return {"kind": "mlp", "sizes": sizes, "frozen": list(frozen), "unused": unused}


def _llama(layers: int = 2) -> dict:
    return {"kind": "llama", "vocab": 64, "width": 16, "layers": layers}


def _case(rng: random.Random, world: int, model: dict, bucket_bytes: int, steps: int = 2) -> dict:
    return {"world": world, "model": model, "bucket_bytes": bucket_bytes, "steps": steps, "seed": rng.randrange(10**6)}


def _ddp_cases(rng: random.Random) -> list[dict]:
    return [
        _case(rng, 2, _mlp([8, 16, 16, 4]), 1),  # every parameter its own bucket
        _case(rng, 3, _mlp([8, 16, 16, 4]), ONE_BUCKET),  # one bucket
        _case(rng, 2, _llama(), rng.choice([1024, 2048, 3000])),
        _case(rng, 4, _llama(), rng.choice([4096, 5000, 8192])),
    ]


def _ddp_edge_cases(rng: random.Random) -> list[dict]:
    return [
        _case(rng, 3, _mlp([8, 16, 16, 4]), 16 * 16 * 4 + 16 * 4, steps=3),  # buckets that fit exactly
        _case(rng, 2, _mlp([8, 16, 16, 4]), 600),  # a 1024-byte weight alone, between buckets of small ones
        _case(rng, 2, _mlp([8, 16, 16, 4], frozen=(0,)), 300),  # the first layer frozen: no gradient
        _case(rng, 4, _llama(layers=1), rng.randint(600, 3000), steps=3),
        _case(rng, 3, _llama(), 1),
        _case(rng, 2, _mlp([8, 16, 4], unused=True), 200),  # a parameter the loss never uses: finish() raises
    ]


def build_model(spec: dict, seed: int):
    """The case's model with seeded weights, made once and copied to every rank (no global random state)."""
    import torch
    from torch import nn

    if spec["kind"] == "llama":
        from infra_lib.training.train_step import tiny_config, tiny_model

        config = tiny_config(spec["vocab"], spec["width"], spec["layers"], 1, 1, spec["width"], 2 * spec["width"], 16)
        return tiny_model(config, seed=seed, std=0.2)
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for a, b in zip(spec["sizes"], spec["sizes"][1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    body = nn.Sequential(*layers[:-1])
    with torch.no_grad():
        for p in body.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    for index in spec["frozen"]:
        body[2 * index].requires_grad_(False)
    return _with_spare(body) if spec["unused"] else body


def _with_spare(body):
    """``body`` inside a module that also holds a parameter, ``spare``, that its forward never uses."""
    import torch
    from torch import nn

    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body
            self.spare = nn.Parameter(torch.zeros(3))

        def forward(self, x):
            return self.body(x)

    return WithSpare()


def global_batches(spec: dict, seed: int, world: int, steps: int) -> list:
    """Per step, the global batch ``(inputs, targets)``: 3 samples per rank."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    size = 3 * world
    if spec["kind"] == "llama":
        out = []
        for _ in range(steps):
            tokens = torch.randint(0, spec["vocab"], (size, 9), generator=gen)
            out.append((tokens[:, :-1], tokens[:, 1:]))
        return out
    return [
        (
            torch.randn(size, spec["sizes"][0], generator=gen),
            torch.randint(0, spec["sizes"][-1], (size,), generator=gen),
        )
        for _ in range(steps)
    ]


def batch_loss(model, inputs, targets):
    import torch.nn.functional as F

    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def fingerprint(tensor) -> list[float]:
    """[norm, projection on a fixed unit-length random direction]: enough to tell two gradients apart."""
    import torch

    flat = tensor.detach().reshape(-1).double()
    direction = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(flat.numel()), dtype=torch.float64)
    direction /= max(float(direction.norm()), 1e-300)
    return [float(flat.norm()), float(flat @ direction)]


def sum_over_ranks(tensor, comm) -> None:
    """A plain all-reduce for the checks: every rank sends its tensor to every other, and each adds the W tensors
    in rank order, so that every rank gets the same bits."""
    import torch

    world, rank = comm.world_size, comm.rank
    parts = [None] * world
    parts[rank] = tensor.clone()
    for shift in range(1, world):
        incoming = torch.empty_like(tensor)
        comm.exchange(tensor, (rank + shift) % world, incoming, (rank - shift) % world)
        parts[(rank - shift) % world] = incoming
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    tensor.copy_(total)


class _Rank:
    """What one rank did: the events of each step, its buckets, its gradients, where it stopped."""

    def __init__(self):
        self.steps: list[dict] = []
        self.buckets = None
        self.error: str | None = None
        self.stop: BaseException | None = None  # the stub's NotImplementedError, a MemoryError
        self.phase = "DDP(...)"  # the method the rank is in, for a hang or an error
        self.thread = None
        self.done = False
        self.grads: list = []  # per step, the gradient tensors after finish()


class _Handle:
    """The learner's view of a started all-reduce: ``wait()`` blocks until the sum is in, at most a few seconds."""

    def __init__(self, inner, rank: _Rank, bucket: int, events: list):
        self._inner, self._rank, self._bucket, self._events = inner, rank, bucket, events

    def wait(self):
        self._events.append(["wait", self._bucket])
        before, self._rank.phase = self._rank.phase, f"{self._rank.phase}, waiting for all-reduce number {self._bucket}"
        try:
            return self._inner.wait(WAIT_TIMEOUT_S)
        finally:
            self._rank.phase = before


def _describe_buckets(buckets, index: dict) -> object:
    """The learner's ``buckets`` as lists of parameter indices, or a sentence saying what it is instead."""
    if type(buckets) not in (list, tuple):
        return f"buckets is a {type(buckets).__name__}, not a list of lists of parameters"
    out = []
    for i, bucket in enumerate(buckets):
        if type(bucket) not in (list, tuple):
            return f"buckets[{i}] is a {type(bucket).__name__}, not a list of parameters"
        ids = [index.get(id(p)) for p in bucket]
        if None in ids:
            return f"buckets[{i}] holds an object that is not one of the model's parameters"
        out.append(ids)
    return out


def _rank_run(DDP, case: dict, base, batches: list, rec: _Rank, comm) -> None:  # noqa: N803 - the learner's class
    import copy
    import threading

    import torch

    from infra_lib.training.collectives import BackgroundAllReduce

    rec.thread = threading.current_thread()
    world, rank = case["world"], comm.rank
    model = copy.deepcopy(base)
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    events: list = []

    def arrived(param):
        events.append(["ready", index[id(param)]])

    for p in params:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(arrived)
    runner = BackgroundAllReduce(lambda t: sum_over_ranks(t, comm))

    def all_reduce_async(flat):
        if not isinstance(flat, torch.Tensor):
            raise TypeError(f"all_reduce_async takes one flat tensor, got a {type(flat).__name__}")
        events.append(["launch", flat.numel(), *fingerprint(flat)])
        return _Handle(runner(flat), rec, sum(e[0] == "launch" for e in events) - 1, events)

    try:
        ddp = DDP(model, all_reduce_async, world, case["bucket_bytes"])
        rec.buckets = _describe_buckets(getattr(ddp, "buckets", None), index)
        for step, (inputs, targets) in enumerate(batches):
            events.clear()
            rec.steps.append({"events": events})
            for p in params:
                p.grad = None
            local = slice(rank * 3, rank * 3 + 3)
            rec.phase = f"loss.backward() at step {step + 1} (your hooks)"
            batch_loss(model, inputs[local], targets[local]).backward()
            events.append(["backward"])
            rec.phase = f"finish() at step {step + 1}"
            ddp.finish()
            rec.steps[-1] = {"events": list(events)}
            rec.grads.append([None if p.grad is None else p.grad.detach().clone() for p in params])
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p -= LR * p.grad
    except (NotImplementedError, MemoryError) as exc:
        rec.stop = exc
    except Exception as exc:  # the learner's code may raise anything
        rec.error = f"in {rec.phase}: {type(exc).__name__}: {exc}"[:400]
        if rec.steps:
            rec.steps[-1] = {"events": list(events)}
    finally:
        rec.done = True
        runner.close(0.2 if rec.error else WAIT_TIMEOUT_S)  # after an error its thread may wait for a rank that stopped


def _single_process(base, batches: list) -> list:
    """One process, the whole global batch: each step's gradients, as fingerprints (None where no gradient)."""
    import copy

    import torch

    model = copy.deepcopy(base)
    out = []
    for inputs, targets in batches:
        for p in model.parameters():
            p.grad = None
        batch_loss(model, inputs, targets).backward()
        out.append([None if p.grad is None else fingerprint(p.grad) for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return out


def stop_rank_threads(threads: list) -> None:
    """Raise ``RankStopped`` in rank threads that a case gave up on while they ran their own code (a loop that
    never ends would take the processor from every later check). Not for a thread blocked in a C call."""
    import ctypes

    from grading.checks.lab05.ring_threads import RankStopped

    alive = [t for t in threads if t is not None and t.is_alive() and t.ident is not None]
    for thread in alive:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(RankStopped))
    for thread in alive:
        thread.join(1.0)


def _run_case(DDP, case: dict) -> dict:  # noqa: N803 - the learner's class
    from infra_lib.training.collectives import ThreadGroup

    base = build_model(case["model"], case["seed"])
    batches = global_batches(case["model"], case["seed"], case["world"], case["steps"])
    recs = [_Rank() for _ in range(case["world"])]
    hang = None
    try:
        ThreadGroup(case["world"]).run(
            lambda comm: _rank_run(DDP, case, base, batches, recs[comm.rank], comm), timeout_s=RANK_TIMEOUT_S
        )
    except TimeoutError:
        where = "; ".join(f"rank {r} in {rec.phase}" for r, rec in enumerate(recs) if not rec.done)
        running = [r for r, rec in enumerate(recs) if not rec.done and "waiting" not in rec.phase]
        stop_rank_threads([recs[r].thread for r in running])
        hang = f"after {RANK_TIMEOUT_S:g} s these ranks had not finished: {where}"
        if running:
            hang += f" (ranks {running} were running your code, not waiting: a loop that never ends?)"
    stopped = next((rec.stop for rec in recs if rec.stop is not None), None)
    if stopped is not None:
        raise stopped
    spread = []
    for step, grads in enumerate(recs[0].grads):
        worst = 0.0
        for rec in recs[1:]:
            if step < len(rec.grads):
                for a, b in zip(grads, rec.grads[step]):
                    if a is not None and b is not None and a.shape == b.shape:
                        worst = max(worst, float((a - b).abs().max()) if a.numel() else 0.0)
        spread.append(worst)
    return {
        "names": [name for name, _ in base.named_parameters()],
        "numels": [p.numel() for p in base.parameters()],
        "single": _single_process(base, batches),
        "ranks": [
            {
                "buckets": rec.buckets,
                "steps": rec.steps,
                "grads": [[None if g is None else fingerprint(g) for g in grads] for grads in rec.grads],
                "error": rec.error,
            }
            for rec in recs
        ],
        "spread": spread,
        "hang": hang,
    }


def drive_ddp(DDP, cases: list[dict]) -> list:  # noqa: N803 - the learner's class
    """Each case on a ThreadGroup, torch on one thread; after a case that raised or hung the rest are skipped."""
    from grading.checks.common import one_thread

    if not callable(DDP):  # a class, or anything that builds one when called
        raise TypeError(f"check('lab05.ddp', ...) takes your DDP class, got a {type(DDP).__name__}")
    results = []
    with one_thread():
        for case in cases:
            if results and (
                results[-1] is None or results[-1]["hang"] or any(r["error"] for r in results[-1]["ranks"])
            ):
                results.append(None)  # skipped: a hang costs seconds
                continue
            results.append(_run_case(DDP, case))
    return results


# --- the comparison ---------------------------------------------------------------------------------------------

_HINT = (
    "DDP keeps every rank's gradients equal to the mean over the ranks, bucket by bucket: the buckets take the "
    "parameters in reverse order (the order backward produces their gradients), and a hook on each parameter "
    "starts a bucket's all-reduce the moment the last of its gradients has been accumulated, so that it travels "
    "while backward computes the earlier layers; finish() waits for them and writes the mean back (chapter 05, "
    "section “5 · Data parallelism”)."
)
_ORDER_HINT = (
    "backward produces gradients from the last layer to the first: buckets packed in forward order put the first "
    "layers' parameters in bucket 0, whose gradients come last, so nothing can start before the whole backward is "
    "over. Pack model.parameters() in reverse order."
)
_PACK_HINT = (
    "greedy packing: a bucket takes parameters (in reverse order) until the next one would take it past "
    "bucket_bytes (numel x element_size bytes); a bucket exactly bucket_bytes full is fine; a parameter larger than "
    "bucket_bytes is a bucket of its own; only parameters that require grad take part."
)
_EARLY_HINT = (
    "a post-accumulate-grad hook runs once per parameter, when that parameter's gradient is in p.grad: a bucket "
    "can start only when every one of its parameters has reported, and the flat tensor copies their gradients "
    "then (a gradient copied before it arrived is missing from the sum)."
)
_AFTER_HINT = (
    "the all-reduces start in finish(), after the whole backward: correct sums, but no overlap, the communication "
    "is all added to the step time. Start each bucket from the hook that completes it, during loss.backward()."
)
_WAIT_HINT = (
    "a hook that waits for the all-reduce it started stops backward until the communication is over: nothing "
    "overlaps. Start it and return; wait for every bucket in finish(), after backward."
)
_LATE_HINT = (
    "start a bucket from the very hook call that completes it (and, since buckets launch in list order, any "
    "following buckets that are already complete): waiting for a later gradient delays its communication."
)
_FLAT_HINT = (
    "a bucket's flat tensor is its parameters' gradients, each flattened, concatenated in the bucket's order: "
    "finish() reads the sums back from the same offsets."
)
_MEAN_HINT = (
    "all_reduce_async sums over the ranks; the gradient of the global batch is the mean of the ranks' gradients "
    "(each rank's loss is the mean over its own samples): divide by world_size before writing back."
)
_RESET_HINT = (
    "finish() must leave the object ready for the next backward: what it counted or launched in this step starts "
    "from nothing in the next."
)
_MISSING_HINT = (
    "a parameter that requires grad but got no gradient leaves its bucket incomplete for ever: finish() must notice "
    "it and raise RuntimeError naming the parameter (its name in model.named_parameters()), not wait or skip it."
)


def describe_case(case: dict) -> str:
    spec = case["model"]
    if spec["kind"] == "llama":
        model = (
            f"the tiny Llama (vocabulary {spec['vocab']}, width {spec['width']}, {spec['layers']} "
            f"layer{'s' if spec['layers'] > 1 else ''}, its "
            "embedding tied to its output layer: one parameter used twice)"
        )
    else:
        model = f"an MLP {'-'.join(map(str, spec['sizes']))}"
        if spec["frozen"]:
            model += f" whose layer {spec['frozen'][0]} does not require grad"
        if spec["unused"]:
            model += " with a parameter 'spare' its forward never uses"
    size = {1: " (every parameter its own bucket)", ONE_BUCKET: " (one bucket)"}.get(case["bucket_bytes"], "")
    return f"world size {case['world']}, {model}, bucket_bytes={case['bucket_bytes']}{size}, {case['steps']} steps"


def _pack(indices: list[int], numels: list[int], bucket_bytes: int) -> list[list[int]]:
    buckets, size = [], 0
    for i in indices:
        if buckets and buckets[-1] and size + 4 * numels[i] <= bucket_bytes:
            buckets[-1].append(i)
            size += 4 * numels[i]
        else:
            buckets.append([i])
            size = 4 * numels[i]
    return buckets


def _bucket_problem(got, want: list, data: dict, case: dict, where: str) -> Mismatch | None:
    if got == want:
        return None
    names, numels = data["names"], data["numels"]
    if type(got) is str:
        return Mismatch("DDP.buckets is not a list of lists of the model's parameters", f"on {where}: {got}")
    trainable = sorted(i for bucket in want for i in bucket)
    shown = " | ".join(", ".join(names[i] for i in bucket) for bucket in got[:6])
    detail = f"on {where}: your buckets hold [{shown}{' | ...' if len(got) > 6 else ''}]"
    if got == _pack(trainable, numels, case["bucket_bytes"]):
        return Mismatch("DDP.buckets take the parameters in forward order", detail, hint=_ORDER_HINT)
    flat = [i for bucket in got for i in bucket]
    extra = sorted(set(flat) - set(trainable))
    if extra:
        return Mismatch(
            "DDP.buckets hold parameters that do not require grad",
            f"{detail}; {', '.join(names[i] for i in extra)} require no grad and never get a gradient",
            hint=_PACK_HINT,
        )
    if flat == [i for bucket in want for i in bucket]:
        sizes = [sum(4 * numels[i] for i in bucket) for bucket in got]
        return Mismatch(
            "DDP.buckets hold the right parameters in the right order, packed differently",
            f"{detail}; their sizes in bytes are {sizes[:8]}, expected "
            f"{[sum(4 * numels[i] for i in bucket) for bucket in want][:8]} (bucket_bytes={case['bucket_bytes']})",
            hint=_PACK_HINT,
        )
    return Mismatch(
        "DDP.buckets differ from the reverse order of model.parameters(), packed greedily",
        f"{detail}; expected [{' | '.join(', '.join(names[i] for i in bucket) for bucket in want[:6])}]",
        hint=_PACK_HINT,
    )


def _complete_at(ready: list[int], buckets: list[list[int]]) -> list[int]:
    """For each bucket, how many gradients had arrived when it and every bucket before it were complete."""
    position = {param: n + 1 for n, param in enumerate(ready)}
    out, latest = [], 0
    for bucket in buckets:
        latest = max([latest] + [position.get(i, math.inf) for i in bucket])
        out.append(latest)
    return out


def _close(got: list, want: list) -> bool:
    scale = TOLERANCE * max(want[0], 1e-30)
    return abs(got[0] - want[0]) <= scale and abs(got[1] - want[1]) <= scale


def _launch_problem(
    events: list, want_events: list, buckets: list, data: dict, where: str, step: int, cut_short: bool
) -> Mismatch | None:
    """The first launch of this step made too early, too late, of the wrong bucket or with the wrong values
    (``cut_short``: the rank raised or hung during this step, so launches may be missing for that reason)."""
    names = data["names"]
    ready = [e[1] for e in events if e[0] == "ready"]
    complete = _complete_at(ready, buckets)
    want_launches = [e for e in want_events if e[0] == "launch"]
    count, backward_over, launched = 0, False, 0
    for event in events:
        if event[0] == "ready":
            count += 1
            continue
        if event[0] == "backward":
            backward_over = True
            continue
        if event[0] == "wait":
            if not backward_over:
                return Mismatch(
                    "DDP waited for an all-reduce during backward",
                    f"on {where}: all-reduce number {event[1]} was waited for in a hook, when {count} of the "
                    "backward's gradients had arrived: backward stood still until it was done",
                    hint=_WAIT_HINT,
                )
            continue
        k = launched
        launched += 1
        if k >= len(buckets):
            return Mismatch(
                "DDP started more all-reduces than it has buckets",
                f"on {where}: all-reduce number {k} (of {len(buckets)} buckets) carried {event[1]} elements; "
                "one all-reduce per bucket per backward",
                hint=_RESET_HINT if step else _HINT,
            )
        bucket = buckets[k]
        size = sum(data["numels"][i] for i in bucket)
        if event[1] != size:
            sizes = [sum(data["numels"][i] for i in b) for b in buckets]
            later = next((j for j in range(k + 1, len(buckets)) if sizes[j] == event[1] and complete[j] <= count), None)
            if later is not None:
                return Mismatch(
                    "DDP started the buckets' all-reduces out of list order",
                    f"on {where}: all-reduce number {k} carried bucket {later}'s {event[1]} elements while bucket {k} "
                    f"({', '.join(names[i] for i in bucket)}, {size} elements) was not started: every rank must start "
                    "them in the same order, the order of DDP.buckets",
                    hint=_LATE_HINT,
                )
            return Mismatch(
                "an all-reduce did not carry the bucket due at that point",
                f"on {where}: all-reduce number {k} carried {event[1]} elements; bucket {k} "
                f"({', '.join(names[i] for i in bucket)}) has {size}: buckets launch in list order, each as one flat "
                "tensor of all its gradients",
                hint=_EARLY_HINT if count < complete[k] else _HINT,
            )
        if count < complete[k]:
            waiting = [names[i] for i in bucket if i not in ready[:count]]
            return Mismatch(
                "DDP started a bucket's all-reduce before its last gradient had arrived",
                f"on {where}: bucket {k} ({', '.join(names[i] for i in bucket)}) was launched when {count} of the "
                f"backward's {len(ready)} gradients had arrived; {', '.join(waiting)} had not",
                hint=_EARLY_HINT,
            )
        if backward_over and count > complete[k]:
            return Mismatch(
                "DDP started the all-reduces after the whole backward, not from the gradient hooks",
                f"on {where}: bucket {k} was launched after loss.backward() returned; it was complete when "
                f"{complete[k]} of the {len(ready)} gradients had arrived",
                hint=_AFTER_HINT,
            )
        if count > complete[k]:
            return Mismatch(
                "DDP started a bucket's all-reduce later than the hook that completed it",
                f"on {where}: bucket {k} ({', '.join(names[i] for i in bucket)}) was complete (with every bucket "
                f"before it) when {complete[k]} gradients had arrived, and was launched only after {count}",
                hint=_LATE_HINT,
            )
        if k < len(want_launches) and not _close(event[2:], want_launches[k][2:]):
            return Mismatch(
                "a bucket's flat tensor did not hold its gradients in bucket order",
                f"on {where}: bucket {k} ({', '.join(names[i] for i in bucket)}): the flat tensor launched has norm "
                f"{event[2]:.6g}, the bucket's gradients concatenated {want_launches[k][2]:.6g} (or the same norm, "
                "another order)",
                hint=_FLAT_HINT,
            )
    if launched < len(want_launches) and not cut_short:
        return Mismatch(
            "DDP did not start an all-reduce for every bucket",
            f"on {where}: {launched} all-reduces for {len(buckets)} buckets",
            hint=_RESET_HINT if step else _HINT,
        )
    return None


def _gradient_problem(got: list, want: list, data: dict, case: dict, where: str) -> Mismatch | None:
    names, world = data["names"], case["world"]
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if (g is None) != (w is None) or (w and not _close(g, w))]
    if not wrong:
        return None
    i = wrong[0]
    if got[i] is None:
        return Mismatch("a gradient is missing after finish()", f"on {where}: {names[i]}.grad is None", hint=_HINT)
    if want[i] is None:
        return Mismatch(
            "a parameter that requires no grad got a gradient",
            f"on {where}: {names[i]}.grad was set",
            hint=_PACK_HINT,
        )
    if all(g is not None and w is not None and _close([g[0] / world, g[1] / world], w) for g, w in zip(got, want)):
        return Mismatch(
            "after finish() the gradients are the sum over the ranks, not the mean",
            f"on {where}: every gradient is {world} times one process's on the global batch "
            f"(e.g. {names[i]}: norm {got[i][0]:.6g}, expected {want[i][0]:.6g})",
            hint=_MEAN_HINT,
        )
    return Mismatch(
        "after finish() a gradient differs from one process's on the global batch",
        f"on {where}: {names[i]}: norm {got[i][0]:.6g}, expected {want[i][0]:.6g} "
        f"({len(wrong)} of {len(want)} parameters differ; tolerance {TOLERANCE:g} of the norm)",
        hint=_FLAT_HINT if len(wrong) < len(want) else _HINT,
    )


def _error_problem(got: dict, want: dict, where: str) -> Mismatch | None:
    """A rank that raised where the reference did not, or did not raise (naming the parameter) where it did."""
    expected = want["ranks"][0]["error"]
    if expected:  # a parameter that got no gradient: finish() raises naming it
        missing = expected.split("no gradient reached ", 1)[-1].split(" in this backward")[0]
        for rank, g in enumerate(got["ranks"]):
            if not g["error"]:
                return Mismatch(
                    "finish() returned although a parameter got no gradient in this backward",
                    f"on {where}, rank {rank}: {missing} took no part in the loss",
                    hint=_MISSING_HINT,
                )
            if "RuntimeError" not in g["error"] or missing not in g["error"]:
                return Mismatch(
                    "finish() must raise RuntimeError naming the parameter that got no gradient",
                    f"on {where}, rank {rank}: your code raised {g['error']} ({missing} got no gradient)",
                    hint=_MISSING_HINT,
                )
        return None
    errors = {rank: g["error"] for rank, g in enumerate(got["ranks"]) if g["error"]}
    if not errors:
        return None
    waited = [rank for rank, text in errors.items() if "did not finish within" in text]
    if waited:
        others = "; ".join(f"rank {r}: {text}" for r, text in errors.items() if r not in waited)
        return Mismatch(
            "DDP's ranks did not all start the same all-reduces",
            f"on {where}: ranks {waited} waited in finish() for an all-reduce that not every rank started"
            + (f"; {others}" if others else ""),
            hint=_HINT,
        )
    rank, text = min(errors.items())
    if "loss.backward()" in text and "NoneType" in text:
        return Mismatch(
            "DDP raised an exception in a gradient hook",
            f"on {where}, rank {rank}: {text}; a p.grad was still None there: that gradient had not arrived yet",
            hint=_EARLY_HINT,
        )
    return Mismatch("DDP raised an exception", f"on {where}, rank {rank}: {text}", hint=_HINT)


def _case_problem(case: dict, got, want: dict) -> Mismatch | None:
    """Step by step: the buckets, each rank's launches, then the gradients after finish(); then errors and hangs."""
    where = describe_case(case)
    if type(got) is not dict or type(got.get("ranks")) is not list or len(got["ranks"]) != case["world"]:
        return Mismatch("the check recorded a malformed result", f"on {where}: {got!r:.80}")
    want_buckets = want["ranks"][0]["buckets"]
    for rank, g in enumerate(got["ranks"]):
        if g["buckets"] is not None:
            problem = _bucket_problem(g["buckets"], want_buckets, want, case, f"{where}, rank {rank}")
            if problem:
                return problem
    if want["ranks"][0]["error"]:
        return _error_problem(got, want, where)
    for step in range(case["steps"]):
        for rank, (g, w) in enumerate(zip(got["ranks"], want["ranks"])):
            if step < len(g["steps"]):
                cut_short = bool(g["error"] or got["hang"]) and step == len(g["steps"]) - 1
                at = f"{where}, rank {rank}, step {step + 1}"
                events = g["steps"][step]["events"]
                problem = _launch_problem(events, w["steps"][step]["events"], want_buckets, want, at, step, cut_short)
                if problem:
                    return problem
        grads = got["ranks"][0]["grads"]
        if step < len(grads):
            at = f"{where}, after finish() at step {step + 1}"
            problem = _gradient_problem(grads[step], want["single"][step], want, case, at)
            if problem:
                return problem
        if step < len(got["spread"]):
            spread, scale = got["spread"][step], max([g[0] for g in want["single"][step] if g] + [1.0])
            if type(spread) is not float or spread > TOLERANCE * scale:
                return Mismatch(
                    "after finish() the ranks hold different gradients",
                    f"on {where}, step {step + 1}: the largest difference from rank 0's is {spread!r:.8}",
                    hint=_HINT,
                )
    if got["hang"]:
        return Mismatch("DDP did not finish", f"on {where}: {got['hang']}", hint=_HINT)
    return _error_problem(got, want, where)


def compare_ddp(got, expected, cases: list[dict]) -> Mismatch | None:
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    for case, g, e in zip(cases, got, expected):
        if g is None:
            return Mismatch("the check recorded a malformed result", f"on {describe_case(case)}: skipped")
        problem = _case_problem(case, g, e)
        if problem:
            return problem
    return None


def ddp_parts() -> dict:
    from grading.checks.common import reference

    return {
        "task": TASK,
        "reference": reference("infra_lib.training.ddp", "DDP"),
        "drive": drive_ddp,
        "compare": compare_ddp,
    }


register(
    Check(
        check_id="lab05.ddp",
        make_inputs=_ddp_cases,
        hint=_HINT,
        **ddp_parts(),
    )
)

register(
    Check(
        check_id="lab05.ddp_edges",
        make_inputs=_ddp_edge_cases,
        hint=_HINT + " Buckets that fit exactly, a parameter larger than a bucket, a frozen layer, one-parameter "
        "buckets of the Llama on 3 ranks, three steps, and a parameter the loss never uses (finish() raises "
        "RuntimeError naming it).",
        **ddp_parts(),
    )
)
