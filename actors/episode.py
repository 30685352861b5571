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
  (it bounds staleness);
- an invalid reply (a generate-mode decision with `invalid_reason`: cut off, no
  `<action>`, not a candidate; actors/reply.py) never reaches the environment: the Step
  records it with `valid` false, the reason, reward `-format_penalty`, the same state as
  next state, and it counts toward `max_steps` and toward a real-transition budget: in a
  real episode it is a turn the agent spent there, and the trajectory that the learner
  trains on holds it (a phase that paid only for `env.step`s would learn the reply format
  from unpaid real episodes, and the budget could never be spent by an agent that writes
  none). The next turn tells the policy why. An unmatched action with `free_text` goes to an
  environment whose `accepts_free_text` is true as written (its own rules decide).
  Invalid replies are counted in `policy_invalid_replies_total{reason}`.

The environment's lifetime is the caller's: the loop neither opens nor closes it.
Departure from the paper: none; the paper does not describe its episode loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Protocol, Sequence

from actors.envs.base import Environment, SimulationError, StepResult
from infra import metrics
from infra.schema import EnvKind, Status, Step, Task, Trajectory, new_id

log = logging.getLogger(__name__)
ENV_DETAIL_CHARS = 240  # the environment error's text kept in timings["env_error_detail"] (a label: <= 256)


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


def record(state: str, action: str, res: StepResult, choice: Any, default_source: str,
           invalid_reason: str = "") -> Step:
    """The Step for one transition (or one invalid reply: `invalid_reason`); a decision's prompt, tokens
    and log-probs go with it, and in generate mode its prompt ids, chat start and reply text."""
    info = res.info
    ids = list(getattr(choice, "action_token_ids", []))
    lengths = list(getattr(choice, "choice_lengths", []))  # score mode: one log-prob and mask value per choice
    return Step(state=state, action=action, reward=float(res.reward), done=bool(res.done), next_state=res.state,
                reasoning=str(info.get("reasoning") or info.get("rationale") or ""),
                reasoning_source=str(info.get("reasoning_source") or default_source),
                valid=bool(info.get("valid", True)) and not invalid_reason,
                policy_prompt=str(getattr(choice, "prompt", "")),
                action_token_ids=ids, logprobs=[float(x) for x in getattr(choice, "logprobs", [])],
                loss_mask=[1] * (1 if lengths and ids else len(ids)),
                choice_token_ids=list(getattr(choice, "choice_token_ids", [])), choice_lengths=lengths,
                prompt_token_ids=[int(t) for t in getattr(choice, "prompt_token_ids", None) or []],
                new_chat=bool(getattr(choice, "new_chat", False)), reply=str(getattr(choice, "reply", "") or ""),
                invalid_reason=invalid_reason, temperature=float(getattr(choice, "temperature", 1.0)))


def invalid_reply(choice: Any, env: Any) -> str:
    """Why a decision's reply names no action the environment takes ("" = it does): its
    `invalid_reason`, unless it carries `free_text` and the environment `accepts_free_text`."""
    reason = "" if isinstance(choice, str) else str(getattr(choice, "invalid_reason", "") or "")
    if reason and getattr(choice, "free_text", "") and getattr(env, "accepts_free_text", False):
        return ""
    return reason


async def run_episode(env: Environment, task: Task, choose: Chooser, max_steps: int, *,
                      env_kind: EnvKind | str = EnvKind.REAL, worker_id: str = "", group_id: str = "",
                      trajectory_id: str = "", policy_version: int = 0, budget: Any = None) -> Trajectory:
    """Play `task` in `env` with `choose` for at most `max_steps` steps.

    `policy_version` is the trajectory's version when the chooser reports none (scripted ones).
    `budget` (infra/budget.StepBudget) is asked for every step, an invalid reply's too, before it runs; once it is spent
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
    env_reason = ""  # env_error: why (actors/envs/env_process.py: env_crash, env_timeout, env_refused)
    env_detail = ""  # and the error's text, for the worker that names a task no environment can play
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
            reason = invalid_reply(choice, env)
            if not reason and not isinstance(choice, str) and getattr(choice, "invalid_reason", ""):
                # free text, as written, to an environment that takes it; the next turn reads it as a valid action
                action = str(choice.free_text)
                choice = dataclasses.replace(choice, action=action, invalid_reason="", format_penalty=0.0)
            if not isinstance(choice, str):
                versions.append(int(choice.weight_version))
            in_env, t_policy, t = True, t_policy + time.monotonic() - t, time.monotonic()
            if budget is not None and not await budget.take():
                traj.status = Status.TRUNCATED  # the run's real-transition budget is spent
                break
            if reason:  # the environment is not asked: same state, the policy hears why next turn
                metrics.POLICY_INVALID_REPLIES.labels(reason).inc()
                penalty = float(getattr(choice, "format_penalty", 0.0) or 0.0)
                traj.steps.append(record(state, str(action or ""), StepResult(state, -penalty if penalty else 0.0,
                                                                              False, {}), choice,
                                         source, invalid_reason=reason))
                history.append(choice)
                continue
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
        env_reason = str(getattr(exc, "reason", "") or "env_exception")
        env_detail = f"{type(exc).__name__}: {exc}"
        metrics.ENV_ERRORS.labels(family).inc()
        log.warning("episode of %s: the environment crashed: %s: %s", task.task_id, type(exc).__name__,
                    str(exc)[:300])
    finally:
        metrics.ROLLOUT_INFLIGHT_EPISODES.dec()
    traj.success = traj.status == Status.SUCCESS
    traj.policy_version = min(versions) if versions else policy_version
    traj.timings = {"policy": t_policy, "env": t_env, "total": time.monotonic() - t0}
    if env_reason:
        traj.timings["env_error"] = env_reason
        traj.timings["env_error_detail"] = env_detail[:ENV_DETAIL_CHARS]
    metrics.ROLLOUT_EPISODES.labels(kind.value, traj.status.value).inc()
    metrics.ROLLOUT_EPISODE_SECONDS.labels(kind.value).observe(traj.timings["total"])
    return traj
