"""IVF: an inverted-file index, the simplest approximate vector search.

Training runs k-means on the vectors and keeps ``nlist`` centroids; each vector is stored in
the list of its nearest centroid. A query is compared with the centroids first, and only the
vectors of its ``nprobe`` nearest lists are scored: about ``nprobe / nlist`` of the collection
instead of all of it. A true neighbour that sits in a list the query did not probe is missed,
so recall (against exact search) rises with ``nprobe`` while speed falls: the one knob of the
trade-off. ``faiss.IndexIVFFlat`` is the same structure.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from infra_lib.apps.rag.search import as_ids, as_matrix

# Points assigned to their nearest centroid per block of this many: a block's (rows, k) scores stay
# in the cache for the argmax that reads them.
_BLOCK_ROWS = 8192


def kmeans(
    x: torch.Tensor, k: int, *, iters: int = 20, seed: int = 0, spherical: bool = True, init_sample: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means with k-means++ initialisation, deterministic for a given seed.

    Args:
        x: (n, d) points.
        k: clusters (1 <= k <= n).
        iters: assignment/update rounds (stops early once no point changes cluster).
        seed: seeds the initial centroids.
        spherical: cosine k-means (points and centroids normalised, nearest = largest dot
            product), the right choice for unit-length embeddings; False for Euclidean.
        init_sample: draw the initial centroids by k-means++ from a random sample of this many
            points (at least k) rather than from all n: k-means++ makes k passes, one per centroid,
            over the points it draws from, so on a large collection the seeding would otherwise
            cost more than the rounds that follow. None: all points.

    Returns:
        (centroids, assignment): (k, d) float32 and (n,) int64 cluster of each point.
    """
    x = torch.as_tensor(x, dtype=torch.float32)
    if x.dim() != 2:
        raise ValueError(f"x must be (n, d), got shape {tuple(x.shape)}")
    n = x.shape[0]
    if not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an int in [1, n={n}], got {k!r}")
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    if init_sample is not None and (not isinstance(init_sample, int) or init_sample < k):
        raise ValueError(f"init_sample must be an int >= k={k}, got {init_sample!r}")
    if spherical:
        x = torch.nn.functional.normalize(x, dim=-1)
    gen = torch.Generator().manual_seed(seed)

    def distances(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:  # (n, k), smaller is nearer
        if spherical:
            return 1 - points @ centroids.T
        return torch.cdist(points, centroids).square()

    def nearest_centroid(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:  # (n,), block by block
        return torch.cat(
            [
                distances(points[i : i + _BLOCK_ROWS], centroids).argmin(dim=1)
                for i in range(0, points.shape[0], _BLOCK_ROWS)
            ]
        )

    # k-means++: each next centroid is a point drawn with probability proportional to its distance
    # to the nearest centroid chosen so far, so the initial centroids spread over the data.
    pool = x if init_sample is None or init_sample >= n else x[torch.randperm(n, generator=gen)[:init_sample]]
    m = pool.shape[0]
    chosen = [int(torch.randint(m, (1,), generator=gen))]
    nearest = distances(pool, pool[chosen[0]][None])[:, 0].clamp(min=0)
    for _ in range(1, k):
        weights = nearest if nearest.sum() > 0 else torch.ones(m)
        pick = int(torch.multinomial(weights, 1, generator=gen))
        chosen.append(pick)
        nearest = torch.minimum(nearest, distances(pool, pool[pick][None])[:, 0].clamp(min=0))
    centroids = pool[chosen].clone()

    assignment = nearest_centroid(x, centroids)
    for _ in range(iters):
        sums = torch.zeros_like(centroids).index_add_(0, assignment, x)
        counts = torch.bincount(assignment, minlength=k)
        empty = counts == 0
        if empty.any():  # re-seed an empty cluster with the points farthest from their centroid
            own = centroids[assignment]
            gap = (1 - (x * own).sum(-1)) if spherical else (x - own).square().sum(-1)
            far = gap.topk(int(empty.sum())).indices
            sums[empty], counts[empty] = x[far], 1
        centroids = sums / counts[:, None]
        if spherical:
            centroids = torch.nn.functional.normalize(centroids, dim=-1)
        new = nearest_centroid(x, centroids)
        if torch.equal(new, assignment):
            break
        assignment = new
    return centroids, assignment


class IVFIndex:
    """Inverted-file index for cosine search (vectors are normalised when added).

    Args:
        dim: vector length.
        nlist: lists (k-means clusters).
        nprobe: lists scanned per query by default (clipped to nlist).
        seed: seeds k-means.
    """

    def __init__(self, dim: int, nlist: int, *, nprobe: int = 1, seed: int = 0):
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        if not isinstance(nlist, int) or nlist < 1:
            raise ValueError(f"nlist must be an int >= 1, got {nlist!r}")
        self.dim, self.nlist, self.seed = dim, nlist, seed
        self.nprobe = self._check_nprobe(nprobe)
        self.centroids: torch.Tensor | None = None
        self.vectors = torch.empty(0, dim)  # sorted by list
        self.ids = torch.empty(0, dtype=torch.int64)
        self.list_of = torch.empty(0, dtype=torch.int64)  # each stored vector's list
        self.offsets = torch.zeros(nlist + 1, dtype=torch.int64)  # list l is rows offsets[l]:offsets[l + 1]

    @property
    def is_trained(self) -> bool:
        return self.centroids is not None

    def __len__(self) -> int:
        return self.vectors.shape[0]

    def _check_nprobe(self, nprobe: int) -> int:
        if not isinstance(nprobe, int) or isinstance(nprobe, bool) or nprobe < 1:
            raise ValueError(f"nprobe must be an int >= 1, got {nprobe!r}")
        return min(nprobe, self.nlist)

    def _require_trained(self, action: str) -> None:
        if not self.is_trained:
            raise RuntimeError(
                f"cannot {action} an untrained IVFIndex: call .train(vectors) first (k-means on a "
                "sample of the vectors you will add)"
            )

    def list_sizes(self) -> torch.Tensor:
        """(nlist,) vectors per list."""
        return self.offsets.diff()

    def train(self, vectors: torch.Tensor, *, iters: int = 20) -> None:
        """Learn the ``nlist`` centroids by spherical k-means on (n, dim) vectors, n >= nlist."""
        vectors = as_matrix(vectors, self.dim)
        if vectors.shape[0] < self.nlist:
            raise ValueError(
                f"training needs at least nlist={self.nlist} vectors, got {vectors.shape[0]}; "
                "lower nlist (about sqrt(n) is a common choice)"
            )
        # k-means++ seeds from a sample of 32 points per list (enough to spread the seeds over the
        # data; seeding from all of a large collection would cost more than the rounds after it)
        self.centroids, _ = kmeans(vectors, self.nlist, iters=iters, seed=self.seed, init_sample=32 * self.nlist)

    def add(self, vectors: torch.Tensor, ids: Sequence[int] | torch.Tensor | None = None) -> None:
        """Store (n, dim) vectors in the lists of their nearest centroids."""
        self._require_trained("add to")
        vectors = torch.nn.functional.normalize(as_matrix(vectors, self.dim), dim=-1)
        new_ids = as_ids(ids, len(self), vectors.shape[0])
        lists = (vectors @ self.centroids.T).argmax(dim=1)
        all_lists = torch.cat([self.list_of, lists])
        order = torch.sort(all_lists, stable=True).indices
        self.vectors = torch.cat([self.vectors, vectors])[order]
        self.ids = torch.cat([self.ids, new_ids])[order]
        self.list_of = all_lists[order]
        self.offsets = torch.cat(
            [torch.zeros(1, dtype=torch.int64), torch.bincount(self.list_of, minlength=self.nlist).cumsum(0)]
        )

    def search(self, queries: torch.Tensor, k: int, nprobe: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Approximate top-k by cosine, scanning each query's ``nprobe`` nearest lists.

        Args:
            queries: (d,) or (q, d).
            k: neighbours per query (>= 1).
            nprobe: lists to scan (default: the index's ``nprobe``; clipped to nlist).

        Returns:
            (scores, ids), each (q, min(k, len(self))) (1-D for a 1-D query), best first. Where the
            probed lists hold fewer than k vectors, the rest is padded with score -inf and id -1.
        """
        self._require_trained("search")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        if len(self) == 0:
            raise ValueError("the index is empty: add vectors before searching")
        nprobe = self.nprobe if nprobe is None else self._check_nprobe(nprobe)
        single = torch.as_tensor(queries).dim() == 1
        q = torch.nn.functional.normalize(as_matrix(queries, self.dim, "queries"), dim=-1)  # (q, d)
        k = min(k, len(self))
        probes = (q @ self.centroids.T).topk(nprobe, dim=1).indices  # (q, nprobe)
        # List by list: every query that probes list l is scored against l's vectors in one matrix
        # product; its best k there go into that query's slot for l. Then a top-k over the slots.
        best_scores = torch.full((q.shape[0], nprobe, k), float("-inf"))
        best_rows = torch.full((q.shape[0], nprobe, k), -1, dtype=torch.int64)
        for cell in probes.unique().tolist():
            lo, hi = int(self.offsets[cell]), int(self.offsets[cell + 1])
            if hi == lo:
                continue
            who, slot = (probes == cell).nonzero(as_tuple=True)
            scores = q[who] @ self.vectors[lo:hi].T  # (|who|, list size)
            top = scores.topk(min(k, hi - lo), dim=1)
            best_scores[who, slot, : top.values.shape[1]] = top.values
            best_rows[who, slot, : top.values.shape[1]] = top.indices + lo
        scores, where = best_scores.flatten(1).topk(k, dim=1)
        rows = best_rows.flatten(1).gather(1, where)
        ids = torch.where(rows >= 0, self.ids[rows.clamp(min=0)], torch.full_like(rows, -1))
        return (scores[0], ids[0]) if single else (scores, ids)

    def save(self, path: str | Path) -> None:
        """Write the centroids, lists and settings to ``path`` (a torch file)."""
        self._require_trained("save")
        torch.save(
            {
                "kind": "ivf",
                "dim": self.dim,
                "nlist": self.nlist,
                "nprobe": self.nprobe,
                "seed": self.seed,
                "centroids": self.centroids,
                "vectors": self.vectors,
                "ids": self.ids,
                "list_of": self.list_of,
                "offsets": self.offsets,
            },
            Path(path),
        )

    @classmethod
    def load(cls, path: str | Path) -> IVFIndex:
        """An index saved by ``save``."""
        state = torch.load(Path(path), weights_only=True)
        if not isinstance(state, dict) or state.get("kind") != "ivf":
            raise ValueError(
                f"{path} does not hold an IVFIndex (saved kind: "
                f"{state.get('kind') if isinstance(state, dict) else type(state).__name__})"
            )
        index = cls(int(state["dim"]), int(state["nlist"]), nprobe=int(state["nprobe"]), seed=int(state["seed"]))
        for name in ("centroids", "vectors", "ids", "list_of", "offsets"):
            setattr(index, name, state[name])
        return index

    def __repr__(self) -> str:
        return (
            f"IVFIndex(dim={self.dim}, nlist={self.nlist}, nprobe={self.nprobe}, n={len(self)}, "
            f"trained={self.is_trained})"
        )
