"""MiniWoB++ in real headless Chromium: page mapping, expert vs random, invalid actions,
the lifted episode timer, no leaked browser processes, and `dreamgym train` on the family."""

from __future__ import annotations

import asyncio
import json
import os

import psutil
import pytest

from actors.dataset import TaskSplits, splits_path
from actors.envs.base import INVALID_PREFIX, validate_state
from actors.envs.expert import make_chooser
from actors.envs.miniwob_env import Item, MiniWoBEnv, dom_rationale, expert_action, page_items, render_page
from actors.episode import run_episode
from actors.evaluate import summarize
from infra.schema import Task


def _el(ref, parent, tag, text="", value="", id="", classes="", leaf=1):
    return {"ref": ref, "parent": parent, "tag": tag, "text": text, "value": value, "id": id, "classes": classes,
            "flags": [0, 0, 0, leaf]}


LOGIN_DOM = [_el(1, 0, "body", leaf=0), _el(2, 1, "div", id="wrap", leaf=0), _el(6, 2, "label", "Username"),
             _el(7, 2, "input_text", id="username"), _el(10, 2, "input_password", id="password"),
             _el(11, 2, "button", "Login", id="subbtn"), _el(12, 2, "div", leaf=1)]


def test_page_items_and_state_rendering():
    items = page_items(LOGIN_DOM)
    assert [i.ref for i in items] == [6, 7, 10, 11]  # containers and empty leaves are left out
    state = render_page('Enter the username "kenda" and the password "x1" and press login.', items)
    st = validate_state(state)
    assert st.description.startswith("Task: Enter the username")
    assert st.items == [(6, "label 'Username'"), (7, "input_text #username"), (10, "input_password #password"),
                        (11, "button 'Login'")]


def test_checkbox_labels_come_from_text_nodes_and_expert_plans_from_fields():
    dom = [_el(5, 4, "label", leaf=0), _el(6, 5, "input_checkbox", value=False, id="ch0"), _el(-1, 5, "t", "abc"),
           _el(7, 4, "label", leaf=0), _el(8, 7, "input_checkbox", value=True, id="ch1"), _el(-2, 7, "t", "xyz"),
           _el(15, 3, "button", "Submit")]
    items = page_items(dom)
    assert [i.render() for i in items if i.tag == "input_checkbox"] == ["input_checkbox 'abc'", "input_checkbox 'xyz' (checked)"]
    fields = {"target 0": "abc", "button": "submit"}
    assert expert_action("click-checkboxes", fields, items, []) == "click [6]"
    flipped = [Item(i.ref, i.tag, i.text, i.id, {6: True, 8: False}.get(i.ref, i.value), i.classes) for i in items]
    assert expert_action("click-checkboxes", fields, flipped, []) == "click [15]"
    assert dom_rationale("click [6]", items, flipped, False, False) == \
        "click [6]: #ch0 'abc' now checked; #ch1 'xyz' now unchecked"


def _chromium_children(pid: int | None) -> list[psutil.Process]:
    if pid is None:
        return []
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.fixture(scope="module")
def mw_tasks():
    subs = ["login-user", "click-checkboxes", "enter-text", "click-button"]
    return [Task(task_id=f"miniwob/{s}/s{seed}", instruction="", family=f"miniwob/{s}", game_file=f"miniwob/{s}-v1",
                 seed=seed) for s in subs for seed in (1, 2)]


@pytest.mark.browser
@pytest.mark.slow
def test_expert_solves_and_random_is_worse_in_real_chromium(mw_tasks):
    env = MiniWoBEnv(max_steps=8)

    async def run(policy: str, seed: int):
        chooser = make_chooser(policy, seed=seed)
        return [await run_episode(env, t, chooser, 8) for t in mw_tasks]

    try:
        expert = summarize(asyncio.run(run("expert", 0)), "miniwob", "expert")
        rand = summarize(asyncio.run(run("random", 3)), "miniwob", "random")
    finally:
        asyncio.run(env.close())
    assert expert.success_rate == 1.0 and expert.invalid_rate == 0.0
    assert rand.success_rate < 0.75




@pytest.mark.browser
@pytest.mark.slow
def test_invalid_actions_timer_and_no_leaked_browser(mw_tasks):
    env = MiniWoBEnv(max_steps=10)
    state, info = env.reset_sync(mw_tasks[0])  # login-user
    driver = env._env.unwrapped.instance.driver
    assert driver.execute_script("return core.EPISODE_MAX_TIME;") == 3600 * 1000  # the 10 s timer is lifted
    assert {"click [11]", 'type [7] "' + env.fields["username"] + '"'} <= set(info["candidates"])
    for bad in ("click [999]", "open the door", 'type [11] "x"', "[3]"):
        res = env.step_sync(bad)
        assert not res.info["valid"] and res.state.startswith(INVALID_PREFIX) and not res.done
    assert res.info["invalid_actions"] == 4
    res = env.step_sync(f'type [7] "{env.fields["username"]}"')
    assert res.info["valid"] and f'#username value="{env.fields["username"]}"' in res.state
    assert res.info["rationale"].endswith(f'#username value now "{env.fields["username"]}"')
    res = env.step_sync("click [11]")  # login without the password: the page ends the episode, failure
    assert res.done and res.reward == 0.0 and not res.info["won"]
    validate_state(res.state)

    pid, data_dir = env.browser_pid, env.user_data_dir
    procs = [psutil.Process(pid)] + _chromium_children(pid)
    assert len(procs) > 1 and os.path.isdir(data_dir)
    assert any("chrom" in p.name() for p in procs[1:])
    env.close_sync()
    gone, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"leaked browser processes: {[p.pid for p in alive]}"
    assert not os.path.exists(data_dir)


@pytest.mark.browser
@pytest.mark.slow
def test_train_command_runs_dreamgym_then_sim_to_real_on_miniwob(redis_url, tmp_path, tiny_dir):
    """`dreamgym train` with actors.env_family=miniwob, the whole DreamGym path on web pages: expert
    episodes collected in Chromium seed the replay buffer, the tiny model plays Mexp for one PPO
    update, a sim-to-real phase spends exactly 4 real transitions in Chromium, and both held-out
    evaluations play the held-out pages (the unseen task, and the train task on unseen seeds).

    PPO, not GRPO: the tiny random Mexp writes no parseable state, so every synthetic episode ends as
    sim_error with one reward and GRPO would rightly discard each group; PPO updates on it regardless."""
    from infra.cli import main

    name = "mw-train"
    rc = main(["train", "--name", name, f"infra.run_dir={tmp_path / 'runs'}", f"infra.data_dir={tmp_path / 'data'}",
               f"infra.redis_url={redis_url}", "infra.train_budget_s=600", f"engines.model={tiny_dir}",
               "engines.max_batch_size=4", f"simulator.checkpoint={tiny_dir}", "simulator.max_steps=2",
               "actors.env_family=miniwob", "data.miniwob_tasks=[click-button]", "data.miniwob_heldout=[enter-text]",
               "data.miniwob_seeds=1", "data.policies=[expert]", "data.episodes_per_task=1", "data.workers=1",
               "data.max_steps=4", "actors.env_kind=synthetic", "actors.num_workers=1", "actors.group_size=2",
               "actors.concurrent_episodes=2", "actors.max_steps=2", "learner.algo=ppo",
               "learner.groups_per_update=1", "learner.total_updates=1", "learner.s2r_real_transitions=4",
               "curriculum.variants_per_seed=0", "evaluation.max_steps=2"])
    assert rc == 0
    summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
    assert summary["family"] == "miniwob"
    splits = TaskSplits.load(splits_path(tmp_path / "data", "miniwob"))
    assert {t.family for t in splits.train} == {"miniwob/click-button"}
    assert {t.family for t in splits.heldout} == {"miniwob/click-button", "miniwob/enter-text"}  # + unseen seeds
    assert not {t.task_id for t in splits.train} & {t.task_id for t in splits.heldout}
    dream, real = summary["phases"]
    assert dream["env_kind"] == "synthetic" and dream["updates"] >= 1 and summary["replay_buffer_size"] > 0
    assert real["env_kind"] == "real" and real["real_transitions"] == 4 and real["transition_budget_spent"]
    tr = summary["transitions"]
    assert tr["offline_real"] > 0 and tr["online_real"] == 4 and tr["synthetic"] > 0
    held = {t.task_id for t in splits.heldout}
    for report in (dream["heldout_after"], summary["heldout_after"]):  # after the DreamGym phase, then at the end
        assert report["episodes"] == len(held) and {r["task_id"] for r in report["per_task"]} == held
