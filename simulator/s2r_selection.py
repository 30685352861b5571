"""Which seed tasks sim-to-real's real phase plays: those where the current policy still splits.

Owns the selection rule of the real phase (`learner.s2r_selection: split`), a pure function
over the per-task statistics in Redis (infra/task_stats.py) that the DreamGym phase left
behind and the real phase keeps writing; `CurriculumScheduler` (simulator/curriculum.py)
calls it instead of its own sampling once a sim-to-real run switches to real rollouts.

Why: GRPO trains only on groups whose rewards differ (learner/batching.py sets the others
aside as `zero_variance`). The real phase is small (96 real transitions, about ten groups
of 4, in the CPU preset), so every group spent on a task the policy always solves or always
fails is a tenth of the budget bought for nothing: in collection 32 all 40 of its real
trajectories fell in zero-variance groups. With 0/1 rewards a group of G has no variance
with probability p^G + (1-p)^G, 0.125 at p = 0.5 against 0.66 at p = 0.9 for G = 4, so the
phase spends its budget on the tasks whose success rate is nearest one half, by the best
evidence it holds:

- tier 0: the task's newest group had reward variance (the policy split on it lately;
  in the real phase that group may itself be real), the largest variance first;
- tier 1: an older recent group had variance (V_tau > 0, the curriculum's own value);
- tier 2: the task was both solved and failed at some time (its all-episode variance > 0),
  though its recent groups agreed;
- tier 3: never played (unknown, worth a look);
- tier 4: always solved or always failed: played last.

Within a tier, the mean reward nearest 0.5 first, then the task id (deterministic). A task
already handed out in this real phase goes after every task not yet handed out (`played`),
until a group recorded since its hand-out (a real one, of the current policy) split: then it
may be played again at once. So the phase spreads over the tasks the simulator says split
instead of replaying the top one before its real result is in, returns to the tasks that
split in the real environment, and lets a task whose real group did not split drop to its
tier by its new statistics. A pass ends when every seed task is `played`; the next starts.

Measured on a simulated real phase (tests/test_s2r_selection.py: 64 tasks, DreamGym's
statistics from 110 groups at a simulator's success rate within 0.2 of the real one, then
10 real groups of 4), the share of real trajectories in groups with reward variance, the
ones GRPO trains on: half the tasks near-solved, the curriculum's passes 0.53, this rule
0.68; three quarters near-solved, 0.33 against 0.48 (collection 33's real phase, sampled
by the passes, trained 16 of its 40). Not yet measured in a real run.

Departure from the paper: the paper's sim-to-real continues the same RL recipe in the real
environment; the curriculum there samples by the same variance weights. This rule is the
same criterion (Eq. 7's V_tau) applied strictly: ranked, not sampled, and without the
floor weight that keeps zero-variance tasks in the curriculum's passes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from infra.task_stats import TaskStats

TIERS = ("newest group split", "a recent group split", "solved and failed once", "never played", "never split")


def split_tier(s: TaskStats | None) -> int:
    """The task's tier (0 best, 4 worst; see the module docstring)."""
    if s is None or s.groups == 0:
        return 3
    recent = s.recent_group_variances
    if recent and recent[0] > 0:
        return 0
    if s.group_variance > 0:
        return 1
    if s.variance > 0:
        return 2
    return 4


def split_order(task_ids: Sequence[str], stats: dict[str, TaskStats], played: Collection[str] = ()) -> list[str]:
    """`task_ids` in the order the real phase plays them: not yet played in this phase first, then by
    tier, the newest group's variance (largest first), the mean reward's distance from 0.5, the id."""
    def key(tid: str) -> tuple:
        s = stats.get(tid)
        newest = s.recent_group_variances[0] if s is not None and s.recent_group_variances else 0.0
        mean = s.mean if s is not None and s.n else 0.5
        return (tid in played, split_tier(s), -newest, abs(mean - 0.5), tid)
    return sorted(task_ids, key=key)


def still_played(handed: dict[str, int], stats: dict[str, TaskStats]) -> set[str]:
    """The tasks handed out in this pass (`handed`: task id -> its recorded group count at hand-out)
    that wait behind the others: all but those with a group recorded since that split in its newest."""
    def split_since(tid: str) -> bool:
        s = stats.get(tid)
        return (s is not None and s.groups > handed[tid] and bool(s.recent_group_variances)
                and s.recent_group_variances[0] > 0)
    return {t for t in handed if not split_since(t)}


def pick_splitting(task_ids: Sequence[str], stats: dict[str, TaskStats], k: int,
                   played: Collection[str] = ()) -> list[str]:
    """The next k tasks of the real phase (fewer only when `task_ids` holds fewer than k; a batch
    never holds a task twice)."""
    return split_order(task_ids, stats, played)[:max(0, k)]
