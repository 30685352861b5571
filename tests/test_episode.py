"""The one episode loop (actors/episode.py): success rule, statuses, errors, what a Step records.

Runs the deterministic in-test environment and policy (tests/rollout_fakes.py), and
environments that break in each way the loop must tell apart.
"""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from actors.envs.base import SimulationError, StepResult
from actors.episode import outcome, run_episode
from infra.schema import EnvKind, Status, Task
from tests.rollout_fakes import LadderEnv, ScriptedPolicy

TASK = Task(task_id="climb-1", instruction="climb", family="tw-ladder")


async def always_up(task, state, candidates, history):
    return "up"


class CrashingEnv(LadderEnv):
    def __init__(self, exc: Exception, at_step: int = 1):
        super().__init__(3)
        self.exc, self.at_step, self.n = exc, at_step, 0

    async def step(self, action):
        self.n += 1
        if self.n >= self.at_step:
            raise self.exc
        return await super().step(action)


class RewardOnlyEnv(LadderEnv):
    """Reports no `won`: success falls back to a positive final reward."""

    async def step(self, action):
        res = await super().step(action)
        info = {k: v for k, v in res.info.items() if k != "won"}
        return StepResult(res.state, res.reward, res.done, info)


class WonWithoutRewardEnv(LadderEnv):
    """Says `won` with reward 0: `info["won"]` decides."""

    async def step(self, action):
        res = await super().step(action)
        return StepResult(res.state, 0.0, res.done, res.info)


class NoCandidatesEnv(LadderEnv):
    async def reset(self, task):
        state, info = await super().reset(task)
        return state, {**info, "candidates": []}


def env_errors(family: str) -> float:
    return REGISTRY.get_sample_value("env_errors_total", {"family": family}) or 0.0


async def test_a_decision_is_recorded_with_its_log_probs_and_the_oldest_version():
    policy = ScriptedPolicy(p_first=1.0, version=7)  # always "up": two steps to the top
    traj = await run_episode(LadderEnv(2), TASK, lambda *a: policy.act(*a, affinity_key="k"), 5,
                             env_kind=EnvKind.SYNTHETIC, worker_id="w", group_id="g", trajectory_id="tid")
    assert (traj.status, traj.success, traj.trajectory_id, traj.group_id) == (Status.SUCCESS, True, "tid", "g")
    assert traj.policy_version == 7 and len(traj.steps) == 2 and traj.total_reward == 1.0
    s = traj.steps[0]
    assert s.action == "up" and s.logprobs == [-0.5] and s.action_token_ids == [81] and s.loss_mask == [1]
    assert s.choice_token_ids == [81, 82] and s.policy_prompt.startswith("prompt for climb-1")
    assert s.reasoning == "moved up" and s.reasoning_source == "mexp" and not s.done and traj.steps[1].done
    assert set(traj.timings) == {"policy", "env", "total"}


async def test_a_text_chooser_gets_a_real_rationale_source_and_the_given_version():
    traj = await run_episode(LadderEnv(2), TASK, always_up, 5, policy_version=3)
    assert traj.env_kind == EnvKind.REAL and traj.policy_version == 3 and traj.success
    assert traj.steps[0].reasoning_source == "env-facts" and traj.steps[0].logprobs == []


async def test_success_is_won_when_reported_else_a_positive_reward():
    assert (await run_episode(RewardOnlyEnv(1), TASK, always_up, 3)).status == Status.SUCCESS
    assert (await run_episode(WonWithoutRewardEnv(1), TASK, always_up, 3)).status == Status.SUCCESS
    assert outcome(StepResult("s", 1.0, True, {"won": False})) == Status.FAILURE  # the env's word wins
    assert outcome(StepResult("s", 0.0, True, {"won": False, "truncated": True})) == Status.TRUNCATED


async def test_the_loop_cut_is_truncated_and_no_candidates_is_a_failure():
    async def always_down(task, state, candidates, history):
        return "down"

    cut = await run_episode(LadderEnv(2), TASK, always_down, 3)
    assert cut.status == Status.TRUNCATED and len(cut.steps) == 3 and not cut.steps[-1].done
    empty = await run_episode(NoCandidatesEnv(2), TASK, always_up, 3)
    assert empty.status == Status.FAILURE and empty.steps == []


async def test_env_info_reaches_only_choosers_that_ask_for_it():
    seen = []

    class Expert:
        uses_env_info = True

        async def __call__(self, task, state, candidates, history, info=None):
            seen.append(info["candidates"])
            return "up"

    await run_episode(LadderEnv(1), TASK, Expert(), 3)
    assert seen == [["up", "down"]]


async def test_a_rejected_simulation_step_is_a_sim_error_in_any_env():
    for kind in (EnvKind.SYNTHETIC, EnvKind.REAL):
        traj = await run_episode(CrashingEnv(SimulationError("Mexp output rejected"), 2), TASK, always_up, 5,
                                 env_kind=kind)
        assert traj.status == Status.SIM_ERROR and len(traj.steps) == 1 and not traj.success


async def test_a_crashed_real_env_is_an_env_error_counted_by_family():
    before = env_errors("tw-ladder")
    traj = await run_episode(CrashingEnv(OSError("game process died")), TASK, always_up, 5)
    assert traj.status == Status.ENV_ERROR and env_errors("tw-ladder") == before + 1


async def test_policy_errors_and_a_synthetic_env_outage_propagate():
    async def broken_policy(task, state, candidates, history):
        raise ConnectionError("policy engine down")

    with pytest.raises(ConnectionError):
        await run_episode(LadderEnv(2), TASK, broken_policy, 3)  # even in a real env: not the env's crash
    with pytest.raises(ConnectionError):
        await run_episode(CrashingEnv(ConnectionError("Mexp engine down")), TASK, always_up, 3,
                          env_kind=EnvKind.SYNTHETIC)
