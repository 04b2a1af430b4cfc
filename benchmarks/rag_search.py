"""Vector search for RAG: infra_lib's exact and IVF indexes beside faiss, on the same vectors in one run.

The collection is the shipped corpus's MiniLM chunk embeddings, grown to N vectors with
synthetic ones: each is a corpus embedding plus Gaussian noise, normalised, so the collection
keeps the clustered shape of real embeddings (uniformly random unit vectors in 384 dimensions
are all nearly orthogonal, have no meaningful neighbours, and would make every IVF look bad).
The queries are the shipped questions' embeddings plus synthetic ones made the same way.

Exact search, at N and at a larger collection: queries per second of ``ExactIndex`` (the stored
vectors scored block by block, each block's top-k merged) and of ``faiss.IndexFlatIP``, and whether
they return the same neighbours. IVF: ``IVFIndex`` and
``faiss.IndexIVFFlat`` with the same nlist, for a range of nprobe: recall@k against exact search
and queries per second. Everything runs on the CPU (faiss-cpu), whatever --device says.

Usage:
    python benchmarks/rag_search.py [--quick] [--device auto] [--out PATH]
"""

from __future__ import annotations

import sys
import time

import faiss
import numpy as np
import torch
from benchmark_cli import benchmark_main, load_average

from infra_lib.apps.rag import (
    ExactIndex,
    IVFIndex,
    MiniLMEmbedder,
    chunk_documents,
    default_cache_dir,
    embed_cached,
    load_corpus,
    load_questions,
)
from infra_lib.apps.rag.search import top_k_unit
from infra_lib.hardware.probes import machine_info

SEED = 0
K = 10
NOISE = 0.35  # the synthetic vectors' distance from their corpus vector (unit vectors, before normalising)


def jittered(base: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` unit vectors, each a random row of ``base`` plus Gaussian noise of norm about NOISE."""
    rows = base[torch.randint(base.shape[0], (n,), generator=gen)]
    noise = torch.randn(n, base.shape[1], generator=gen) * (NOISE / base.shape[1] ** 0.5)
    return torch.nn.functional.normalize(rows + noise, dim=-1)


def side_by_side(*fns, rounds: int) -> list[float]:
    """Best seconds of each of ``fns``, timed in turn ``rounds`` times after one untimed call each:
    a burst of load on the shared machine then slows all of them, not one."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def recall_against(found: torch.Tensor, truth: torch.Tensor) -> float:
    """Mean fraction of each query's true top-k ids that ``found`` contains."""
    return float(np.mean([len(set(f.tolist()) & set(t.tolist())) / t.numel() for f, t in zip(found, truth)]))


def run_search(device: torch.device, quick: bool) -> dict:
    torch.manual_seed(SEED)
    load_before = load_average()
    gen = torch.Generator().manual_seed(SEED)
    n_vectors, n_queries = (5_000, 128) if quick else (50_000, 1_000)
    # exact search also at a larger collection, where ours scores the stored vectors block by block
    exact_sizes = [n_vectors, 12_000] if quick else [n_vectors, 200_000]
    nlist = 64 if quick else 256
    nprobes = [1, 2, 4, 8, 16] if quick else [1, 2, 4, 8, 16, 32, 64]
    iters = 3 if quick else 5

    embedder = MiniLMEmbedder()
    chunks = chunk_documents(load_corpus(), 800, 100)
    started = time.perf_counter()
    corpus = embed_cached(embedder, [c.text for c in chunks], default_cache_dir())
    questions = embed_cached(embedder, [q.question for q in load_questions()], default_cache_dir())
    embed_s = time.perf_counter() - started
    collection = torch.cat([corpus, jittered(corpus, max(exact_sizes) - corpus.shape[0], gen)])
    vectors = collection[:n_vectors]
    queries = torch.cat([questions, jittered(corpus, n_queries - questions.shape[0], gen)])
    xb, xq = vectors.numpy(), queries.numpy()

    exact_by_size = []
    for size in exact_sizes:
        ours = ExactIndex(collection.shape[1])
        ours.add(collection[:size])
        flat = faiss.IndexFlatIP(collection.shape[1])
        flat.add(collection[:size].numpy())
        scores, ids = ours.search(queries, K)
        faiss_scores, faiss_ids = flat.search(xq, K)
        unit = torch.nn.functional.normalize(collection[:size], dim=-1)
        unit_queries = torch.nn.functional.normalize(queries, dim=-1)
        # the before: every block's top-k taken for every query, also timed in turn with the others
        ours_s, faiss_s, sorted_s = side_by_side(
            lambda: ours.search(queries, K),
            lambda: flat.search(xq, K),
            lambda: top_k_unit(unit_queries, unit, K, skip_unbeaten=False),
            rounds=iters,
        )
        exact_by_size.append(
            {
                "n_vectors": size,
                "ours_qps": n_queries / ours_s,
                "faiss_qps": n_queries / faiss_s,
                "ours_over_faiss": faiss_s / ours_s,
                "every_block_sorted_qps": n_queries / sorted_s,
                "every_block_sorted_over_faiss": faiss_s / sorted_s,
                "same_neighbours_fraction": float((ids.numpy() == faiss_ids).mean()),
                "max_score_difference": float(np.abs(scores.numpy() - faiss_scores).max()),
            }
        )
        if size == n_vectors:
            exact_ids = ids  # the truth for the IVF recalls below
    exact = exact_by_size[0]

    def build_ours():
        index = IVFIndex(vectors.shape[1], nlist, seed=SEED)
        index.train(vectors)
        index.add(vectors)
        return index

    def build_faiss():
        index = faiss.IndexIVFFlat(
            faiss.IndexFlatIP(vectors.shape[1]), vectors.shape[1], nlist, faiss.METRIC_INNER_PRODUCT
        )
        index.train(xb)
        index.add(xb)
        return index

    ours_train_s = faiss_train_s = float("inf")
    for _ in range(1 if quick else 2):  # builds alternate too; the faster of each counts
        started = time.perf_counter()
        ivf = build_ours()
        ours_train_s = min(ours_train_s, time.perf_counter() - started)
        started = time.perf_counter()
        faiss_ivf = build_faiss()
        faiss_train_s = min(faiss_train_s, time.perf_counter() - started)
    sizes = ivf.list_sizes().double()
    curve = []
    for nprobe in nprobes:
        faiss_ivf.nprobe = nprobe
        _, ids = ivf.search(queries, K, nprobe=nprobe)
        _, fids = faiss_ivf.search(xq, K)
        ours_s, faiss_s = side_by_side(
            lambda nprobe=nprobe: ivf.search(queries, K, nprobe=nprobe), lambda: faiss_ivf.search(xq, K), rounds=iters
        )
        curve.append(
            {
                "nprobe": nprobe,
                "ours_recall": recall_against(ids, exact_ids),
                "faiss_recall": recall_against(torch.from_numpy(fids), exact_ids),
                "ours_qps": n_queries / ours_s,
                "faiss_qps": n_queries / faiss_s,
                # lists are probed by nearness, not at random: the expected share of the collection scanned
                "scanned_fraction_if_uniform": nprobe / nlist,
            }
        )
    for row in curve:
        # at equal recall: the fastest faiss setting that finds at least as many true neighbours
        matched = [r["faiss_qps"] for r in curve if r["faiss_recall"] >= row["ours_recall"]]
        row["faiss_qps_at_least_this_recall"] = max(matched) if matched else None
        row["ours_over_faiss_at_equal_recall"] = row["ours_qps"] / max(matched) if matched else None
    return {
        "benchmark": "rag_search",
        "machine_info": machine_info("cpu"),
        "load_average_1m": {"before": load_before, "after": load_average()},
        "seed": SEED,
        "flags": {
            "quick": quick,
            "device": str(device),
            "measured_on": "cpu",
            "n_vectors": n_vectors,
            "exact_sizes": exact_sizes,
            "n_corpus_vectors": corpus.shape[0],
            "n_queries": n_queries,
            "n_question_queries": questions.shape[0],
            "dim": vectors.shape[1],
            "k": K,
            "nlist": nlist,
            "nprobes": nprobes,
            "iters": iters,
            "noise": NOISE,
            "faiss_threads": faiss.omp_get_max_threads(),
            "faiss": faiss.__version__,
            "embedder": embedder.name,
        },
        "embed_corpus_s": embed_s,
        "exact": exact,
        "exact_by_size": exact_by_size,
        "ivf_build_s": {"ours": ours_train_s, "faiss": faiss_train_s},
        "ivf_list_sizes": {"min": int(sizes.min()), "median": float(sizes.median()), "max": int(sizes.max())},
        "ivf": curve,
    }


def format_table(result: dict) -> str:
    flags, exact = result["flags"], result["exact"]
    lines = [
        f"{flags['n_vectors']} x {flags['dim']} vectors ({flags['n_corpus_vectors']} from the corpus), "
        f"{flags['n_queries']} queries, k={flags['k']}, CPU, faiss {flags['faiss']} on "
        f"{flags['faiss_threads']} threads",
        *(
            f"exact, {row['n_vectors']:,} vectors: ours {row['ours_qps']:,.0f} q/s, faiss IndexFlatIP "
            f"{row['faiss_qps']:,.0f} q/s (ours/faiss {row['ours_over_faiss']:.2f}; every block sorted "
            f"{row.get('every_block_sorted_over_faiss', float('nan')):.2f}); same neighbours "
            f"{row['same_neighbours_fraction']:.1%}, max score difference {row['max_score_difference']:.1e}"
            for row in result.get("exact_by_size", [exact])
        ),
        f"IVF nlist={flags['nlist']} (build: ours {result['ivf_build_s']['ours']:.2f} s, "
        f"faiss {result['ivf_build_s']['faiss']:.2f} s)",
        f"{'nprobe':>6s} {'recall ours':>12s} {'recall faiss':>13s} {'q/s ours':>10s} {'q/s faiss':>10s} "
        f"{'ours/faiss at >= recall':>24s}",
    ]
    for row in result["ivf"]:
        equal = row.get("ours_over_faiss_at_equal_recall")
        lines.append(
            f"{row['nprobe']:6d} {row['ours_recall']:12.3f} {row['faiss_recall']:13.3f} "
            f"{row['ours_qps']:10,.0f} {row['faiss_qps']:10,.0f} "
            f"{'(faiss never as high)' if equal is None else f'{equal:.2f}':>24s}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(argv, __doc__.splitlines()[0], "rag_search", run_search, format_table)


if __name__ == "__main__":
    sys.exit(main())
