"""Bring your own environment: plug-in families by import path, entry point and gymnasium id
(actors/envs/registry.py, actors/envs/gym_adapter.py), and the worked example
(examples/keydoor.py) through `dreamgym collect`, `train-mexp` and a DreamGym `train`."""

from __future__ import annotations

import json
import string
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

from actors.dataset import read_trajectories, trajectories_path
from actors.envs.base import AbstractState, validate_state
from actors.envs.expert import make_chooser
from actors.envs.registry import canonical_family, load_or_make_splits, make_env, plugin_class
from actors.evaluate import evaluate
from examples.keydoor import KeyDoorEnv
from infra.config import ConfigError, load_config

KEYDOOR = "examples.keydoor:KeyDoorEnv"
ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "infra.cli"]


class Counter(gym.Env):
    """A gymnasium text game: count up to the target by choosing labelled actions (Discrete(3))."""

    action_labels = ["add one", "add two", "reset to zero"]

    def __init__(self):
        self.observation_space = gym.spaces.Text(200, charset=string.printable)
        self.action_space = gym.spaces.Discrete(3)

    def _obs(self):
        return f"Goal: reach {self.target}\nCount: {self.n}"

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target, self.n = 3 + int(self.np_random.integers(4)), 0
        return self._obs(), {"instruction": f"reach {self.target}", "expert_action": "add one"}

    def step(self, action):
        self.n = {0: self.n + 1, 1: self.n + 2, 2: 0}[int(action)]
        won = self.n == self.target
        return self._obs(), float(won), won or self.n > self.target, False, {"expert_action": "add one"}


gym.register("DreamGymTestCounter-v0", entry_point=Counter)


def test_import_path_family_resolves_and_its_tasks_split_disjointly(tmp_path):
    assert plugin_class(KEYDOOR) is KeyDoorEnv and canonical_family(KEYDOOR) == KEYDOOR
    cfg = load_config(None, [f"actors.env_family={KEYDOOR}", "data.env_tasks=10", "data.env_heldout=3"])
    splits = load_or_make_splits(cfg.actors.env_family, cfg.data, tmp_path, seed=0)
    assert len(splits.train) == 10 and len(splits.heldout) == 3
    assert not {t.task_id for t in splits.train} & {t.task_id for t in splits.heldout}
    assert all(t.family == KEYDOOR and validate_state(t.initial_state).items for t in splits.train)
    assert (tmp_path / KEYDOOR / "splits.json").exists()
    again = load_or_make_splits(KEYDOOR, load_config(None, ["data.env_tasks=4"]).data, tmp_path, seed=0)
    assert len(again.train) == 4  # env_tasks keys the splits: a changed count rebuilds them


@pytest.mark.parametrize("bad", ["examples.nope:KeyDoorEnv", "examples.keydoor:NoSuchEnv", "not_a_registered_env"])
def test_a_bad_family_is_one_config_error_naming_it(bad):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [f"actors.env_family={bad}"])
    assert bad in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        canonical_family(bad)
    assert bad in str(exc.value) and "\n" not in str(exc.value)


def test_a_class_without_tasks_is_refused():
    with pytest.raises(ConfigError, match="missing tasks"):
        plugin_class("actors.envs.textworld_env:TextWorldEnv")


def test_entry_point_family(tmp_path, monkeypatch):
    dist = tmp_path / "mykeydoor-1.0.dist-info"  # what `pip install` of a package declaring the entry point leaves
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mykeydoor\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[dreamgym.envs]\nkeydoor = {KEYDOOR}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_config(None, ["actors.env_family=keydoor"]).actors.env_family == "keydoor"
    assert plugin_class("keydoor") is KeyDoorEnv and isinstance(make_env("keydoor", max_steps=5), KeyDoorEnv)


async def test_keydoor_expert_wins_every_task_and_a_bad_action_is_answered():
    tasks = KeyDoorEnv.tasks("train", 12, 1)
    assert {t.meta["level"] for t in tasks} == {1, 2, 3}
    report = await evaluate(make_chooser("expert"), tasks, KEYDOOR, max_steps=6, policy_name="expert")
    assert report.success_rate == 1.0 and report.episodes == 12
    env = make_env(KEYDOOR, max_steps=4)
    state, info = await env.reset(tasks[0])
    res = await env.step("dance")
    assert not res.info["valid"] and not res.done and res.state.startswith("Invalid action")
    res = await env.step("[1]")  # item 1 is "look"
    assert res.info["valid"] and AbstractState.parse(res.state).items == AbstractState.parse(state).items


async def test_gymnasium_env_plugs_in_through_the_adapter(tmp_path):
    family = "gym:DreamGymTestCounter-v0"
    cfg = load_config(None, [f"actors.env_family={family}", "data.env_tasks=3", "data.env_heldout=2"])
    splits = load_or_make_splits(family, cfg.data, tmp_path)
    assert len(splits.train) == 3 and not {t.seed for t in splits.train} & {t.seed for t in splits.heldout}
    assert splits.train[0].instruction.startswith("reach ")
    env = make_env(family, max_steps=10)
    state, info = await env.reset(splits.train[0])
    assert info["candidates"] == Counter.action_labels and "[2] add two" in state
    assert info["expert_action"] == "add one"
    res = await env.step("jump")
    assert not res.info["valid"]
    report = await evaluate(make_chooser("expert"), splits.heldout, family, max_steps=10, policy_name="expert")
    assert report.success_rate == 1.0  # adding one each step reaches any target: reward 1 -> won
    res = await env.step("reset to zero")
    await env.step("[3]")
    assert "Count: 0" in env.state


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(1200)  # three CLI processes, each importing torch: 4 min alone, 9 on a loaded 2-core machine
def test_keydoor_through_the_cli_collect_mexp_sft_and_dreamgym_train(tmp_path, tiny_dir, redis_url):
    """The README's steps on the example: collect expert and random trajectories, fine-tune Mexp on them,
    then a short DreamGym GRPO run in the synthetic key-and-door world, all through `dreamgym`."""
    data, runs = tmp_path / "data", tmp_path / "runs"
    common = [f"infra.data_dir={data}", f"infra.run_dir={runs}", f"actors.env_family={KEYDOOR}", "data.env_tasks=6",
              "data.env_heldout=2", "data.policies=[expert,random]", "data.episodes_per_task=8", "data.workers=1",
              "data.max_steps=6", f"engines.model={tiny_dir}"]

    def cli(*args, timeout=600):
        proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    cli("collect", "--family", KEYDOOR, *common)
    offline = list(read_trajectories(trajectories_path(data, KEYDOOR)))
    expert = [t for t in offline if t.timings.get("policy_name") == "expert"]
    assert len(offline) == 96 and len(expert) == 48 and all(t.success for t in expert)
    assert all(s.reasoning for t in offline for s in t.steps)  # the env's rationale: Mexp's SFT target

    # the family from the config's actors.env_family, the checkpoint into the cache that `train` then reuses
    mexp_settings = ["simulator.sft_max_examples=32", "simulator.sft_max_heldout=8"]
    cli("train-mexp", "--no-progress", *common, *mexp_settings)
    (cached,) = (data / "mexp").glob(f"{KEYDOOR}-*/config.json")
    cli("fidelity", *common, "--variants", "full", "--max-steps", "4", "--checkpoints", str(cached.parent),
        "--out", str(tmp_path / "fidelity.json"))  # replays the config's family's held-out steps
    fidelity = json.loads((tmp_path / "fidelity.json").read_text())
    assert fidelity["results"][str(cached.parent)]["full"]["summary"]["steps"] == 4
    cli("fidelity", *common, "--split", "train", "--variants", "full", "--max-steps", "4", "--checkpoints",
        str(cached.parent), "--out", str(tmp_path / "fidelity_train.json"))  # what it memorised
    memorised = json.loads((tmp_path / "fidelity_train.json").read_text())
    assert memorised["split"] == "train" and memorised["results"][str(cached.parent)]["full"]["summary"]["steps"] == 4
    assert memorised["tasks"] and not set(memorised["tasks"]) & set(memorised["heldout_tasks"])

    out = cli("train", "--name", "kd", *common, *mexp_settings, f"infra.redis_url={redis_url}",
              "actors.env_kind=synthetic", "actors.num_workers=1", "actors.group_size=4", "actors.concurrent_episodes=4",
              "actors.max_steps=3", "learner.groups_per_update=1", "learner.total_updates=1",
              "curriculum.variants_per_seed=0", "engines.max_batch_size=4", "infra.train_budget_s=300",
              "evaluation.before=false")
    assert "reusing the Mexp SFT checkpoint" in out and str(cached.parent) in out.replace("\n", "")
    s = json.loads((runs / "kd" / "summary.json").read_text())
    assert s["family"] == KEYDOOR and s["env_kind"] == "synthetic" and s["updates"] == 1
    # the update's history row counts how the phase's synthetic steps were answered so far (kept if a run is stopped)
    (row,) = json.loads((runs / "kd" / "history.json").read_text())
    assert row["mexp_steps"]["simulated"] + row["mexp_steps"]["replayed"] > 0
    assert all(row["mexp_steps"][k] <= n for k, n in s["phases"][0]["mexp_steps"].items())
    assert s["trajectories_trained"] > 0 and s["transitions"]["synthetic"] > 0 and s["transitions"]["online_real"] == 0
    assert s["transitions"]["offline_real"] == sum(len(t.steps) for t in offline)
    assert s["heldout_after"]["episodes"] == 2  # evaluated in the real example environment
