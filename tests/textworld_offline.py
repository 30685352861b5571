"""A tiny real TextWorld offline dataset for the simulator's tests (expert and random rollouts).

Uses the environments team's game generator and environment; the data is written in
the offline dataset format to `<data_dir>/offline/textworld/trajectories.msgpack`.
`dreamgym collect` is the production path; this is the smallest thing that gives
the simulator tests real transitions.
"""

from __future__ import annotations

import random
from pathlib import Path

from actors.dataset import trajectories_path, write_trajectories
from actors.envs.textworld_env import TextWorldEnv, make_textworld_tasks
from infra.schema import EnvKind, Status, Step, Trajectory


def make_offline_dataset(data_dir: str | Path, n_games: int = 4, n_heldout: int = 0, families=("tw-simple",),
                         seed: int = 0, max_steps: int = 8, random_episodes: int = 1) -> list[Trajectory]:
    path = trajectories_path(data_dir, "textworld")
    splits = make_textworld_tasks(data_dir, n_games, n_heldout, list(families), seed=seed)
    rng = random.Random(seed)
    env = TextWorldEnv(max_steps=max_steps)
    trajs = []
    try:
        for task in splits.train + splits.heldout:
            for policy in ["expert"] + ["random"] * random_episodes:
                state, info = env.reset_sync(task)
                traj = Trajectory(task_id=task.task_id, group_id=policy, env_kind=EnvKind.REAL, task=task)
                for _ in range(max_steps):
                    action = info.get("expert_action") if policy == "expert" else None
                    action = action or rng.choice(info["candidates"])
                    res = env.step_sync(action)
                    traj.steps.append(Step(state=state, action=action, reward=res.reward, done=res.done,
                                           next_state=res.state, reasoning=res.info.get("rationale", ""),
                                           reasoning_source="env-facts", valid=res.info["valid"]))
                    state, info = res.state, res.info
                    if res.done:
                        break
                traj.success = bool(info.get("won"))
                traj.status = Status.SUCCESS if traj.success else Status.FAILURE
                trajs.append(traj)
    finally:
        env.close_sync()
    write_trajectories(path, trajs)
    return trajs
