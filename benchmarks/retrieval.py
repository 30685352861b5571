"""Replay-buffer retrieval: Qdrant Edge HNSW vs numpy brute force on real MiniLM embeddings.

Workload: real (state, action) texts from the offline TextWorld data, every state of
every trajectory (and every next state) paired with each of its admissible
commands, embedded with all-MiniLM-L6-v2 and cached (`<data_dir>/.cache/
embeddings.sqlite`; ~65 texts/s here, so the first run of a large set is slow).
When there are fewer real texts than a size asks for, the set is completed by
re-embedding nothing: the script says how many vectors are real and stops at the
largest size it can fill unless `--allow-repeats` tiles the real vectors with small
noise (reported as such; HNSW on near-duplicates is not the real workload either).

For each size: build the Edge store, `optimize()` (HNSW), then for held-out query
vectors (real texts not in the store) time top-10 queries one at a time (p50, p95)
for Edge-HNSW, Edge exact and numpy brute force (matrix product + argpartition),
and recall@10 of Edge-HNSW against the exact numpy top-10 (tie-aware: a hit
scoring at least the exact 10th-best score counts). Prints ratios from this
one run; not a test.

    python benchmarks/retrieval.py --sizes 10000,100000 --m 16 --ef-construct 100 --ef 64
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.envs.base import AbstractState, StateFormatError  # noqa: E402
from simulator.embedder import Embedder, transition_text  # noqa: E402
from simulator.replay_buffer import EdgeBuffer, Transition  # noqa: E402


def real_texts(data_dir: str, family: str, limit: int) -> list[str]:
    from simulator.mexp_data import load_offline

    seen: dict[str, None] = {}
    for traj in load_offline(data_dir, family):
        for step in traj.steps:
            for state in (step.state, step.next_state):
                try:
                    items = AbstractState.parse(state).items
                except StateFormatError:
                    continue
                for _, cmd in items:
                    seen.setdefault(transition_text(state, cmd))
                    if len(seen) >= limit:
                        return list(seen)
    return list(seen)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1000.0, q))


def bench(vecs: np.ndarray, queries: np.ndarray, m: int, efc: int, ef: int, k: int = 10) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-edge-"))
    try:
        buf = EdgeBuffer(tmp / "edge", embedder=None, max_size=len(vecs) + 1, hnsw_m=m, hnsw_ef_construct=efc,
                         hnsw_ef=ef)  # type: ignore[arg-type]
        dummy = Transition("", "", "", "", "", "", 0.0, False)
        t0 = time.perf_counter()
        buf.add_vectors([dummy] * len(vecs), vecs)
        t_upsert = time.perf_counter() - t0
        t0 = time.perf_counter()
        buf.optimize()
        t_opt = time.perf_counter() - t0
        lat_hnsw, lat_exact, lat_np, recall = [], [], [], []
        for q in queries:
            t = time.perf_counter()
            ids = buf.query_ids(q[None], k)[0]
            lat_hnsw.append(time.perf_counter() - t)
            t = time.perf_counter()
            buf.query_ids(q[None], k, exact=True)
            lat_exact.append(time.perf_counter() - t)
            t = time.perf_counter()
            scores = vecs @ q
            top = np.argpartition(-scores, k)[:k]
            top = top[np.argsort(-scores[top])]
            lat_np.append(time.perf_counter() - t)
            # Tie-aware: real texts repeat states, so many vectors tie; a returned id counts as
            # correct when its exact score reaches the exact 10th-best score.
            kth = scores[top[-1]] - 1e-6
            recall.append(sum(1 for i in ids if scores[i] >= kth) / k)
        buf.close()
        return {"n": len(vecs), "upsert_s": t_upsert, "optimize_s": t_opt,
                "hnsw_p50_ms": pct(lat_hnsw, 50), "hnsw_p95_ms": pct(lat_hnsw, 95),
                "edge_exact_p50_ms": pct(lat_exact, 50), "numpy_p50_ms": pct(lat_np, 50),
                "numpy_p95_ms": pct(lat_np, 95), "recall_at_10": float(np.mean(recall))}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--family", default="textworld")
    p.add_argument("--sizes", default="10000,100000")
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--ef-construct", type=int, default=100)
    p.add_argument("--ef", type=int, default=64)
    p.add_argument("--allow-repeats", action="store_true", help="tile real vectors (+noise) to reach a size")
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    texts = real_texts(args.data_dir, args.family, max(sizes) + args.queries)
    emb = Embedder(cache_path=Path(args.data_dir) / ".cache" / "embeddings.sqlite", batch_size=32)
    t0 = time.perf_counter()
    allv = emb.embed(texts)
    print(f"{len(texts)} real (state, action) texts embedded/cached in {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(allv))
    queries, pool = allv[perm[:args.queries]], allv[perm[args.queries:]]
    results = []
    for n in sizes:
        if n > len(pool):
            if not args.allow_repeats:
                print(f"size {n}: only {len(pool)} real vectors; skipped (rerun with more offline data, or --allow-repeats)")
                continue
            reps = pool[rng.integers(0, len(pool), n)] + rng.normal(0, 0.02, (n, pool.shape[1])).astype(np.float32)
            vecs = (reps / np.linalg.norm(reps, axis=1, keepdims=True)).astype(np.float32)
            real = len(pool)
        else:
            vecs, real = pool[:n], n
        r = bench(vecs, queries, args.m, args.ef_construct, args.ef)
        r.update({"real_vectors": real, "m": args.m, "ef_construct": args.ef_construct, "ef": args.ef})
        results.append(r)
        print(f"n={n:>7} (real {real}): Edge HNSW p50 {r['hnsw_p50_ms']:.2f} ms p95 {r['hnsw_p95_ms']:.2f} ms, "
              f"recall@10 {r['recall_at_10']:.3f} | Edge exact p50 {r['edge_exact_p50_ms']:.2f} ms | numpy p50 "
              f"{r['numpy_p50_ms']:.2f} ms | speed-up vs numpy {r['numpy_p50_ms'] / r['hnsw_p50_ms']:.1f}x | "
              f"optimize {r['optimize_s']:.1f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    emb.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
