"""What a ring all-reduce that went wrong did, named where it can be: a rank that raised or hung, a tensor that
does not hold the sum (averaged, left unchanged, one chunk finished, an element added twice or from some ranks
only), a sum returned but not written in place."""

from __future__ import annotations

import math

from grading.checks.common import unwrap
from grading.checks.lab05.ring_threads import SENDS, rank_tensor
from grading.registry import Mismatch


def plural(n: int, word: str) -> str:
    """``n`` and the word, in the plural unless ``n`` is 1."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def describe_ring(case: dict) -> str:
    """A ring case in words: the world size, and each rank's tensor's dtype, shape and layout."""
    shape, layout = case["shape"], case["layout"]
    made = {
        "contiguous": "",
        "transposed": f", non-contiguous: x.t() of a {shape[::-1]} tensor",
        "strided": f", non-contiguous: x[:, ::2] of a {shape[:1] + [2 * n for n in shape[1:]]} tensor",
        "permuted": f", non-contiguous: x.permute(2, 1, 0) of a {shape[::-1]} tensor",
    }[layout]
    numel = math.prod(shape)
    return (
        f"world size {case['world']}, each rank a torch.{case['dtype']} tensor of shape {shape} "
        f"({plural(numel, 'element')}{made})"
    )


def _ring_order(numel: int, world: int, rank: int) -> list[str]:
    """ "sent/received" elements at each of a ring rank's 2 (W - 1) exchanges (chunks from an even split)."""
    sizes = [numel // world + (c < numel % world) for c in range(world)]
    scatter = [(sizes[(rank - step) % world], sizes[(rank - step - 1) % world]) for step in range(world - 1)]
    gather = [(sizes[(rank + 1 - step) % world], sizes[(rank - step) % world]) for step in range(world - 1)]
    return [f"{a}/{b}" for a, b in scatter + gather]


def _skipped_empty(done: list[str], order: list[str]) -> bool:
    """Whether ``done`` follows the ring's ``order`` with some exchanges of an empty chunk left out."""
    i, skipped = 0, False
    for exchange in done:
        while i < len(order) and order[i] != exchange and "0" in order[i].split("/"):
            i, skipped = i + 1, True
        if i == len(order) or order[i] != exchange:
            return False
        i += 1
    return skipped


def _skipped_note(text: str, case: dict) -> str:
    """The note for a rank that left out the exchange of an empty chunk: the count of exchanges is wrong."""
    import re

    if SENDS not in text:
        return ""
    numel, world = math.prod(case["shape"]), case["world"]
    for rank, listed in re.findall(r"rank (\d+) \[([-\d/ ]*)\]", text.split(SENDS, 1)[1]):
        done = listed.split()
        order = _ring_order(numel, world, int(rank))
        if _skipped_empty(done, order):
            return (
                f"\n  rank {rank} left out the exchange of an empty chunk: its exchanges sent/received "
                f"[{' '.join(done)}] elements where the ring's are [{' '.join(order)}]. The chunk indices are "
                "right; the number of exchanges is not. "
                f"Every rank calls exchange exactly 2 (W - 1) = {2 * (world - 1)} times, also when the chunk it "
                "sends or receives is empty: an empty tensor is still a message, its neighbour's receive is "
                "waiting for it, and one left out shifts every later message by one"
            )
    return ""


def _tolerance(dtype: str) -> tuple[float, float]:
    """(rtol, atol) between sums added in different orders."""
    return {"float64": (1e-10, 1e-12), "int64": (0.0, 0.0)}.get(dtype, (1e-5, 1e-5))


def _raised_note(text: str, case: dict) -> str:
    numel, world = math.prod(case["shape"]), case["world"]
    skipped = _skipped_note(text, case)
    if skipped:
        return skipped
    if "waiting in exchange" in text:
        return (
            "\n  a rank waits in exchange for a message that no rank sent it. Every rank must call exchange the "
            "same number of times (2 (W - 1)), each time sending to its right neighbour (rank + 1) % W and "
            "receiving from its left neighbour (rank - 1) % W"
        )
    if "view size is not compatible" in text:
        return (
            "\n  tensor.view(-1) needs a contiguous tensor: use tensor.reshape(-1) (a copy when the tensor is not "
            "contiguous) and copy the result back into the tensor at the end"
        )
    if "into a buffer of shape" in text:
        return (
            "\n  the chunk a rank receives into must have the size of the chunk its neighbour sends in the same "
            "step: check which chunk index each rank sends and receives at each step"
        )
    if "is not a rank of a group" in text:
        return "\n  peers are 0 .. W - 1: take the neighbours modulo W, (rank + 1) % W and (rank - 1) % W"
    if "IndexError" in text and numel % world:
        return (
            "\n  with fewer elements than ranks, or a size W does not divide, torch.chunk and ceil-sized chunks "
            "give fewer than W chunks: torch.tensor_split(flat, W) (or your shard_bounds) always gives W, some "
            "empty"
        )
    if "can't be cast to the desired output type" in text:
        return "\n  make receive buffers with the tensor's dtype, torch.empty_like(chunk): torch.empty(n) is float32"
    return ""


def _element_note(got: float, want: float, values: list[float]) -> str:
    """What one wrong element holds, when it is the sum over some of the ranks, or the sum plus some again."""
    world = len(values)
    scale = max(1.0, sum(abs(v) for v in values))
    for mask in range(1, 2**world):
        ranks = [r for r in range(world) if mask >> r & 1]
        part = sum(values[r] for r in ranks)
        which = f"rank {ranks[0]}'s value" if len(ranks) == 1 else f"the values of ranks {ranks}"
        if abs(want + part - got) <= 1e-4 * scale:
            return (
                f"; that element holds the sum plus {which} again: added twice. The all-gather copies the "
                "finished chunks over yours (receive straight into the chunk); only the reduce-scatter adds"
            )
        if mask == 2**world - 1 or abs(part - got) > 1e-4 * scale:
            continue
        if len(ranks) == 1:
            return (
                f"; that element holds only {which}: nothing was added into it. Either the reduce-scatter "
                "replaced chunks instead of adding to them (receiving straight into a chunk replaces it) or ran "
                f"fewer than W - 1 = {world - 1} steps, or the all-gather passed on chunks that were not "
                "finished yet (at every all-gather step a rank sends the finished chunk it holds or has just "
                "received): check which chunk each step sends and receives, in both phases"
            )
        return (
            f"; that element holds the sum over ranks {ranks} only, of {world}: each chunk needs W - 1 = "
            f"{world - 1} reduce-scatter steps, each adding what the left neighbour sent into the chunk it sends "
            "on at the next step"
        )
    return ""


def values_problem(case: dict, got_ranks: list, want_ranks: list) -> Mismatch | None:
    """The first rank whose tensor does not hold the sum, with the mistake named where it can be."""
    import numpy as np

    from infra_lib.training.zero import shard_bounds  # the grader's side: not the learner's code

    world, where = case["world"], describe_ring(case)
    rtol, atol = _tolerance(case["dtype"])
    want = np.asarray(want_ranks[0]["values"], dtype=np.float64)
    originals = [rank_tensor(case, r).double().numpy() for r in range(world)]
    copied = (
        (
            "; it is not contiguous, so reshape(-1) gave you a copy: the sum you computed in the copy never "
            "reached the tensor itself, which must hold it at the end"
        )
        if case["layout"] != "contiguous"
        else ""
    )
    for rank, rank_data in enumerate(got_ranks):
        try:
            got = np.asarray(rank_data["values"], dtype=np.float64)
        except (TypeError, ValueError):
            return Mismatch("the check recorded a malformed tensor", f"on {where}: rank {rank}")
        if got.shape == want.shape and np.allclose(got, want, rtol=rtol, atol=atol):
            continue
        returned = rank_data["returned"]
        if type(returned) is dict:
            back = np.asarray(returned["values"], dtype=np.float64)
            if back.shape == want.shape and np.allclose(back, want, rtol=rtol, atol=atol):
                return Mismatch(
                    "ring_all_reduce returned the sum but left the input tensor unchanged: all-reduce "
                    "works in place, like dist.all_reduce",
                    f"on {where}: rank {rank}'s input tensor does not hold the sum{copied}",
                )
        if np.array_equal(got, originals[rank]) and want.size:
            return Mismatch(
                "the input tensor still holds its own values after ring_all_reduce",
                f"on {where}: rank {rank}'s tensor is unchanged"
                + (copied or "; write the sum into it (work on a view of it, or copy the result back)"),
            )
        if got.shape != want.shape:
            return Mismatch(
                "the tensor changed shape",
                f"on {where}: rank {rank}: expected shape {list(want.shape)}, got {list(got.shape)}",
            )
        if world > 1 and want.size and np.allclose(got, want / world, rtol=1e-5, atol=1e-6):
            return Mismatch(
                "ring_all_reduce averaged instead of summing",
                f"on {where}: rank {rank} holds the sum divided by {world}; all-reduce sums (data "
                "parallelism divides by W afterwards, outside the collective)",
            )
        flat_got, flat_want = got.reshape(-1), want.reshape(-1)
        bad = ~np.isclose(flat_got, flat_want, rtol=rtol, atol=atol)
        first = int(np.argmax(bad))
        index = [int(i) for i in np.unravel_index(first, want.shape)]
        note, digits = "", 12 if case["dtype"] == "float64" else 6
        chunks = [shard_bounds(want.size, world, c) for c in range(world)]
        finished = [(s, e) for s, e in chunks if e > s and (~bad)[s:e].all() and (~bad).sum() == e - s]
        values = [float(o.reshape(-1)[first]) for o in originals]
        element = _element_note(float(flat_got[first]), float(flat_want[first]), values) if world > 1 else ""
        if case["dtype"] == "float64" and np.allclose(got, want, rtol=1e-5, atol=1e-5):
            note = (
                "; the values are right to float32 precision only: make receive buffers with the tensor's "
                "dtype, torch.empty_like(chunk) (torch.empty(n) is float32)"
            )
        elif finished and "added twice" not in element:
            start, end = finished[0]
            note = (
                f"; rank {rank} holds the sum only in elements {start}..{end - 1}, one chunk: that is where the "
                f"reduce-scatter ends. The all-gather must then pass the finished chunks around the ring "
                f"(W - 1 = {world - 1} more steps) so that every rank has all of them"
            )
        else:
            note = element
        own = ", ".join(f"{o.reshape(-1)[first]:.4g}" for o in originals)
        return Mismatch(
            "ring_all_reduce did not leave the sum over the ranks in every rank's tensor",
            f"on {where}: rank {rank}: {int(bad.sum())} of {bad.size} elements differ; at index {index} "
            f"expected {flat_want[first]:.{digits}g}, got {flat_got[first]:.{digits}g} (the ranks' own "
            f"values there: {own}){note}",
        )
    for rank, rank_data in enumerate(got_ranks):
        returned = rank_data["returned"]
        if returned == "the input tensor":
            continue
        if type(returned) is not dict:
            return Mismatch(
                "ring_all_reduce must return the tensor it reduced",
                f"on {where}: rank {rank} returned {returned} (end with `return tensor`)",
            )
        back = np.asarray(returned["values"], dtype=np.float64)
        dtype = f"torch.{case['dtype']}"
        if returned["dtype"] != dtype or back.shape != want.shape or not np.allclose(back, want, rtol=rtol, atol=atol):
            return Mismatch(
                "ring_all_reduce returned a tensor other than the sum",
                f"on {where}: rank {rank}'s tensor holds the sum, but it returned a {returned['dtype']} "
                f"tensor of shape {returned['shape']} with other values (expected {dtype}, "
                f"{list(want.shape)}): end with `return tensor`",
            )
    return None


def ring_results(got, expected, cases):
    """Per case: (case, the learner's per-rank data, the reference's) or a Mismatch for what went wrong first."""
    if type(got) is not list or len(got) != len(expected):
        return Mismatch(f"the check expected {len(expected)} results, got {got!r:.80}")
    rows = []
    for case, g, e in zip(cases, got, expected):
        kind, value = unwrap(g)
        where = describe_ring(case)
        if kind == "raised":
            if "outside exchange" in str(value):
                return Mismatch(
                    "ring_all_reduce did not finish: a rank kept running its own code", f"on {where}: {value}"
                )
            if "waiting in exchange" in str(value):
                return Mismatch(
                    "ring_all_reduce did not finish: a rank waited for a message that never came",
                    f"on {where}: {value}{_raised_note(str(value), case)}",
                )
            return Mismatch(
                "ring_all_reduce raised an exception", f"on {where}: {value}{_raised_note(str(value), case)}"
            )
        if kind != "value" or type(value) is not list or len(value) != case["world"]:
            return Mismatch("the check recorded a malformed result", f"on {where}: {g!r:.80}")
        rows.append((case, value, e[1]))
    return rows
