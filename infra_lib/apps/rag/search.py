"""Exact vector search: score every stored vector against the query, keep the k best.

With unit vectors, cosine similarity is a dot product, so scoring ``q`` queries against ``n``
stored vectors is one (q, d) x (d, n) matrix product followed by a top-k per row: about
``2 q n d`` FLOPs, the same work ``faiss.IndexFlatIP`` does. It is exact (nothing is missed)
and, up to a few hundred thousand vectors, fast enough; beyond that an approximate index
(``IVFIndex`` in ivf.py) scans only part of the collection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

SearchFn = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def top_k_cosine(queries: torch.Tensor, matrix: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` rows of ``matrix`` most similar (cosine) to each query.

    Both sides are normalised to unit length first; a zero vector scores 0 against everything.

    Args:
        queries: (d,) one query or (q, d) a batch.
        matrix: (n, d) the stored vectors.
        k: neighbours per query (>= 1); at most n are returned.

    Returns:
        (scores, indices), each (q, min(k, n)) (or (min(k, n),) for a 1-D query), best first;
        indices are rows of ``matrix``.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if queries.dim() not in (1, 2) or matrix.dim() != 2:
        raise ValueError(
            f"queries must be (d,) or (q, d) and matrix (n, d); got queries {tuple(queries.shape)} and "
            f"matrix {tuple(matrix.shape)}"
        )
    single = queries.dim() == 1
    q = queries.unsqueeze(0) if single else queries
    if q.shape[1] != matrix.shape[1]:
        raise ValueError(
            f"dimension mismatch: queries {tuple(queries.shape)} against matrix {tuple(matrix.shape)} "
            "(the last dimensions must be equal: embed both with the same embedder)"
        )
    q = torch.nn.functional.normalize(q.to(matrix.dtype), dim=-1)  # (q, d)
    m = torch.nn.functional.normalize(matrix, dim=-1)  # (n, d)
    scores = q @ m.T  # (q, n): cosine similarities
    top_scores, top_indices = scores.topk(min(k, matrix.shape[0]), dim=1)
    return (top_scores[0], top_indices[0]) if single else (top_scores, top_indices)


# Stored vectors scored per block of this many rows: a block's (q, BLOCK_ROWS) scores are still in
# the cache when its top-k reads them, where one (q, n) product would write every score out to
# memory and read it back (200 MB for 1,000 queries against 50,000 vectors). 4,096 rows was the
# fastest of 1,024 to 16,384 here (1,000 queries, 384 dimensions).
BLOCK_ROWS = 4096


def top_k_unit(
    queries: torch.Tensor, unit: torch.Tensor, k: int, *, skip_unbeaten: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_k_cosine`` for inputs already of unit length, (q, d) against (n, d), in blocks of stored
    rows: each block's best k, merged into a running best k. The same neighbours as one product and
    one top-k (the scores are the same dot products; only ties may come out in another order).

    Once every query holds k candidates, a block's top-k runs only for the queries that block can
    improve: those with a score above their current k-th best. Finding them is one pass over the
    block's scores (a row maximum), where a top-k is a partial sort; late in a scan most queries
    already hold neighbours that a block rarely beats, so most rows skip the sort.
    ``skip_unbeaten=False`` sorts every row of every block (the benchmark's before)."""
    k = min(k, unit.shape[0])
    if unit.shape[0] <= BLOCK_ROWS:
        return (queries @ unit.T).topk(k, dim=1)
    best_scores = best_rows = None
    # one buffer for every block's scores: a fresh 16 MB tensor per block would be new pages from
    # the OS each time, every one of them a page fault on first write
    buffer = torch.empty(queries.shape[0], BLOCK_ROWS, dtype=torch.result_type(queries, unit))
    for start in range(0, unit.shape[0], BLOCK_ROWS):
        block = unit[start : start + BLOCK_ROWS]
        block_scores = buffer[:, : block.shape[0]]
        torch.mm(queries, block.T, out=block_scores)
        if best_scores is None:
            best_scores, best_rows = block_scores.topk(min(k, block.shape[0]), dim=1)
            best_rows += start
            continue
        if skip_unbeaten and best_scores.shape[1] == k:  # every query holds k: only rows this block can improve
            improves = (block_scores.amax(dim=1) > best_scores[:, -1]).nonzero().squeeze(1)
            if improves.numel() == 0:
                continue
            block_scores = block_scores.index_select(0, improves)
        else:
            improves = None
        scores, rows = block_scores.topk(min(k, block.shape[0]), dim=1)
        rows += start
        held_scores, held_rows = (
            (best_scores, best_rows) if improves is None else (best_scores[improves], best_rows[improves])
        )
        scores, where = torch.cat([held_scores, scores], dim=1).topk(
            min(k, held_scores.shape[1] + scores.shape[1]), dim=1
        )
        rows = torch.cat([held_rows, rows], dim=1).gather(1, where)
        if improves is None:
            best_scores, best_rows = scores, rows
        else:
            best_scores[improves], best_rows[improves] = scores, rows
    return best_scores, best_rows


def as_matrix(vectors: torch.Tensor, dim: int, what: str = "vectors") -> torch.Tensor:
    """``vectors`` as a float32 (n, dim) tensor, with an error that names the expected shape."""
    vectors = torch.as_tensor(vectors)
    if vectors.dim() == 1:
        vectors = vectors.unsqueeze(0)
    if vectors.dim() != 2 or vectors.shape[1] != dim:
        raise ValueError(f"{what} must have shape (n, {dim}), got {tuple(vectors.shape)}")
    if not vectors.is_floating_point():
        raise TypeError(f"{what} must be floating point, got {vectors.dtype}")
    return vectors.detach().to(torch.float32).contiguous()


def as_ids(ids: Sequence[int] | torch.Tensor | None, start: int, count: int) -> torch.Tensor:
    """The ids for ``count`` new vectors: ``start, start + 1, ...`` by default."""
    if ids is None:
        return torch.arange(start, start + count, dtype=torch.int64)
    ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    if ids.numel() != count:
        raise ValueError(f"got {ids.numel()} ids for {count} vectors: give one id per vector")
    return ids


class ExactIndex:
    """Brute-force cosine search over every stored vector (``faiss.IndexFlatIP`` on unit vectors).

    Args:
        dim: vector length.
        search_fn: ``(queries, matrix, k) -> (scores, indices)``, ``top_k_cosine`` by default:
            the hook through which another search implementation (lab 12's) is plugged in.
    """

    def __init__(self, dim: int, *, search_fn: SearchFn = top_k_cosine):
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        self.dim = dim
        self.search_fn = search_fn
        self.vectors = torch.empty(0, dim)
        self.ids = torch.empty(0, dtype=torch.int64)
        self._unit: torch.Tensor | None = None  # the stored vectors normalised, kept for the default search

    def __len__(self) -> int:
        return self.vectors.shape[0]

    def add(self, vectors: torch.Tensor, ids: Sequence[int] | torch.Tensor | None = None) -> None:
        """Store (n, dim) vectors under ``ids`` (default: the next n integers)."""
        vectors = as_matrix(vectors, self.dim)
        self.ids = torch.cat([self.ids, as_ids(ids, len(self), vectors.shape[0])])
        self.vectors = torch.cat([self.vectors, vectors])
        self._unit = None

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best stored vectors per query.

        Args:
            queries: (d,) or (q, d).
            k: neighbours per query (>= 1).

        Returns:
            (scores, ids), each (q, min(k, len(self))) (1-D for a 1-D query), best first.
        """
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        if len(self) == 0:
            raise ValueError("the index is empty: add vectors before searching")
        if self.search_fn is top_k_cosine:
            # The default search: the stored side normalised once, not at every search, then scored
            # block by block (top_k_unit); queries are checked as top_k_cosine checks them.
            if queries.dim() not in (1, 2) or queries.shape[-1] != self.dim:
                top_k_cosine(queries, self.vectors, k)  # raises its error, which names the shapes
            if self._unit is None:
                self._unit = torch.nn.functional.normalize(self.vectors, dim=-1)
            q = torch.nn.functional.normalize(queries.reshape(-1, self.dim).to(self._unit.dtype), dim=-1)
            scores, rows = top_k_unit(q, self._unit, k)
            if queries.dim() == 1:
                scores, rows = scores[0], rows[0]
        else:
            scores, rows = self.search_fn(queries, self.vectors, k)
        expected = (min(k, len(self)),) if queries.dim() == 1 else (queries.shape[0], min(k, len(self)))
        if tuple(scores.shape) != expected or tuple(rows.shape) != expected:
            raise ValueError(
                f"search_fn returned scores {tuple(scores.shape)} and indices {tuple(rows.shape)}; "
                f"expected both {expected} for {tuple(queries.shape)} queries, k={k}, n={len(self)}"
            )
        return scores, self.ids[rows.long()]

    def save(self, path: str | Path) -> None:
        """Write the vectors and ids to ``path`` (a torch file)."""
        torch.save({"kind": "exact", "dim": self.dim, "vectors": self.vectors, "ids": self.ids}, Path(path))

    @classmethod
    def load(cls, path: str | Path, *, search_fn: SearchFn = top_k_cosine) -> ExactIndex:
        """An index saved by ``save``."""
        state = torch.load(Path(path), weights_only=True)
        if not isinstance(state, dict) or state.get("kind") != "exact":
            raise ValueError(
                f"{path} does not hold an ExactIndex (saved kind: "
                f"{state.get('kind') if isinstance(state, dict) else type(state).__name__})"
            )
        index = cls(int(state["dim"]), search_fn=search_fn)
        index.vectors, index.ids, index._unit = state["vectors"], state["ids"], None
        return index

    def __repr__(self) -> str:
        return f"ExactIndex(dim={self.dim}, n={len(self)})"
