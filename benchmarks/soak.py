"""Soak: run `dreamgym train` for N minutes and measure whether memory grows.

Runs the real loop as a child process (real TextWorld games, a rollout worker, the
embedded engine, the learner, checkpoints and acks after them, on a Redis this script
starts with appendonly), with stand-ins for speed: a tiny random-initialised Llama that
carries SmolLM2's tokenizer serves the policy and trains (the same code paths at a
thousandth of the cost), PPO so that every trajectory trains, and no evaluation.
Every `--every` seconds it samples the RSS of each process of the job (the driver and
any child) and Redis's `used_memory`, then prints each series' least-squares slope in
MB/min, fitted after the first `--warmup` fraction of the run (model loading, caches
filling up). Issue 12's goal: flat, under 1 MB/min over 30 minutes.

    python benchmarks/soak.py --minutes 2           # a quick look
    python benchmarks/soak.py --minutes 30 --json soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import psutil
import redis

from tiny_job import fitted_slope, job_processes, load, start_train, tiny_overrides

from infra.redis_server import EmbeddedRedis  # noqa: E402 (tiny_job put the checkout on the path)
from infra.streams import trajectories_stream  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=2.0, help="how long the loop runs (default: %(default)s)")
    p.add_argument("--every", type=float, default=5.0, help="seconds between samples (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=0.25, help="fraction of the run left out of the fit")
    p.add_argument("--workdir", default="", help="keep runs and data here (default: a temporary directory)")
    p.add_argument("--data-dir", default="", help="games and offline data (default: <workdir>/data; reuse one to skip building them)")
    p.add_argument("--json", default="", help="also write the samples and slopes to this file")
    args = p.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="dreamgym-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    budget_s = args.minutes * 60
    name = "soak"
    with EmbeddedRedis(data_dir=work / "redis", appendonly=True) as server:
        overrides = tiny_overrides(work, args.data_dir or work / "data", server.url, budget_s)
        proc = start_train(name, overrides, work / "train.log")
        root = psutil.Process(proc.pid)
        client = redis.Redis.from_url(server.url)
        redis_proc = psutil.Process(server.proc.pid)
        stream = trajectories_stream(f"dreamgym:{name}")
        series: dict[str, list[tuple[float, float]]] = {}
        t0 = None
        try:
            while proc.poll() is None:
                time.sleep(args.every)
                if proc.poll() is not None:  # exited during the sleep: an unreaped driver reads as 0 MB
                    break
                if t0 is None:  # the clock starts when the learner is running (first update's file)
                    if not (work / "runs" / name / "learner_inflight.json").exists():
                        continue
                    t0 = time.monotonic()
                t = time.monotonic() - t0
                for label, pr in job_processes(root).items():
                    try:
                        if pr.status() != psutil.STATUS_ZOMBIE:
                            series.setdefault(f"rss {label}", []).append((t, pr.memory_info().rss))
                    except psutil.NoSuchProcess:
                        pass
                series.setdefault("rss redis-server", []).append((t, redis_proc.memory_info().rss))
                series.setdefault("redis used_memory", []).append((t, client.info("memory")["used_memory"]))
                series.setdefault("stream length", []).append((t, client.xlen(stream) * 1e6))  # counted as "MB"
                series.setdefault("load average 1m", []).append((t, os.getloadavg()[0] * 1e6))  # as "MB" too
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
            client.close()
        summary_path = work / "runs" / name / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}

    rows = []
    for label, samples in series.items():
        unit = {"stream length": "entries/min", "load average 1m": "per min"}.get(label, "MB/min")
        first, last = samples[0][1], samples[-1][1]
        rows.append({"series": label, "samples": len(samples), "first": round(first / 1e6, 1),  # all stored x 1e6
                     "last": round(last / 1e6, 1), "slope": round(fitted_slope(samples, args.warmup), 3), "unit": unit})
    print(f"soak: {args.minutes:g} min, exit {rc}, {summary.get('updates', '?')} updates, "
          f"{summary.get('trajectories_trained', '?')} trajectories trained, "
          f"{summary.get('trajectories_pushed', '?')} pushed; slopes fitted after the first {args.warmup:.0%}")
    print(f"{'series':32} {'samples':>7} {'first':>10} {'last':>10} {'slope':>10}")
    for r in rows:
        print(f"{r['series']:32} {r['samples']:7d} {r['first']:10.1f} {r['last']:10.1f} {r['slope']:10.3f} {r['unit']}")
    memory = [r for r in rows if r["unit"] == "MB/min" and r["slope"] == r["slope"]]  # not NaN
    if memory:
        worst = max(memory, key=lambda r: r["slope"])
        print(f"ratio steepest memory slope / goal (1 MB/min): {worst['slope'] / 1.0:.2f} ({worst['series']})  "
              f"({load()} at end)")
    else:
        print("ratio steepest memory slope / goal (1 MB/min): n/a (no samples: the learner never started)")
    if args.json:
        Path(args.json).write_text(json.dumps({"minutes": args.minutes, "rc": rc, "summary": {
            k: summary.get(k) for k in ("updates", "trajectories_trained", "trajectories_pushed")},
            "slopes": rows, "samples": series}, indent=1))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
