"""One episode: a policy against an environment, recorded as a wire-schema Trajectory.

Owns the step loop that the rollout worker (actors/rollout_worker.py), held-out
evaluation (actors/evaluate.py) and offline collection (actors/collect.py) share, and
its rules, so the three never disagree on what an episode was:

- the policy is a `Chooser`: (task, state, candidates, history) -> the action,
  as text (the scripted choosers of actors/envs/expert.py) or as a decision that also
  carries its prompt, label tokens, behaviour log-probs and weight version
  (actors/policy.PolicyDecision), which every Step then records for the learner. The
  history is the previous actions: the texts a text chooser returned, or the decisions
  a deciding chooser returned (each with `.action`; a multi-turn policy extends the
  last one's chat). A
  chooser whose `uses_env_info` is true is also handed the env's info (the expert
  reads its move there);
- success is `info["won"]` when the environment reports it (the real and the synthetic
  environments all do), else a positive final reward. An episode that ends without
  success is `truncated` when the environment says so (`info["truncated"]`) or when the
  loop's own `max_steps` cut it, else `failure`. An environment that lists no
  candidate actions ends the episode as a `failure`: the policy has nothing to choose;
- errors: a `SimulationError` from the environment (Mexp rejected a step) ends the
  episode as `sim_error`; any other error of a REAL environment ends it as `env_error`,
  counted by env family. Errors of the policy, and any other error of a synthetic
  environment (its engine is down), propagate: the caller decides (the worker hands
  its task back, evaluation stops);
- each Step records the environment's account of the change (`info["reasoning"]` from
  Mexp, `info["rationale"]` from a real env) and its source; a Step's `done` is what
  the environment said. The trajectory's policy version is the oldest that acted in it
  (it bounds staleness).

The environment's lifetime is the caller's: the loop neither opens nor closes it.
Departure from the paper: none; the paper does not describe its episode loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol, Sequence

from actors.envs.base import Environment, SimulationError, StepResult
from infra import metrics
from infra.schema import EnvKind, Status, Step, Task, Trajectory, new_id

log = logging.getLogger(__name__)


class Chooser(Protocol):
    """The policy as the loop sees it: the next action, as text or as a decision with `.action`.

    Scripted choosers that read the environment's info (the expert) set
    `uses_env_info = True` and take an `info=` keyword.
    """

    async def __call__(self, task: Task, state: str, candidates: Sequence[str], history: Sequence[Any]) -> Any: ...


def rationale_source(family: str) -> str:
    """Where a real environment's step rationale comes from: the page's DOM diff or the game's facts diff."""
    return "env-dom-diff" if family.startswith(("miniwob", "browsergym")) else "env-facts"


def outcome(res: StepResult) -> Status:
    """How an episode whose last step returned `res` (done) ended: success by `info["won"]`, else the reward."""
    won = res.info["won"] if "won" in res.info else res.reward > 0
    if won:
        return Status.SUCCESS
    return Status.TRUNCATED if res.info.get("truncated") else Status.FAILURE


def record(state: str, action: str, res: StepResult, choice: Any, default_source: str) -> Step:
    """The Step for one transition; a decision's prompt, label tokens and log-probs go with it."""
    info = res.info
    ids = list(getattr(choice, "action_token_ids", []))
    lengths = list(getattr(choice, "choice_lengths", []))  # score mode: one log-prob and mask value per choice
    return Step(state=state, action=action, reward=float(res.reward), done=bool(res.done), next_state=res.state,
                reasoning=str(info.get("reasoning") or info.get("rationale") or ""),
                reasoning_source=str(info.get("reasoning_source") or default_source),
                valid=bool(info.get("valid", True)), policy_prompt=str(getattr(choice, "prompt", "")),
                action_token_ids=ids, logprobs=[float(x) for x in getattr(choice, "logprobs", [])],
                loss_mask=[1] * (1 if lengths and ids else len(ids)),
                choice_token_ids=list(getattr(choice, "choice_token_ids", [])), choice_lengths=lengths)


async def run_episode(env: Environment, task: Task, choose: Chooser, max_steps: int, *,
                      env_kind: EnvKind | str = EnvKind.REAL, worker_id: str = "", group_id: str = "",
                      trajectory_id: str = "", policy_version: int = 0, budget: Any = None) -> Trajectory:
    """Play `task` in `env` with `choose` for at most `max_steps` steps.

    `policy_version` is the trajectory's version when the chooser reports none (scripted ones).
    `budget` (infra/budget.StepBudget) is asked for every step before it runs; once it is spent
    the episode ends `truncated` where it stands.
    """
    kind = EnvKind(env_kind)
    traj = Trajectory(task_id=task.task_id, group_id=group_id or new_id(), env_kind=kind, status=Status.TRUNCATED,
                      worker_id=worker_id, trajectory_id=trajectory_id or new_id(), task=task)
    family = task.family or str(getattr(env, "family", "")) or "unknown"
    source = "mexp" if kind == EnvKind.SYNTHETIC else rationale_source(family)
    wants_info = bool(getattr(choose, "uses_env_info", False))
    history: list[Any] = []
    versions: list[int] = []
    t0, t_policy, t_env = time.monotonic(), 0.0, 0.0
    in_env = True  # whether the awaited call that raised was the environment's
    metrics.ROLLOUT_INFLIGHT_EPISODES.inc()
    try:
        state, info = await env.reset(task)
        t_env += time.monotonic() - t0
        for _ in range(max_steps):
            candidates = list(info.get("candidates") or [])
            if not candidates:
                traj.status = Status.FAILURE
                break
            in_env, t = False, time.monotonic()
            choice = await (choose(task, state, candidates, history, info=info) if wants_info
                            else choose(task, state, candidates, history))
            action = choice if isinstance(choice, str) else choice.action
            if not isinstance(choice, str):
                versions.append(int(choice.weight_version))
            in_env, t_policy, t = True, t_policy + time.monotonic() - t, time.monotonic()
            if budget is not None and not await budget.take():
                traj.status = Status.TRUNCATED  # the run's real-transition budget is spent
                break
            res = await env.step(action)
            t_env += time.monotonic() - t
            traj.steps.append(record(state, action, res, choice, source))
            metrics.ROLLOUT_STEPS.labels(kind.value).inc()
            history.append(action if isinstance(choice, str) else choice)
            state, info = res.state, res.info
            if res.done:
                traj.status = outcome(res)
                break
    except asyncio.CancelledError:
        raise
    except SimulationError as exc:
        traj.status = Status.SIM_ERROR
        log.warning("episode of %s ended early: %s: %s", task.task_id, type(exc).__name__, str(exc)[:300])
    except Exception as exc:
        if not (in_env and kind == EnvKind.REAL):
            raise
        traj.status = Status.ENV_ERROR
        metrics.ENV_ERRORS.labels(family).inc()
        log.warning("episode of %s: the environment crashed: %s: %s", task.task_id, type(exc).__name__,
                    str(exc)[:300])
    finally:
        metrics.ROLLOUT_INFLIGHT_EPISODES.dec()
    traj.success = traj.status == Status.SUCCESS
    traj.policy_version = min(versions) if versions else policy_version
    traj.timings = {"policy": t_policy, "env": t_env, "total": time.monotonic() - t0}
    metrics.ROLLOUT_EPISODES.labels(kind.value, traj.status.value).inc()
    metrics.ROLLOUT_EPISODE_SECONDS.labels(kind.value).observe(traj.timings["total"])
    return traj
