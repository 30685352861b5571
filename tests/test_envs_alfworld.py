"""ALFWorld behind the text interface: problems generated over the bundled floorplans and
played through TextWorld with ALFWorld's wrappers and planner; abstract states, the lazy
expert, held-out rooms and task types, and the collect/eval/train commands on the family."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from actors.dataset import TaskSplits, read_trajectories, splits_path, trajectories_path
from actors.envs import alfworld_problems as ap
from actors.envs.alfworld_env import AlfWorldEnv, describe, facts_rationale, order_commands, render_state
from actors.envs.base import INVALID_PREFIX, Environment, validate_state
from actors.envs.expert import make_chooser
from actors.envs.registry import canonical_family, make_env
from actors.evaluate import evaluate, run_episode
from infra.config import ALFWORLD_TASK_TYPES, ConfigError, load_config
from infra.schema import EnvKind

ROOM = {("atlocation", ("agent1", "loc 4")), ("receptacleatlocation", ("countertop 1", "loc 4")),
        ("receptacleatlocation", ("cabinet 2", "loc 4")), ("openable", ("cabinet 2",)),
        ("receptacleatlocation", ("fridge 1", "loc 9")), ("openable", ("fridge 1",)),
        ("inreceptacle", ("apple 1", "countertop 1")), ("inreceptacle", ("mug 2", "countertop 1")),
        ("inreceptacle", ("egg 1", "fridge 1")), ("inreceptacle", ("cup 1", "cabinet 2"))}


def test_task_types_are_alfworlds_six_and_the_config_knows_them():
    assert ap.TASK_TYPES == ALFWORLD_TASK_TYPES
    cfg = load_config(None, ["actors.env_family=alfworld", "data.alfworld_task_types=[pick_two_obj_and_place]"])
    assert cfg.actors.env_family == "alfworld"
    with pytest.raises(ConfigError, match="data.alfworld_task_types"):
        load_config(None, ["data.alfworld_task_types=[pick_and_place]"])
    assert canonical_family("alfworld/pick_heat_then_place_in_recep") == "alfworld"
    assert isinstance(make_env("alfworld", max_steps=5), Environment)


def test_state_shows_only_what_is_visible_here():
    location, holding = describe(ROOM)
    # The fridge is elsewhere (its egg is not mentioned); the closed cabinet hides its cup.
    assert location == "cabinet 2 (closed); countertop 1 (on it: apple 1, mug 2)"
    assert holding == "nothing"
    held = (ROOM - {("inreceptacle", ("apple 1", "countertop 1"))}) | {("holds", ("agent1", "apple 1")),
                                                                      ("ishot", ("apple 1",)), ("opened", ("cabinet 2",))}
    location, holding = describe(held)
    assert location == "cabinet 2 (open; in it: cup 1); countertop 1 (on it: mug 2)" and holding == "apple 1 (hot)"
    assert describe({("atlocation", ("agent1", "loc 1"))})[0] == "the middle of the room"


def test_items_put_interactions_first_and_hide_what_the_state_shows():
    cmds = ["go to fridge 1", "examine countertop 1", "take apple 1 from countertop 1", "look", "inventory",
            "go to cabinet 10", "go to cabinet 2", "help", "open cabinet 2"]
    assert order_commands(cmds) == ["open cabinet 2", "take apple 1 from countertop 1", "go to cabinet 2",
                                    "go to cabinet 10", "go to fridge 1"]
    st = validate_state(render_state("put a hot apple in countertop.", ROOM, cmds))
    assert st.description.splitlines() == ["Goal: put a hot apple in countertop.",
                                           "Location: cabinet 2 (closed); countertop 1 (on it: apple 1, mug 2)",
                                           "Holding: nothing"]
    assert st.items[0] == (1, "open cabinet 2") and len(st.items) == 5


def test_rationale_is_the_facts_diff_in_words():
    before = ROOM
    after = (ROOM - {("inreceptacle", ("apple 1", "countertop 1"))}) | {("holds", ("agent1", "apple 1"))}
    assert facts_rationale("take apple 1 from countertop 1", before, after, False) == \
        "take apple 1 from countertop 1: now holding apple 1; no longer apple 1 in countertop 1"
    moved = (ROOM - {("atlocation", ("agent1", "loc 4"))}) | {("atlocation", ("agent1", "loc 9"))}
    assert facts_rationale("go to fridge 1", ROOM, moved, False) == \
        "go to fridge 1: now you at fridge 1; no longer you at cabinet 2, countertop 1"
    assert facts_rationale("look", ROOM, ROOM, False) == "look: nothing in the world changed"


def test_plans_hold_out_rooms_and_task_types():
    plan = ap.plan_games(12, 8, ["pick_and_place_simple", "pick_heat_then_place_in_recep"],
                         heldout_task_types=["look_at_obj_in_light"], seed=3)
    held = ap.heldout_scenes()
    assert len(held) == 24  # ALFRED's test floorplans: 6 of 30 per room type
    train = [p for p in plan if p[0] == "train"]
    heldout = [p for p in plan if p[0] == "heldout"]
    assert len(train) == 12 and len(heldout) == 8
    assert all(not set(scenes) & held for _s, _t, scenes, _seed in train)
    assert all(set(scenes) <= held for _s, _t, scenes, _seed in heldout)
    assert "look_at_obj_in_light" not in {t for _s, t, _sc, _seed in train}
    assert "look_at_obj_in_light" in {t for _s, t, _sc, _seed in heldout}
    heat = [scenes for _s, t, scenes, _seed in plan if t == "pick_heat_then_place_in_recep"]
    assert all(ap.room_type(s) == "Kitchen" for scenes in heat for s in scenes)  # microwaves are in kitchens
    assert not {p[3] for p in train} & {p[3] for p in heldout}
    with pytest.raises(ValueError, match="pick_and_place'"):
        ap.plan_games(1, 0, ["pick_and_place"])


def test_problem_is_alfworld_pddl_from_a_fixed_seed():
    layout = ap.load_layout("FloorPlan7")
    one = ap.sample_problem(layout, "pick_cool_then_place_in_recep", random.Random(5))
    two = ap.sample_problem(layout, "pick_cool_then_place_in_recep", random.Random(5))
    assert one.pddl == two.pddl and one.description == two.description
    assert one.description.split()[0] in ("put", "cool") and one.description.endswith(one.parent_target.lower())
    assert "(:domain alfred)" in one.pddl and "(coolable " in one.pddl and "_bar_" in one.pddl
    starts = [layout.receptacles[r][0] for o, r in one.placements.items() if o.split("|")[0] == one.object_target]
    assert starts and not {"Fridge", one.parent_target} & set(starts)  # the task is never done at the start
    assert ap.sample_problem(ap.load_layout("FloorPlan301"), "pick_heat_then_place_in_recep", random.Random(0)) is None
    with pytest.raises(ValueError, match="no layout"):
        ap.load_layout("FloorPlan999")


# --- real games ------------------------------------------------------------------

def alf_splits_for(tmp_path_factory):
    # Same directory name in every test: one train and one held-out game per task type, made once per session.
    root = tmp_path_factory.getbasetemp() / "alf-data"
    return root, ap.make_alfworld_tasks(root, 6, 6, list(ap.TASK_TYPES), seed=0, workers=2)


@pytest.fixture(scope="module")
def alf(tmp_path_factory):
    return alf_splits_for(tmp_path_factory)


@pytest.mark.slow
def test_splits_hold_out_rooms_cover_every_type_and_are_cached(alf):
    root, splits = alf
    held = ap.heldout_scenes()
    assert {t.meta["task_type"] for t in splits.train} == set(ap.TASK_TYPES) == {t.meta["task_type"] for t in splits.heldout}
    assert not {t.meta["scene"] for t in splits.train} & held  # held-out rooms never appear in training
    assert {t.meta["scene"] for t in splits.heldout} <= held
    for t in splits.train + splits.heldout:
        st = validate_state(t.initial_state)
        assert st.description.startswith(f"Goal: {t.instruction}") and t.family == f"alfworld/{t.meta['task_type']}"
        data = json.loads(open(t.game_file).read())
        assert data["solvable"] and data["walkthrough"] and "Your task is to: " + t.instruction.rstrip(".") in data["grammar"]
    games = sorted((root / "alfworld" / "games").glob("*.tw-pddl"))
    mtimes = [p.stat().st_mtime for p in games]
    again = ap.make_alfworld_tasks(root, 6, 6, list(ap.TASK_TYPES), seed=0, workers=1)
    assert [t.task_id for t in again.train] == [t.task_id for t in splits.train]
    assert [p.stat().st_mtime for p in games] == mtimes


@pytest.mark.slow
def test_expert_solves_every_task_type_and_random_does_worse(alf):
    _root, splits = alf
    tasks = splits.train + splits.heldout
    expert = asyncio.run(evaluate(make_chooser("expert"), tasks, "alfworld", max_steps=20, concurrency=2))
    assert expert.successes == len(tasks) == 12, expert.per_task
    rand = asyncio.run(evaluate(make_chooser("random", seed=1), tasks, "alfworld", max_steps=20, concurrency=2))
    assert rand.success_rate < expert.success_rate and rand.mean_steps > expert.mean_steps
    assert expert.invalid_rate == 0.0


@pytest.mark.slow
def test_episode_states_parse_and_the_expert_replans_only_after_a_deviation(alf):
    _root, splits = alf
    task = next(t for t in splits.train if t.meta["task_type"] == "pick_heat_then_place_in_recep")

    async def go():
        env = AlfWorldEnv(max_steps=20)
        try:
            traj = await run_episode(env, task, make_chooser("expert"), 20)
            assert traj.success and env.replans == 0  # the walkthrough, followed, is never replanned
            for s in traj.steps:
                validate_state(s.state), validate_state(s.next_state)
                assert s.valid and s.reasoning.startswith(s.action + ":")
            assert any("hot" in s.reasoning for s in traj.steps) and traj.steps[-1].reward == 1.0

            state, info = await env.reset(task)
            plan_first = info["expert_action"]
            assert isinstance(plan_first, str) and plan_first in info["candidates"]
            detour = next(c for c in info["candidates"] if c.startswith("go to ") and c != plan_first)
            res = await env.step(detour)
            move = res.info["expert_action"]
            assert callable(move) and env.replans == 0  # computed only when asked for
            again = await asyncio.to_thread(move)
            assert again in res.info["candidates"] and env.replans == 1
            # The chooser asks for it, and from there on it follows the new plan without replanning.
            chooser, n, info = make_chooser("expert"), 0, res.info
            while not env.done:
                action = await chooser(task, env.state, info["candidates"], [], info=info)
                res = await env.step(action)
                info, n = res.info, n + 1
            assert res.reward == 1.0 and env.won and env.replans == 1
        finally:
            await env.close()

    asyncio.run(go())


@pytest.mark.slow
def test_invalid_actions_are_answered_and_counted(alf):
    _root, splits = alf
    env = AlfWorldEnv(max_steps=3)
    try:
        state, info = env.reset_sync(splits.heldout[0])
        for bad in ("fly to the moon", "[999]", "click [3]"):
            res = env.step_sync(bad)
            assert res.state.startswith(INVALID_PREFIX) and not res.info["valid"] and res.reward == 0.0
        assert env.invalid == 3 and res.done and res.info["truncated"]  # the step budget is spent
        env.reset_sync(splits.heldout[0])
        res = env.step_sync("look")  # hidden from the items, still a valid command
        assert res.info["valid"] and "nothing in the world changed" in res.info["rationale"]
        res = env.step_sync("[1]")
        assert res.info["valid"] and res.info["command"] == info["candidates"][0]
    finally:
        env.close_sync()


@pytest.mark.slow
def test_collect_and_eval_commands_on_alfworld(alf, tmp_path):
    from infra.cli import main

    root, splits = alf
    overrides = [f"infra.data_dir={root}", f"infra.run_dir={tmp_path}", "data.alfworld_games=6",
                 "data.alfworld_heldout=6", "data.workers=2", "data.max_steps=20", "data.episodes_per_task=1",
                 "data.policies=[expert,random]"]
    assert main(["collect", *overrides, "--family", "alfworld", "--limit", "3"]) == 0
    assert TaskSplits.load(splits_path(root, "alfworld")).train == splits.train
    trajs = list(read_trajectories(trajectories_path(root, "alfworld")))
    assert len(trajs) == 3 * 2 and {t.timings["policy_name"] for t in trajs} == {"expert", "random"}
    for t in trajs:
        assert t.env_kind == EnvKind.REAL and t.steps[-1].done
        assert all(s.next_state and s.reasoning and s.reasoning_source == "env-facts" for s in t.steps)
    assert all(t.success for t in trajs if t.timings["policy_name"] == "expert")
    reports = {}
    for policy in ("expert", "random"):
        out = tmp_path / f"{policy}.json"
        # --family, or the config's actors.env_family when it is left out (as an ALFWorld preset's eval is)
        family = ["--family", "alfworld"] if policy == "expert" else ["actors.env_family=alfworld"]
        assert main(["eval", *overrides, *family, "--policy", policy, "--limit", "4", "--out", str(out)]) == 0
        reports[policy] = json.loads(out.read_text())
        assert reports[policy]["family"] == "alfworld"
    assert reports["expert"]["episodes"] == 4 and reports["expert"]["success_rate"] == 1.0
    assert {r["task_id"] for r in reports["expert"]["per_task"]} <= {t.task_id for t in splits.heldout}
    assert reports["random"]["success_rate"] < 1.0 and reports["random"]["mean_steps"] > reports["expert"]["mean_steps"]


@pytest.mark.slow
def test_train_command_runs_on_alfworld(redis_url, tmp_path, tiny_dir):
    """`dreamgym train` with actors.env_family=alfworld: games, offline data, real rollouts, one PPO update.

    PPO, not GRPO: a 2-step ALFWorld episode is never won, so every GRPO group has zero
    reward variance and the learner rightly discards it; PPO updates on it regardless."""
    from infra.cli import main

    name = "alf-train"
    rc = main(["train", "--name", name, "--no-eval", f"infra.run_dir={tmp_path / 'runs'}",
               f"infra.data_dir={tmp_path / 'data'}", f"infra.redis_url={redis_url}", "infra.train_budget_s=600",
               f"engines.model={tiny_dir}", "engines.max_batch_size=4", f"simulator.checkpoint={tiny_dir}",
               "actors.env_family=alfworld",
               "data.alfworld_games=2", "data.alfworld_heldout=1", "data.alfworld_task_types=[pick_and_place_simple]",
               "data.policies=[expert]", "data.episodes_per_task=1", "data.workers=1",
               "actors.env_kind=real", "actors.num_workers=1", "actors.group_size=2", "actors.concurrent_episodes=2",
               "actors.max_steps=2", "learner.algo=ppo", "learner.groups_per_update=1", "learner.total_updates=1",
               "curriculum.variants_per_seed=0"])
    assert rc == 0
    summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
    assert summary["updates"] == 1 and summary["trajectories_trained"] == 2
    splits = TaskSplits.load(splits_path(tmp_path / "data", "alfworld"))
    assert len(splits.train) == 2 and all(t.family == "alfworld/pick_and_place_simple" for t in splits.train)
    assert summary["transitions"]["offline_real"] > 0  # the real ALFWorld expert transitions it collected
    assert summary["transitions"]["online_real"] > 0 and summary["transitions"]["synthetic"] == 0


# --- generating only what a command needs, with progress and a cache (issue 64) ---------

def test_a_room_that_cannot_host_a_type_is_remembered_and_not_tried_again(tmp_path, monkeypatch):
    games = tmp_path / "games"
    assert ap.generate_game("pick_heat_then_place_in_recep", "FloorPlan301", 0, games) is None  # no microwave
    marker = ap.unsolvable_marker(ap.game_path(games, "pick_heat_then_place_in_recep", "FloorPlan301", 0))
    assert marker.exists() and ap.cached_game("pick_heat_then_place_in_recep", "FloorPlan301", 0, games) is False

    def no_layout(scene):
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(ap, "load_layout", no_layout)
    assert ap.generate_game("pick_heat_then_place_in_recep", "FloorPlan301", 0, games) is None
    assert ap.cached_game("pick_heat_then_place_in_recep", "FloorPlan301", 1, games) is None  # never tried


@pytest.mark.slow
def test_only_the_problems_asked_for_are_made_then_read_back_from_the_cache(tmp_path, monkeypatch):
    types = list(ap.TASK_TYPES)
    games = tmp_path / "alfworld" / "games"
    lines: list[str] = []
    part = ap.make_alfworld_tasks(tmp_path, 24, 12, types, only=("heldout", 2), workers=2, progress=lines.append)
    assert not part.train and len(part.heldout) == 2
    # the same two tasks the whole held-out split starts with
    slots = [s for s in ap.plan_games(24, 12, types) if s[0] == "heldout"][:2]
    assert [(t.meta["task_type"], t.seed) for t in part.heldout] == [(s[1], s[3]) for s in slots]
    made = sorted(games.glob("*" + ap.GAME_SUFFIX))
    tried = sorted(games.glob("*" + ap.UNSOLVABLE_SUFFIX))
    assert len(made) == 2 and len(tried) <= 2 * ap.MAX_ATTEMPTS  # 2 of the 36 the config describes
    assert sum(": generated " in line for line in lines) == 2 and all("/2 (heldout" in line for line in lines[1:3])

    def no_planner(*_a, **_k):
        raise AssertionError("a cached problem was planned again")

    def no_reset(*_a, **_k):
        raise AssertionError("a kept task was read off its game again")

    monkeypatch.setattr(ap, "solve", no_planner)
    monkeypatch.setattr(ap.AlfWorldEnv, "reset_sync", no_reset)
    again: list[str] = []
    back = ap.make_alfworld_tasks(tmp_path, 24, 12, types, only=("heldout", 2), workers=2, progress=again.append)
    assert back.heldout == part.heldout  # the same tasks, first states and all, from the cache
    assert len(again) == 3 and all(": cached " in line for line in again[:2]) and "read off" in again[2]
    assert [p.stat().st_mtime for p in made] == [p.stat().st_mtime for p in sorted(games.glob("*" + ap.GAME_SUFFIX))]
    monkeypatch.undo()
    more: list[str] = []
    three = ap.make_alfworld_tasks(tmp_path, 24, 12, types, only=("heldout", 3), workers=2, progress=more.append)
    assert three.heldout[:2] == back.heldout and sum(": generated " in line for line in more) == 1  # only the new one


@pytest.mark.slow
def test_eval_with_a_limit_makes_only_those_problems(tmp_path):
    from infra.cli import main

    out = tmp_path / "expert.json"
    assert main(["eval", f"infra.data_dir={tmp_path / 'data'}", f"infra.run_dir={tmp_path / 'runs'}", "--family",
                 "alfworld", "--policy", "expert", "--limit", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["episodes"] == 2 and report["success_rate"] == 1.0
    assert len(list((tmp_path / "data" / "alfworld" / "games").glob("*" + ap.GAME_SUFFIX))) == 2
    assert not splits_path(tmp_path / "data", "alfworld").exists()  # a part is never saved as the whole split
