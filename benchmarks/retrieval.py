"""Replay-buffer retrieval: Qdrant Edge HNSW vs numpy brute force on real MiniLM embeddings.

Workload: real (state, action) pairs from the offline TextWorld data (every state of
every trajectory, and every next state, paired with each of its admissible
commands), embedded with all-MiniLM-L6-v2 exactly as the buffer embeds them
(`transition_text`) and cached in `<data_dir>/.cache/embeddings.sqlite`. These
states are long (MiniLM reads 256 word pieces of each), so embedding runs at ~35
texts/s here: the first 100 k run takes about an hour; later runs read the cache.
When the data directory holds too few real texts, the script builds the `--config` data
set there first (as `dreamgym collect` does; configs/retrieval_bench.yaml: ~111 k distinct
real texts in about 8 minutes, then the hour of embedding):

    python benchmarks/retrieval.py --sizes 10000,100000
    # a smoke run on a tiny data set:
    python benchmarks/retrieval.py --data-dir /tmp/rb --sizes 40 --queries 20 \
        --set data.textworld_games=2 data.textworld_families=[custom] data.episodes_per_task=1

When there are fewer real texts than a size asks for, the size is skipped unless
`--allow-repeats` tiles the real vectors with small noise (reported as such; HNSW on
near-duplicates is not the real workload either).

For each size and each HNSW build setting (`--m`, `--ef-construct`, comma lists):
upsert real payloads, `optimize()`, then for held-out queries (texts not in the
store), one query at a time after a short untimed warm-up, time top-10 for each
query-time `--ef` (the sweep reuses the index): Edge HNSW ids only, and the serving path (payloads decoded, the
querying episode filtered out, as `EdgeBuffer.query_vectors` does); Edge exact
search and numpy brute force (matrix product + argpartition) on the same vectors.
recall@10 is against the exact numpy top-10, tie-aware (a hit scoring at least the
exact 10th-best score counts: real states repeat, so scores tie). Prints ratios
from this one run; not a test. The setting to use is the cheapest with recall@10
>= 0.95; `simulator.hnsw_*` in the config carry it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.dataset import trajectories_path  # noqa: E402
from actors.envs.base import AbstractState, StateFormatError  # noqa: E402
from infra.config import load_config  # noqa: E402
from simulator.embedder import Embedder, transition_text  # noqa: E402
from simulator.replay_buffer import EdgeBuffer, Transition  # noqa: E402


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def real_pairs(data_dir: str, family: str, limit: int) -> list[tuple[str, str]]:
    """Distinct real (state, command) pairs, in data order, at most `limit` (none when there is no data)."""
    from simulator.mexp_data import load_offline

    if not trajectories_path(data_dir, family).exists():
        return []
    seen: dict[str, tuple[str, str]] = {}
    for traj in load_offline(data_dir, family):
        for step in traj.steps:
            for state in (step.state, step.next_state):
                try:
                    items = AbstractState.parse(state).items
                except StateFormatError:
                    continue
                for _, cmd in items:
                    seen.setdefault(transition_text(state, cmd), (state, cmd))
                    if len(seen) >= limit:
                        return list(seen.values())
    return list(seen.values())


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1000.0, q))


def timed(fn, queries: np.ndarray, warmup: int = 20) -> tuple[list[float], list]:
    for q in queries[:warmup]:  # untimed: the first calls after a build pay for cold caches
        fn(q)
    lat, out = [], []
    for q in queries:
        t = time.perf_counter()
        out.append(fn(q))
        lat.append(time.perf_counter() - t)
    return lat, out


def recall_at(ids: list[list[int]], kth: list[float], scores: list[np.ndarray], k: int) -> float:
    """Tie-aware recall@k: a returned id counts when its exact score reaches the exact k-th best."""
    return float(np.mean([sum(1 for i in got[:k] if s[i] >= t) / k for got, s, t in zip(ids, scores, kth)]))


def bench(pairs: list[tuple[str, str]], vecs: np.ndarray, queries: np.ndarray, m: int, efc: int, efs: list[int],
          k: int = 10) -> list[dict]:
    def numpy_top(q: np.ndarray) -> np.ndarray:
        sc = vecs @ q
        top = np.argpartition(-sc, k)[:k]
        return top[np.argsort(-sc[top])]

    lat_np, _ = timed(numpy_top, queries)  # the baseline, timed like the store: one query at a time
    scores = [vecs @ q for q in queries]
    kth = [float(np.partition(sc, -k)[-k]) - 1e-6 for sc in scores]
    tmp = Path(tempfile.mkdtemp(prefix="bench-edge-"))
    try:
        buf = EdgeBuffer(tmp / "edge", embedder=None, max_size=len(vecs) + 1, hnsw_m=m, hnsw_ef_construct=efc,
                         hnsw_ef=efs[0])  # type: ignore[arg-type]
        ts = [Transition(f"task-{i % 300}", "", st, a, "", st, 0.0, False, episode_id=f"ep-{i % 2000}")
              for i, (st, a) in enumerate(pairs)]
        t0 = time.perf_counter()
        buf.add_vectors(ts, vecs)
        t_upsert = time.perf_counter() - t0
        t0 = time.perf_counter()
        buf.optimize()
        t_opt = time.perf_counter() - t0
        lat_exact, _ = timed(lambda q: buf.query_ids(q[None], k, exact=True), queries)
        rows = []
        for ef in efs:
            buf.hnsw_ef = ef
            lat_hnsw, ids = timed(lambda q: buf.query_ids(q[None], k)[0], queries)
            lat_serve, _ = timed(lambda q: buf.query_vectors(q[None], k, exclude_episodes=["ep-7"]), queries)
            t0 = time.perf_counter()
            buf.query_vectors(queries, k, exclude_episodes=["ep-7"])  # one batched call, as workers send them
            batch_ms = (time.perf_counter() - t0) * 1000 / len(queries)
            rows.append({"n": len(vecs), "m": m, "ef_construct": efc, "ef": ef, "upsert_s": t_upsert,
                         "optimize_s": t_opt, "hnsw_p50_ms": pct(lat_hnsw, 50), "hnsw_p95_ms": pct(lat_hnsw, 95),
                         "serve_p50_ms": pct(lat_serve, 50), "serve_p95_ms": pct(lat_serve, 95),
                         "serve_batched_ms_per_query": batch_ms, "edge_exact_p50_ms": pct(lat_exact, 50),
                         "numpy_p50_ms": pct(lat_np, 50), "numpy_p95_ms": pct(lat_np, 95),
                         "recall_at_10": recall_at(ids, kth, scores, k)})
        buf.close()
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def embed_all(emb: Embedder, texts: list[str], chunk: int = 2048) -> np.ndarray:
    """Embed in chunks (each cached as it finishes, so an interrupted run resumes) with progress."""
    out, t0 = [], time.perf_counter()
    for i in range(0, len(texts), chunk):
        out.append(emb.embed(texts[i:i + chunk]))
        done = min(i + chunk, len(texts))
        rate = done / max(time.perf_counter() - t0, 1e-9)
        print(f"\rembedded {done}/{len(texts)} ({rate:.0f}/s incl. cache hits)", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return np.concatenate(out) if out else np.zeros((0, Embedder.dim), np.float32)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/retrieval_bench.yaml",
                   help="the data set built first when the data directory holds too few real texts")
    p.add_argument("--set", nargs="*", default=[], help="overrides of --config, key=value (a tiny data set for a smoke run)")
    p.add_argument("--data-dir", default="", help="data directory holding offline/<family> trajectories "
                                                  "(default: the config's infra.data_dir)")
    p.add_argument("--family", default="textworld")
    p.add_argument("--sizes", default="10000,100000", help="store sizes, comma-separated")
    p.add_argument("--queries", type=int, default=200, help="held-out query texts (not in any store)")
    p.add_argument("--m", default="16", help="HNSW m values to build with, comma-separated")
    p.add_argument("--ef-construct", default="100", help="HNSW ef_construct values, comma-separated")
    p.add_argument("--ef", default="64", help="query-time hnsw_ef values to sweep on each index, comma-separated")
    p.add_argument("--allow-repeats", action="store_true", help="tile real vectors (+noise) to reach a size")
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args()
    sizes = ints(args.sizes)
    cfg = load_config(args.config, list(args.set) + ([f"infra.data_dir={args.data_dir}"] if args.data_dir else []))
    args.data_dir = cfg.infra.data_dir
    pairs = real_pairs(args.data_dir, args.family, max(sizes) + args.queries)
    if len(pairs) <= args.queries:
        from infra.run.artifacts import prepare_data  # games and a collector: only when data is missing

        print(f"only {len(pairs)} real (state, action) pairs under {args.data_dir}: building {args.config}'s data set "
              f"there (not timed)", flush=True)
        cfg.actors.env_family = args.family
        prepare_data(cfg)
        pairs = real_pairs(args.data_dir, args.family, max(sizes) + args.queries)
    if len(pairs) <= args.queries:
        print(f"only {len(pairs)} real (state, action) pairs under {args.data_dir}: fewer than --queries")
        return 1
    emb = Embedder(cache_path=Path(args.data_dir) / ".cache" / "embeddings.sqlite", batch_size=64)
    t0 = time.perf_counter()
    allv = embed_all(emb, [transition_text(st, a) for st, a in pairs])
    print(f"{len(pairs)} real (state, action) texts embedded/cached in {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(allv))
    queries = allv[perm[:args.queries]]
    pool_idx = perm[args.queries:]
    results = []
    for n in sizes:
        if n <= len(pool_idx):
            idx, vecs, real = pool_idx[:n], allv[pool_idx[:n]], n
        elif args.allow_repeats:
            idx = pool_idx[rng.integers(0, len(pool_idx), n)]
            noisy = allv[idx] + rng.normal(0, 0.02, (n, allv.shape[1])).astype(np.float32)
            vecs, real = (noisy / np.linalg.norm(noisy, axis=1, keepdims=True)).astype(np.float32), len(pool_idx)
        else:
            print(f"size {n}: only {len(pool_idx)} real vectors; skipped (collect more data, or --allow-repeats)")
            continue
        for m in ints(args.m):
            for efc in ints(args.ef_construct):
                for r in bench([pairs[i] for i in idx], vecs, queries, m, efc, ints(args.ef)):
                    r["real_vectors"] = real
                    results.append(r)
                    print(f"n={n:>7} (real {real}) m={m} ef_construct={efc} ef={r['ef']}: "
                          f"HNSW p50 {r['hnsw_p50_ms']:.2f} ms p95 {r['hnsw_p95_ms']:.2f} ms, "
                          f"recall@10 {r['recall_at_10']:.3f} | serving path p50 {r['serve_p50_ms']:.2f} ms, "
                          f"batched {r['serve_batched_ms_per_query']:.2f} ms/query | Edge exact p50 "
                          f"{r['edge_exact_p50_ms']:.2f} ms | numpy p50 {r['numpy_p50_ms']:.2f} ms "
                          f"({r['numpy_p50_ms'] / r['hnsw_p50_ms']:.1f}x HNSW) | optimize {r['optimize_s']:.1f} s  "
                          f"({load()})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    for n in sorted({r["n"] for r in results}):  # the cheapest setting that keeps recall, per size
        ok = [r for r in results if r["n"] == n and r["recall_at_10"] >= 0.95] or [r for r in results if r["n"] == n]
        r = min(ok, key=lambda r: r["hnsw_p50_ms"])
        print(f"ratio numpy brute force / Edge HNSW p50 at n={n}: {r['numpy_p50_ms'] / r['hnsw_p50_ms']:.2f}x "
              f"(m={r['m']} ef_construct={r['ef_construct']} ef={r['ef']}, recall@10 {r['recall_at_10']:.3f})  ({load()})")
    emb.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
