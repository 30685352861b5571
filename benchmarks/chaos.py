"""Chaos soak: a real `dreamgym train` with Ray actors, `kill -9` of one part every few minutes.

Runs benchmarks/tiny_job.py's small real job (real TextWorld games, the tiny random Llama
served by the embedded engine, PPO, no evaluation) with `actors.runtime=ray`: the rollout
workers, the learner and the policy engine are Ray actors, on a Redis this script owns
(appendonly, as a deployment's Redis has its own supervisor). Every `--every` seconds
(jittered, seeded) it SIGKILLs one of:

- `worker`: a rollout worker actor's process;
- `learner`: the learner actor's process;
- `engine`: the embedded policy engine actor's process (a real-environment run has no Mexp);
- `redis`: the server; this script restarts it on the same port and directory after
  `--redis-down-s`, as its supervisor would;
- `job`: every process of the job (driver, Ray, actors, environments), then starts it again
  with `--resume`.

Roles come in seeded shuffled rounds, so every role is hit once per five kills; a learner or job
kill waits while entries carry a strike from the last one (two deaths inside one update is the
poison-message rule, learner/inflight.py, which dead-letters them by design). This script
is also the job's supervisor: a job that exits before the end, or makes no update for
`--stall-s`, is killed whole and resumed. It prints, from the run's own records and the streams:
trajectories pushed (every entry of the trajectory stream, read as it arrives, before the
learner's acks trim it), trained exactly once, trained twice, set aside, dead-lettered and lost
(learner/trained_record.py's record of which trajectories entered which update, rebuilt for
the final weights); dead letters by stream and reason; the longest gap between updates; the
time to recover from each kill (the role's processes back to their count and an update applied
after that); the RSS slope of every process, fitted after the first quarter. The run's own
counters (summary.json) are printed beside them. Assertions, named when they fail (exit 1):
0 lost, 0 trained twice, 0 good trajectories dead-lettered, recovery <= 30 s for a worker, the
engine or Redis and <= 120 s for the learner or the whole job, updates keep coming (no gap over
`--max-gap-s`, nor between the last update and the end), every RSS slope <= 1 MB/min. Where it departs from
issue 63's soak: the supervisor of the job and of Redis is this script.

    python benchmarks/chaos.py --minutes 3 --every 30       # CI's version (tests/test_chaos.py)
    python benchmarks/chaos.py --minutes 120 --json chaos.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil
import redis

from tiny_job import load, slope_mb_per_min, start_train, tiny_overrides

from infra.redis_server import EmbeddedRedis  # noqa: E402 (tiny_job put the checkout on the path)
from infra.schema import Trajectory, decode_as  # noqa: E402
from infra.streams import DATA_FIELD, dead_letter_stream, tasks_stream, trajectories_stream  # noqa: E402
from learner import checkpoint as ckpt  # noqa: E402
from learner.inflight import InflightLedger  # noqa: E402
from learner import trained_record  # noqa: E402

ROLES = ("worker", "learner", "engine", "redis", "job")
TITLES = {"worker": "ray::RolloutWorkerActor", "learner": "ray::LearnerActor", "engine": "ray::EmbeddedEngineActor"}
BOUND_S = {"worker": 30.0, "engine": 30.0, "redis": 30.0, "learner": 120.0, "job": 120.0}
NAME = "chaos"


def title(p: psutil.Process) -> str:
    """A process's label: its Ray actor class (`ray::name:Class.method` -> `ray::Class`; `ray::IDLE` until an
    actor moves in), else its executable's module or name."""
    try:
        cmd = p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    if cmd and cmd[0].startswith("ray::"):
        return "ray::" + cmd[0][5:].split()[0].split(".")[0].rsplit(":", 1)[-1]
    if "-m" in cmd and cmd.index("-m") + 1 < len(cmd):
        return cmd[cmd.index("-m") + 1]
    return Path(cmd[0]).name if cmd else p.name()


@dataclass
class Kill:
    role: str
    t: float  # seconds since the start of the soak
    pids: list[int]
    before: int  # the role's processes just before
    restored: float | None = None  # the role's processes back to `before`
    recovered: float | None = None  # and an update applied after that

    @property
    def seconds(self) -> float | None:
        return None if self.recovered is None else self.recovered - self.t


class Job:
    """The `dreamgym train` job under supervision: start, resume, its processes by role, kill it whole."""

    def __init__(self, work: Path, data_dir: str, redis_url: str, seconds: float, t0: float, extra: list[str]):
        self.work, self.data_dir, self.redis_url, self.t0 = work, data_dir, redis_url, t0
        self.seconds = seconds  # of training: the first segment's budget
        self.deadline: float | None = None  # set at the first update: when training must end
        self.startup_s = 0.0  # the first segment's start-up (start to first update), spent again by each restart
        self.extra, self.proc, self.starts, self.started_at = extra, None, 0, 0.0
        self.known: dict[int, float] = {}  # pid -> create_time of every process seen in the job (orphans too)

    def first_update(self) -> None:
        if self.deadline is None:
            self.startup_s = time.monotonic() - self.started_at
            self.deadline = time.monotonic() + self.seconds

    def remaining(self) -> float:
        return self.seconds if self.deadline is None else self.deadline - time.monotonic()

    def start(self) -> None:
        # On a loaded machine Ray's node start can pass its default wait (the job then exits and is resumed)
        os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
        # each segment's train budget ends at the soak's deadline (its RL phase starts after its start-up)
        budget = self.seconds if self.deadline is None else max(10.0, self.remaining() - self.startup_s)
        overrides = tiny_overrides(self.work, self.data_dir, self.redis_url, round(budget), "actors.runtime=ray",
                                   "infra.reclaim_idle_ms=3000", "actors.max_trajectory_backlog=16", *self.extra)
        self.proc = start_train(NAME, overrides, self.work / "train.log", resume=self.starts > 0)
        self.started_at = time.monotonic()
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def processes(self) -> list[psutil.Process]:
        """The driver and its descendants now; every one is remembered, so orphans can be ended later."""
        if not self.alive():
            return []
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        for p in procs:
            try:
                self.known.setdefault(p.pid, p.create_time())
            except psutil.NoSuchProcess:
                pass
        return procs

    def of_role(self, role: str) -> list[psutil.Process]:
        if role == "job":
            return self.processes()[:1]
        return [p for p in self.processes() if title(p) == TITLES[role]]

    def kill_all(self) -> list[int]:
        """SIGKILL the job's session and every process it ever had that is still the same process."""
        self.processes()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        killed = []
        for pid, created in list(self.known.items()):
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 0.01:
                    p.kill()
                    killed.append(pid)
            except psutil.NoSuchProcess:
                pass
        if self.proc is not None:
            self.proc.wait()
        self.known.clear()
        return killed


class Watch:
    """What the soak reads while it runs: the trajectory stream as it grows, and the update record."""

    def __init__(self, url: str, run_dir: Path):
        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=1)
        self.stream = trajectories_stream(f"dreamgym:{NAME}")
        self.run_dir, self.last_id, self.offset = run_dir, "0-0", 0
        self.started = time.time()
        self.first_update_at: float | None = None  # seconds into the soak
        self.pushed: dict[str, str | None] = {}  # entry id -> trajectory id (None: undecodable)
        self.updates: list[tuple[float, int]] = []  # (unix time, version) of every update applied, all segments

    def poll(self) -> None:
        try:
            while True:
                got = self.client.xread({self.stream: self.last_id}, count=500)
                if not got:
                    break
                for eid, fields in got[0][1]:
                    self.last_id = eid.decode()
                    self.pushed[self.last_id] = tid_of(fields.get(DATA_FIELD))
        except redis.RedisError:
            pass  # down (killed): read on at the next poll
        path = self.run_dir / trained_record.TRAINED_FILE
        try:
            with open(path) as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        whole = chunk[:chunk.rfind("\n") + 1]
        self.offset += len(whole.encode())
        for line in whole.splitlines():
            try:
                row = json.loads(line)
                self.updates.append((float(row["t"]), int(row["version"])))
            except (ValueError, KeyError, TypeError):
                pass

    def updates_after(self, unix_t: float) -> bool:
        return any(t > unix_t for t, _ in self.updates)


def tid_of(raw: bytes | None) -> str | None:
    try:
        return decode_as(raw, Trajectory).trajectory_id
    except Exception:  # a poison message: its fate is the dead-letter stream
        return None


def account(client: redis.Redis, watch: Watch, run_dir: Path) -> dict:
    """Where every pushed trajectory went, by trajectory id: trained once or more into the final weights,
    set aside by the learner, dead-lettered, still waiting in the stream, or lost."""
    stream = watch.stream
    latest = ckpt.latest(run_dir)
    state = ckpt.train_state(ckpt.read(latest)) if latest is not None else None
    final = state.weight_version if state else 0
    lineage = trained_record.lineage(run_dir / trained_record.TRAINED_FILE, final)
    times = Counter(i for ids in lineage.values() for i in ids)
    seen = set(state.consumed_ids) if state else set()
    dead: dict[str, dict[str, int]] = {}
    dead_tids: dict[str, str] = {}
    for s in (stream, tasks_stream(f"dreamgym:{NAME}")):
        for _, f in client.xrange(dead_letter_stream(s)):
            reason = f.get(b"error", b"?").decode().split(":")[0]
            dead.setdefault(s.rsplit(":", 1)[-1], Counter())[reason] += 1
            if s == stream and (t := tid_of(f.get(DATA_FIELD))) is not None:
                dead_tids[t] = reason
    waiting = {tid_of(fields.get(DATA_FIELD)) for _, fields in client.xrange(stream)}  # pending or undelivered
    added = int(client.xinfo_stream(stream)["entries-added"])
    pushed = {t for t in watch.pushed.values() if t is not None}
    fate: Counter = Counter()
    lost_ids = []
    for t in pushed:
        if times[t] == 1:
            fate["trained once"] += 1
        elif times[t] > 1:
            fate["trained twice or more"] += 1
        elif t in dead_tids:
            fate["dead-lettered"] += 1
        elif t in seen:
            fate["set aside"] += 1
        elif t in waiting:
            fate["waiting in the stream"] += 1
        else:
            fate["lost"] += 1
            lost_ids.append(t)
    return {"final_version": final, "versions_recorded": len(lineage),
            "versions_missing": [v for v in range(1, final + 1) if v not in lineage],
            "entries_added": added, "entries_seen": len(watch.pushed),
            "undecodable": sum(t is None for t in watch.pushed.values()),
            "pushed": len(pushed), **{k: fate.get(k, 0) for k in (
                "trained once", "trained twice or more", "set aside", "dead-lettered", "waiting in the stream", "lost")},
            "trained_unpushed": len(set(times) - pushed), "lost_ids": lost_ids[:10],
            "good_dead_lettered": len(dead_tids), "dead_letters": {k: dict(v) for k, v in dead.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=120.0, help="minutes of training under chaos, from the first update (default: %(default)s)")
    p.add_argument("--every", type=float, default=180.0, help="mean seconds between kills, jittered +-50%% (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the roles' order and the jitter")
    p.add_argument("--roles", default=",".join(ROLES), help="roles to kill, comma-separated (default: all five)")
    p.add_argument("--redis-down-s", type=float, default=1.0, help="seconds Redis stays down before its restart")
    p.add_argument("--stall-s", type=float, default=240.0, help="supervisor: no update for this long -> kill and resume")
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="give up when no update came this long after the start")
    p.add_argument("--max-gap-s", type=float, default=150.0, help="assertion: longest gap between updates")
    p.add_argument("--quiet-s", type=float, default=0.0, help="no kill in the run's last seconds (default: --every/2, at least 40)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--warmup", type=float, default=0.25, help="share of the run left out of the RSS fits")
    p.add_argument("--rss-span-s", type=float, default=900.0,
                   help="an RSS fit is asserted where it spans this long (or half the fitted time, if less); kills "
                        "restart processes, so give a long soak a calm end with --quiet-s (default: %(default)s)")
    p.add_argument("--workdir", default="", help="keep the run here (default: a temporary directory)")
    p.add_argument("--data-dir", default="", help="games and offline data (default: <workdir>/data; reuse one to skip building)")
    p.add_argument("--set", nargs="*", default=[], help="more `dreamgym train` overrides")
    p.add_argument("--json", default="", help="also write the figures to this file")
    args = p.parse_args()
    roles = [r for r in args.roles.split(",") if r]
    if not roles or any(r not in ROLES for r in roles):
        p.error(f"--roles: choose among {', '.join(ROLES)}")
    quiet = args.quiet_s or max(40.0, args.every / 2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped soak still ends its job and Redis

    work = Path(args.workdir or tempfile.mkdtemp(prefix="dreamgym-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / "runs" / NAME
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    at = lambda: time.monotonic() - t0  # noqa: E731
    kills: list[Kill] = []
    restarts: list[dict] = []
    rss: dict[str, list[tuple[float, float]]] = {}
    labels: dict[str, str] = {}
    order: list[str] = []
    next_kill, next_sample = None, 0.0
    redis_back_at = None
    server = EmbeddedRedis(data_dir=work / "redis", appendonly=True).start()
    job = Job(work, args.data_dir or str(work / "data"), server.url, args.minutes * 60, t0, list(args.set))
    watch = Watch(server.url, run_dir)
    rc = None
    try:
        job.start()
        while True:
            time.sleep(0.5)
            now = at()
            if redis_back_at is not None and now >= redis_back_at:
                server.start()  # same port, directory and password: the AOF brings the streams back
                redis_back_at = None
            watch.poll()
            if watch.updates and job.deadline is None:
                job.first_update()
                watch.first_update_at = now
            if not job.alive():
                rc = job.proc.returncode
                # a kill not yet recovered is always resumed (a learner killed near the end exits the driver: ending
                # the soak there would count as "not recovered" a kill the quiet window let through), else the job
                # spent its budget and wrote its summary, or too little time is left to resume it
                unrecovered = any(k.recovered is None for k in kills)
                if rc == 0 or (job.deadline is not None
                               and (job.remaining() < -300 or (job.remaining() < 30 and not unrecovered))):
                    break
                job.kill_all()  # orphans of a crashed driver (its Ray actors) go with it
                restarts.append({"t": round(now, 1), "why": f"exited with {rc}"})
                job.start()
                continue
            if job.deadline is None and now > args.start_timeout_s:
                restarts.append({"t": round(now, 1), "why": f"no first update in {args.start_timeout_s:.0f} s: ended"})
                job.kill_all()
                break
            if job.deadline is not None and job.remaining() < -300:  # it should have ended on its budget
                restarts.append({"t": round(now, 1), "why": "still running 300 s past its budget: killed"})
                job.kill_all()
                break
            # a segment that has not updated yet is still starting (minutes on a loaded machine): its own timeout
            started_unix = time.time() - (time.monotonic() - job.started_at)
            last_update = max((t for t, _ in watch.updates), default=0.0)
            limit = args.stall_s if last_update > started_unix else args.start_timeout_s
            since = time.time() - max(last_update, started_unix)
            if job.deadline is not None and since > limit and redis_back_at is None:
                restarts.append({"t": round(now, 1), "why": f"no update for {since:.0f} s: killed and resumed"})
                job.kill_all()
                job.start()
                continue
            procs = job.processes()
            if now >= next_sample:  # RSS of every process of the job, and of Redis
                next_sample = now + args.sample_s
                for pr in procs + ([psutil.Process(server.proc.pid)] if server.proc else []):
                    try:
                        key = str(pr.pid)
                        rss.setdefault(key, []).append((now, pr.memory_info().rss))
                        if (label := title(pr)) != "ray::IDLE":
                            labels[key] = f"{label}-{pr.pid}"
                    except psutil.NoSuchProcess:
                        pass
            for k in kills:  # recovery of every open kill
                if k.restored is None:
                    n = (1 if server.proc is not None and redis_back_at is None else 0) if k.role == "redis" \
                        else len(job.of_role(k.role))
                    if n >= k.before:
                        k.restored = now
                if k.restored is not None and k.recovered is None and watch.updates_after(time.time() - (now - k.restored)):
                    k.recovered = now
            if job.deadline is None:
                continue
            if next_kill is None:
                next_kill = now + args.every * rng.uniform(0.5, 1.5)
            # one kill at a time: the next waits until the last recovered, or is past twice its bound (a violation),
            # and never hits a job that has not updated since it (re)started: that measures start-up, not recovery
            busy = any(k.recovered is None and now - k.t < 2 * BOUND_S[k.role] for k in kills) or \
                last_update <= started_unix
            if now >= next_kill and not busy and job.remaining() > quiet:
                if not order:
                    order = rng.sample(roles, len(roles))
                # the learner's or the job's kill waits while entries carry a strike (a previous kill landed inside
                # their update): a second death in their retrain is the poison-message rule, which dead-letters them
                # by design (learner/inflight.py), not a delivery fault this soak looks for
                if order[0] in ("learner", "job") and InflightLedger(run_dir).strikes:
                    continue
                role = order.pop(0)
                kills.append(chaos_kill(role, job, server))
                print(f"[{now:7.1f} s] kill -9 {role} {kills[-1].pids}  ({load()})", flush=True)
                if role == "redis":
                    redis_back_at = now + args.redis_down_s
                if role == "job":
                    job.start()  # the supervisor restarts it at once
                next_kill = now + args.every * rng.uniform(0.5, 1.5)
        figures = account(redis.Redis.from_url(server.url), watch, run_dir)
    finally:
        if job.alive():
            job.kill_all()
        server.stop()
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    # a process gone between listing and its first reading leaves no sample
    rss = {labels.get(pid, f"?-{pid}"): samples for pid, samples in rss.items() if samples}
    return report(args, kills, restarts, rss, watch, figures, summary, rc, at(), job.startup_s)


def chaos_kill(role: str, job: Job, server: EmbeddedRedis) -> Kill:
    t = time.monotonic() - job.t0
    if role == "redis":
        pid = server.proc.pid
        server.proc.kill()
        server.proc.wait()
        server.proc = None
        return Kill(role, t, [pid], 1)
    if role == "job":
        before = 1
        return Kill(role, t, job.kill_all()[:1] or [], before)
    procs = job.of_role(role)
    if not procs:
        return Kill(role, t, [], 0)
    victim = random.Random(int(t * 1000)).choice(procs)
    victim.kill()
    return Kill(role, t, [victim.pid], len(procs))


def report(args: argparse.Namespace, kills: list[Kill], restarts: list[dict], rss: dict, watch: Watch,
           figures: dict, summary: dict, rc: int | None, elapsed: float, startup_s: float = 0.0) -> int:
    violations = []
    print(f"chaos soak: {elapsed / 60:.1f} min, {len(kills)} kills, {len(restarts)} supervisor restarts, "
          f"last exit {rc}  ({load()} at end)")
    print("trajectories (by id, over every segment):")
    for k in ("pushed", "trained once", "trained twice or more", "set aside", "dead-lettered",
              "waiting in the stream", "lost"):
        print(f"  {k:24} {figures[k]}")
    print(f"  stream entries added {figures['entries_added']}, seen by this script {figures['entries_seen']} "
          f"(undecodable {figures['undecodable']}); final weight version {figures['final_version']}, "
          f"{figures['versions_recorded']} of its updates in the trained record")
    print(f"  the run's own counters (summary.json): pushed {summary.get('trajectories_pushed', '?')}, "
          f"trained {summary.get('trajectories_trained', '?')}, redelivered {summary.get('trajectories_redelivered', '?')}, "
          f"updates {summary.get('updates', '?')}")
    print(f"dead letters by stream and reason: {json.dumps(figures['dead_letters']) or '{}'}")
    times = sorted(t for t, _ in watch.updates)
    gaps = [(b - a, a) for a, b in zip(times, times[1:])]
    longest = max(gaps, default=(0.0, 0.0))
    print(f"updates applied (every segment): {len(times)}; longest gap between updates {longest[0]:.1f} s")
    print("recovery after each kill (role processes back, then an update):")
    by_role: dict[str, list[float | None]] = {}
    for k in kills:
        s = k.seconds
        by_role.setdefault(k.role, []).append(s)
        print(f"  {k.t:7.1f} s  {k.role:8} pids {k.pids}  " + (f"recovered in {s:.1f} s" if s is not None else "NOT recovered"))
        if s is None:
            violations.append(f"{k.role} killed at {k.t:.0f} s: not recovered")
        elif s > BOUND_S[k.role]:
            violations.append(f"{k.role} killed at {k.t:.0f} s: recovered in {s:.0f} s > {BOUND_S[k.role]:.0f} s")
    for role, secs in by_role.items():
        ok = [s for s in secs if s is not None]
        print(f"  {role:8} {len(secs)} kills, recovery max {max(ok):.1f} s" if ok else f"  {role:8} {len(secs)} kills, none recovered")
    for r in restarts:
        print(f"  supervisor restart at {r['t']} s: {r['why']}")
    # the fit starts after the first quarter of the training time (start-up excluded), and for a process
    # started later (a resumed job's) once its own start-up is over (as long as the first one took) and
    # after the first quarter of its own samples
    trained_from = watch.first_update_at or 0.0
    quarter = trained_from + args.warmup * max(0.0, elapsed - trained_from)
    need = max(60.0, min(args.rss_span_s, (elapsed - quarter) / 2))
    slopes: dict[str, float] = {}
    print(f"RSS slopes (MB/min) fitted after the first {args.warmup:.0%} of the training time ({quarter:.0f} s), a "
          f"process's start-up ({startup_s:.0f} s) and the first {args.warmup:.0%} of its own samples; asserted where "
          f"the fit spans >= {need:.0f} s:")
    for label, samples in sorted(rss.items()):
        own = [(t, v) for t, v in samples if t >= samples[0][0] + startup_s]
        own = own[int(len(own) * args.warmup):]
        fit = [(t, v) for t, v in own if t >= quarter]
        slope = slope_mb_per_min(fit)
        slopes[label] = slope
        asserted = len(fit) > 1 and fit[-1][0] - fit[0][0] >= need
        print(f"  {label:40} {len(samples):4d} samples {samples[0][1] / 1e6:8.1f} -> {samples[-1][1] / 1e6:8.1f} MB  "
              f"slope {slope:8.3f}{'' if asserted else '  (too short to assert)'}")
        if asserted and slope > 1.0:
            violations.append(f"RSS of {label} grows {slope:.2f} MB/min > 1 MB/min")
    if figures["lost"]:
        violations.append(f"{figures['lost']} trajectories lost (e.g. {figures['lost_ids'][:3]})")
    if figures["trained twice or more"]:
        violations.append(f"{figures['trained twice or more']} trajectories trained twice")
    if figures["good_dead_lettered"]:
        violations.append(f"{figures['good_dead_lettered']} good trajectories dead-lettered")
    if figures["versions_missing"]:
        violations.append(f"updates missing from the trained record: {figures['versions_missing'][:10]}")
    if figures["entries_seen"] < figures["entries_added"]:
        violations.append(f"{figures['entries_added'] - figures['entries_seen']} stream entries were trimmed before "
                          "this script read them: the accounting is incomplete")
    if longest[0] > args.max_gap_s:
        violations.append(f"updates stopped for {longest[0]:.0f} s > {args.max_gap_s:.0f} s")
    # updates keep coming: no long gap, and none at the end either (until the deadline, or the job's end)
    end = watch.started + min(elapsed, (watch.first_update_at or 0.0) + args.minutes * 60)
    if not times:
        violations.append("no update at all")
    elif end - times[-1] > args.max_gap_s:
        violations.append(f"no update in the last {end - times[-1]:.0f} s of the training time")
    print("violations: " + ("none" if not violations else ""))
    for v in violations:
        print(f"  VIOLATION: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "minutes": args.minutes, "every": args.every, "seed": args.seed, "figures": figures,
            "kills": [k.__dict__ | {"seconds": k.seconds} for k in kills], "restarts": restarts,
            "longest_gap_s": longest[0], "updates": len(times), "violations": violations,
            "rss_slopes": slopes}, indent=1, default=str))
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
