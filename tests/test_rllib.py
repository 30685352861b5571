"""RLlib for real: PPO (RLlib's new API stack, its action-masking RLModule) trains in DreamGym's
environments through infra/run/rllib.py (`dreamgym rllib`): the worked example's real key-and-door
world and the synthetic one Mexp steps, and each iteration's episode return is read back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from actors.envs.gym_wrapper import DreamGymTextEnv, MaskedCandidates, hashed_bow
from actors.envs.registry import make_env
from examples.keydoor import KeyDoorEnv
from infra.config import load_config

KEYDOOR = "examples.keydoor:KeyDoorEnv"


def test_hashed_bow_counts_words_into_buckets():
    v = hashed_bow("Take the red key, take it!", 64)
    slow = np.zeros(64)
    import zlib
    for w in ["take", "the", "red", "key", "take", "it"]:
        slow[zlib.crc32(w.encode()) % 64] += 1
    assert np.allclose(v, slow / np.linalg.norm(slow)) and v.dtype == np.float32
    assert not hashed_bow("...", 8).any()


def test_masked_candidates_offers_exactly_the_listed_actions():
    tasks = KeyDoorEnv.tasks("train", 4, 0)
    env = MaskedCandidates(DreamGymTextEnv(make_env(KEYDOOR, max_steps=5), tasks, max_actions=8), 32, 16)
    obs, info = env.reset(seed=0)
    n = len(info["candidates"])
    assert obs in env.observation_space and obs["action_mask"].tolist() == [1.0] * n + [0.0] * (8 - n)
    slots = obs["observations"][32:].reshape(8, 16)
    assert np.allclose(slots[1], hashed_bow(info["candidates"][1], 16)) and not slots[n:].any()
    obs2, reward, terminated, truncated, info2 = env.step(info["candidates"].index(env.unwrapped.env._expert()))
    assert obs2 in env.observation_space and info2["valid"]
    env.close()


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.model
async def test_rllib_ppo_trains_in_the_real_and_the_synthetic_keydoor_world(tmp_path, tiny_dir):
    from infra.run.rllib import train_rllib

    common = [f"infra.data_dir={tmp_path / 'data'}", f"infra.run_dir={tmp_path / 'runs'}", f"actors.env_family={KEYDOOR}",
              "data.env_tasks=6", "data.env_heldout=2", "data.policies=[expert,random]", "data.episodes_per_task=8",
              "data.workers=1", "data.max_steps=6", f"engines.model={tiny_dir}", "engines.max_batch_size=4"]
    real = await train_rllib(load_config(None, [*common, "actors.env_kind=real", "actors.max_steps=6"]), "real",
                             iterations=2, batch=64, max_actions=8)
    assert [r["iteration"] for r in real["iterations"]] == [1, 2]
    for r in real["iterations"]:  # random-ish PPO wins some of the open-door worlds in 6 steps, not all
        assert r["steps"] == 64 and r["episodes"] > 0 and 0.0 <= r["episode_return_mean"] <= 1.0
    assert json.loads((tmp_path / "runs" / "real" / "rllib.json").read_text()) == real

    # the synthetic world: the tiny random model as Mexp (what it cannot parse ends the episode at once),
    # grounded in the collected real transitions, which it replays where the policy repeats one
    syn = await train_rllib(load_config(None, [*common, "actors.env_kind=synthetic", f"simulator.checkpoint={tiny_dir}",
                                               "simulator.max_steps=6", "simulator.max_new_tokens=24",
                                               "simulator.parse_retries=0"]),
                            "synthetic", iterations=2, batch=32, max_actions=8)
    for r in syn["iterations"]:
        assert r["steps"] == 32 and r["episodes"] > 0 and r["episode_return_mean"] is not None
    assert syn["mexp_steps"]["replayed"] > 0  # the steps really went through the experience model
    assert syn["env_kind"] == "synthetic" and (tmp_path / "data" / "offline" / KEYDOOR / "trajectories.msgpack").exists()
