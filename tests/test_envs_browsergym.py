"""BrowserGym behind the text interface: its accessibility tree as the abstract state, its
action vocabulary mapped both ways, and real MiniWoB++ pages through BrowserGym in
Debian's Chromium (marked `browser`)."""

from __future__ import annotations

import asyncio
import json

import pytest

from actors.envs.base import INVALID_PREFIX, ActionFormatError, Environment, validate_state
from actors.envs.browsergym_env import BrowserGymEnv, axtree_items, from_browsergym, make_browsergym_tasks, to_browsergym
from actors.envs.expert import make_chooser
from actors.envs.miniwob_env import render_page
from actors.envs.registry import canonical_family, make_env
from actors.evaluate import run_episode
from infra.config import load_config
from infra.schema import Task


def _node(nid, role, name="", bid=None, kids=(), **extra):
    n = {"nodeId": nid, "role": {"value": role}, "name": {"value": name}, "childIds": list(kids), "ignored": False}
    if bid is not None:
        n["browsergym_id"] = bid
    n.update(extra)
    return n


# The shape of BrowserGym's `axtree_object` on MiniWoB's login-user and click-link pages.
AXTREE = {"nodes": [
    _node("1", "RootWebArea", "Login User Task", kids=["2", "5", "7", "9", "12"]),
    _node("2", "LabelText", "", bid="15", kids=["3"]),
    _node("3", "StaticText", "Username"),
    _node("5", "textbox", "", bid="16", value={"value": "kenda"}),
    _node("7", "checkbox", "Remember me", bid="18", properties=[{"name": "checked", "value": {"value": "true"}}]),
    _node("9", "generic", "", bid="a7", kids=["10"]),  # a span inside a frame: a non-numeric bid
    _node("10", "StaticText", "Proin"),
    _node("12", "button", "Login", bid="20"),
    _node("13", "paragraph", "", bid="14"),  # no text, not interactive: not an item
    _node("14", "button", "Hidden", bid="21"),
]}
EXTRA = {"16": {"clickable": True, "visibility": 1.0}, "21": {"visibility": 0.0}}


def test_accessibility_tree_becomes_numbered_items():
    refs: dict[str, int] = {}
    items = axtree_items(AXTREE, EXTRA, refs)
    st = validate_state(render_page("Log in as kenda.", items))
    assert st.description == "Task: Log in as kenda."
    assert st.items == [(15, "label 'Username'"), (16, 'input_text value="kenda"'), (18, "input_checkbox 'Remember me' (checked)"),
                        (100000, "span 'Proin'"), (20, "button 'Login'")]  # the invisible button is left out
    assert refs["a7"] == 100000 and axtree_items(AXTREE, EXTRA, refs)[3].ref == 100000  # stable within an episode


def test_actions_map_both_ways_and_only_for_elements_on_the_page():
    refs: dict[str, int] = {}
    items = axtree_items(AXTREE, EXTRA, refs)
    assert to_browsergym("click [20]", items, refs) == "click('20')"
    assert to_browsergym('type [16] "kenda"', items, refs) == "fill('16', 'kenda')"
    assert to_browsergym("click [100000]", items, refs) == "click('a7')"
    assert from_browsergym("click('20')") == "click [20]"
    assert from_browsergym("fill('16', 'x y')") == 'type [16] "x y"'
    assert from_browsergym("click('a7')", refs) == "click [100000]"
    assert from_browsergym("go to fridge 1") == "go to fridge 1"
    # BrowserGym runs the string as Python: typed text stays one quoted literal.
    sneaky = to_browsergym('type [16] "\'); import os; (\'"', items, refs)
    assert sneaky == "fill('16', \"'); import os; ('\")" and eval(sneaky[5:-1].split(", ", 1)[1]) == "'); import os; ('"
    for bad, why in (("click [99]", "no element"), ('type [20] "x"', "does not take text"), ("[3]", "expected click")):
        with pytest.raises(ActionFormatError, match=why):
            to_browsergym(bad, items, refs)


def test_family_is_wired_through_config_and_registry():
    cfg = load_config(None, ["actors.env_family=browsergym", "data.browsergym_tasks=[miniwob.click-test]"])
    assert cfg.actors.env_family == "browsergym" and cfg.data.browsergym_tasks == ["miniwob.click-test"]
    assert canonical_family("browsergym/webarena.310") == "browsergym"
    assert isinstance(make_env("browsergym", max_steps=3), Environment)


@pytest.mark.browser
def test_miniwob_through_browsergym_expert_random_and_invalid_actions():
    async def go():
        env = BrowserGymEnv(max_steps=4)
        try:
            results = {}
            for sub in ("click-button", "enter-text"):
                task = Task(task_id=sub, instruction="", family=f"browsergym/miniwob.{sub}", game_file=f"miniwob.{sub}", seed=4)
                traj = await run_episode(env, task, make_chooser("expert"), 4)
                results[sub] = traj
                for s in traj.steps:
                    validate_state(s.state)
                    assert s.valid and s.reasoning_source == "env-dom-diff" and s.reasoning.startswith(s.action)
            assert all(t.success and t.steps[-1].reward == 1.0 for t in results.values())
            assert [s.action.split()[0] for s in results["enter-text"].steps] == ["type", "click"]
            assert "Status: done, success" in results["enter-text"].steps[-1].next_state

            task = Task(task_id="cb", instruction="", game_file="miniwob.click-button", seed=4)
            state, info = await env.reset(task)
            button = next(ref for ref, text in validate_state(state).items if text.startswith("button"))
            assert env.goal.startswith("Click on the") and f"click [{button}]" in info["candidates"]
            for bad in ("click [9999]", f'type [{button}] "x"', "look"):
                res = await env.step(bad)
                assert res.state.startswith(INVALID_PREFIX) and not res.info["valid"] and res.reward == 0.0
            assert env.invalid == 3 and not env.done
            res = await env.step(f"click('{button}')")  # BrowserGym's own vocabulary is accepted too
            assert res.info["valid"] and res.info["browsergym_action"] == f"click('{button}')" and res.done
        finally:
            await env.close()

    asyncio.run(go())


@pytest.mark.browser
def test_a_free_text_action_fills_a_field_with_words_no_candidate_offers():
    """Generate mode with actors.free_text_actions: `type [n] "..."` reaches BrowserGym's fill with any text, so a
    form is fillable beyond the values MiniWoB's field extractor finds in the goal (the candidates)."""
    async def go():
        env = BrowserGymEnv(max_steps=4)
        try:
            state, info = await env.reset(Task(task_id="et", instruction="", game_file="miniwob.enter-text", seed=4))
            box = next(str(ref) for ref, text in validate_state(state).items if text.startswith("input_text"))
            typed = "words the goal never said"
            assert env.accepts_free_text and not any(typed in c for c in info["candidates"])
            res = await env.step(f'type [{box}] "{typed}"')
            assert res.info["valid"] and res.info["browsergym_action"] == f"fill('{box}', '{typed}')"
            assert typed in res.state and not res.done
        finally:
            await env.close()

    asyncio.run(go())


@pytest.mark.browser
@pytest.mark.slow
def test_eval_command_on_browsergym(tmp_path):
    from infra.cli import main

    overrides = [f"infra.data_dir={tmp_path / 'data'}", f"infra.run_dir={tmp_path}", "data.browsergym_tasks=[miniwob.click-test]",
                 "data.browsergym_heldout=[miniwob.focus-text]", "data.browsergym_seeds=1", "data.max_steps=4"]
    out = tmp_path / "expert.json"
    assert main(["eval", *overrides, "--family", "browsergym", "--policy", "expert", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["episodes"] == 2 and report["success_rate"] == 1.0  # focus-text, and click-test at an unseen seed
    assert {r["task_id"] for r in report["per_task"]} == {"browsergym/miniwob.focus-text/s0", "browsergym/miniwob.click-test/s500"}
    splits = make_browsergym_tasks(["miniwob.click-test"], [], seeds_per_task=1)
    assert splits.train[0].instruction == "Click the button." and splits.train[0].meta["expert"]
