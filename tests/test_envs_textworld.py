"""TextWorld behind the text interface: real games generated here (tiny), abstract states,
invalid actions, expert vs random, task splits, the gymnasium wrapper."""

from __future__ import annotations

import asyncio

import pytest

from actors.envs.base import INVALID_PREFIX, Environment, validate_state
from actors.envs.expert import PerTaskChooser, make_chooser
from actors.envs.textworld_env import TextWorldEnv, _humanize_fact, facts_rationale, make_textworld_tasks, render_state
from actors.evaluate import evaluate


def tw_splits_for(tmp_path_factory):
    # Same directory name in every test file: the games are generated once per session.
    root = tmp_path_factory.getbasetemp() / "tw-data"
    return root, make_textworld_tasks(root, 3, 2, ["custom"], seed=0, heldout_families=["tw-cooking-1"])


@pytest.fixture(scope="module")
def tw(tmp_path_factory):
    return tw_splits_for(tmp_path_factory)


def test_render_state_lists_goal_room_inventory_and_numbered_commands():
    text = render_state("Put the apple in the fridge.", "-= Kitchen =-\nYou are in a kitchen. A fridge is here.",
                        "You are carrying: an apple.", ["examine fridge", "look", "open fridge", "put apple in fridge"])
    st = validate_state(text)
    assert st.description.splitlines() == ["Goal: Put the apple in the fridge.",
                                           "Room: Kitchen. You are in a kitchen. A fridge is here.",
                                           "Inventory: an apple"]
    assert st.items == [(1, "open fridge"), (2, "put apple in fridge")]  # look/examine are shown already


def test_facts_rationale_says_what_changed():
    assert _humanize_fact("in(milk: f, I)") == "milk in inventory"
    assert _humanize_fact("at(P, kitchen: r)") == "you in kitchen"
    text = facts_rationale("take apple from counter", {"on(apple: f, counter: s)"}, {"in(apple: f, I)"}, won=False)
    assert text == "take apple from counter: now apple in inventory; no longer apple on counter"
    assert facts_rationale("eat apple", set(), set(), won=True).endswith("the goal is reached")


def test_to_do_is_the_win_facts_that_do_not_hold_yet_in_state_and_rationale():
    win = ["at(P, kitchen: r)", "in(apple: f, fridge: c)"]
    text = render_state("Put the apple in the fridge.", "", "", ["go east"], facts=["at(P, hall: r)"], win=win)
    assert "To do: you in kitchen, apple in fridge" in validate_state(text).description.splitlines()
    done = render_state("Put the apple in the fridge.", "", "", ["go east"], facts=[*win, "at(fridge: c, kitchen: r)"],
                        win=win)
    assert "To do: nothing" in done
    assert "To do" not in render_state("Put the apple in the fridge.", "", "", ["go east"], facts=["at(P, hall: r)"])
    moved = facts_rationale("go east", {"at(P, hall: r)"}, {"at(P, kitchen: r)"}, won=False, win=win)
    assert moved == ("go east: now you in kitchen; no longer you in hall; "
                     "to do: you in kitchen (done), apple in fridge (not yet)")
    won = facts_rationale("put apple in fridge", {win[0]}, set(win), won=True, win=win)
    assert won.endswith("; to do: apple in fridge (done); the goal is reached")


@pytest.mark.slow
def test_splits_by_seed_and_family_and_cache(tw):
    root, splits = tw
    assert len(splits.train) == 3 and len(splits.heldout) == 2
    assert {t.family for t in splits.train} == {"custom"}
    assert "tw-cooking-1" in {t.family for t in splits.heldout}  # a family never seen in training
    assert not {t.seed for t in splits.train} & {t.seed for t in splits.heldout}
    for t in splits.train + splits.heldout:
        validate_state(t.initial_state)
        assert t.instruction and t.game_file.endswith(".z8")
    mtimes = [p.stat().st_mtime for p in sorted((root / "textworld" / "games").glob("*.z8"))]
    again = make_textworld_tasks(root, 3, 2, ["custom"], seed=0, heldout_families=["tw-cooking-1"])
    assert [t.task_id for t in again.train] == [t.task_id for t in splits.train]
    assert [p.stat().st_mtime for p in sorted((root / "textworld" / "games").glob("*.z8"))] == mtimes


@pytest.mark.slow
async def test_env_interface_expert_episode_and_rationales(tw):
    _root, splits = tw
    env = TextWorldEnv(max_steps=20)
    assert isinstance(env, Environment)
    task = splits.train[0]
    state, info = await env.reset(task)
    assert state == task.initial_state
    assert info["candidates"] == [text for _i, text in validate_state(state).items]
    while True:
        res = await env.step(info["expert_action"])
        info = res.info
        assert info["valid"] and info["rationale"].startswith(info["command"])
        validate_state(res.state)
        if res.done:
            break
    assert info["won"] and res.reward == 1.0
    # The state tracks the win condition: something to do at the start, nothing once won; the winning
    # step's rationale says so, every earlier one names what is left.
    assert "To do: nothing" not in state and "To do: " in state
    assert "To do: nothing" in res.state and info["rationale"].endswith("the goal is reached")
    await env.close()


@pytest.mark.slow
def test_invalid_actions_are_answered_and_counted(tw):
    _root, splits = tw
    env = TextWorldEnv(max_steps=5)
    state, info = env.reset_sync(splits.train[1])
    for bad in ("dance wildly", "click [1]", "[99]", 'type [1] "x"'):
        res = env.step_sync(bad)
        assert not res.info["valid"] and res.reward == 0.0
        assert res.state.startswith(INVALID_PREFIX) and res.state.endswith(state)
    assert res.info["invalid_actions"] == 4
    res = env.step_sync("[1]")  # item 1 by number is valid
    assert res.info["valid"] and res.done  # 5th step hits max_steps
    assert res.info["truncated"] or res.info["won"]
    after = env.step_sync("[1]")
    assert after.done and not after.info["valid"]  # stepping a finished episode never raises
    env.close_sync()


@pytest.mark.slow
def test_expert_solves_all_and_random_is_worse(tw):
    _root, splits = tw
    tasks = splits.train + splits.heldout
    expert = asyncio.run(evaluate(make_chooser("expert"), tasks, "textworld", max_steps=8, episodes_per_task=2))
    rand = asyncio.run(evaluate(make_chooser("random", seed=1), tasks, "textworld", max_steps=8, episodes_per_task=2))
    assert expert.success_rate == 1.0 and expert.invalid_rate == 0.0
    assert rand.success_rate < expert.success_rate
    assert rand.mean_steps > expert.mean_steps


@pytest.mark.slow
def test_random_anchor_is_the_same_whatever_runs_beside_it(tw):
    # `dreamgym eval --policy random` (the experiment's anchor row) on 2 concurrent environments:
    # the per-task chooser makes each task's episode the same in any order and interleaving.
    _root, splits = tw
    tasks = splits.train + splits.heldout

    def episodes(order, concurrency):
        rep = asyncio.run(evaluate(PerTaskChooser("random", seed=3), order, "textworld", max_steps=8,
                                   concurrency=concurrency))
        return {e["task_id"]: (e["success"], e["steps"]) for e in rep.per_task}

    first = episodes(tasks, 2)
    assert first == episodes(list(reversed(tasks)), 2) == episodes(tasks[1:] + tasks[:1], 1)
    assert len(first) == len(tasks)


@pytest.mark.slow
def test_gym_wrapper_passes_check_env_and_registers(tw):
    from gymnasium.utils.env_checker import check_env
    from ray.tune.registry import ENV_CREATOR, _global_registry

    from actors.envs.gym_wrapper import DreamGymTextEnv, gym_env_creator, register_rllib_env

    root, splits = tw
    env = DreamGymTextEnv(TextWorldEnv(max_steps=10), splits.train)
    check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=3)
    assert env.observation_space.contains(obs) and info["candidates"]
    obs, reward, terminated, truncated, info = env.step(env.action_space.n - 1)  # past the list: invalid
    assert not info["valid"] and obs.startswith(INVALID_PREFIX)
    env.close()
    name = register_rllib_env("dreamgym-text-test")
    assert _global_registry.contains(ENV_CREATOR, name)
    splits.save(root / "splits.json")
    made = gym_env_creator({"family": "textworld", "splits": str(root / "splits.json"), "max_steps": 4})
    obs, _ = made.reset(seed=0)
    assert made.observation_space.contains(obs)
    made.close()
