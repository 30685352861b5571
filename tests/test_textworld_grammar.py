"""The TextWorld action grammar read backwards: which listed actions a state's own description
rules out, and which it implies. Synthetic states written to break it, and every state of real
games (random play), where nothing may be ruled out and everything implied must be listed."""

from __future__ import annotations

import random

import pytest

from actors.envs.base import AbstractState
from actors.envs.registry import action_grammar, command_refusal
from actors.envs.textworld_env import TextWorldEnv
from actors.envs.textworld_grammar import consistent_actions, implied, refusal, ruled_out
from tests.test_envs_textworld import tw_splits_for

# The 135M Mexp's failure the check exists for (2026-11-26, onpolicy_fidelity): the inventory
# is empty and the list still offers to drop and put what the policy was meant to be carrying.
SYNTHETIC = """Goal: put the Advent Calendar on the chair
Room: attic
You see: chair, chest (closed), box (open, in it: key)
Exits: north to hall through wooden door (closed); south to cellar
Inventory: nothing
To do: Advent Calendar on chair
Actions:
[1] drop Advent Calendar
[2] put Advent Calendar on chair
[3] take box
[4] open chest
[5] close chest
[6] open wooden door
[7] go north
[8] go west
[9] take key from box
[10] take lamp
[11] insert key into chest
[12] unlock chest with key
[13] examine chest"""


def _actions(state: str) -> list[str]:
    return [text for _, text in AbstractState.parse(state).items]


def test_a_state_rules_out_what_its_description_contradicts():
    assert ruled_out(SYNTHETIC, _actions(SYNTHETIC)) == [
        "drop Advent Calendar", "put Advent Calendar on chair",  # not carried
        "close chest",  # already closed
        "go west",  # no exit west
        "take lamp",  # not in sight
        "insert key into chest", "unlock chest with key"]  # the key is in the box, not in hand
    carrying = SYNTHETIC.replace("Inventory: nothing", "Inventory: Advent Calendar, key")
    assert ruled_out(carrying, _actions(carrying)) == [
        "close chest", "go west",
        "take key from box",  # already carried
        "take lamp", "insert key into chest"]  # the chest is closed
    # not TextWorld's rendering (a web page): nothing to check
    assert ruled_out("Page: login\nActions:\n[1] drop table", ["drop table"]) == []


def test_a_state_implies_what_the_world_always_offers_and_the_list_is_made_consistent():
    carrying = SYNTHETIC.replace("Inventory: nothing", "Inventory: Advent Calendar, key")
    assert sorted(implied(carrying)) == ["close box", "drop Advent Calendar", "drop key", "go north", "go south", "open chest",
                                         "open wooden door"]  # not "take key from box": the key is carried
    assert consistent_actions(carrying, ["take lamp", "go west", "put Advent Calendar on chair"]) == [
        "close box", "drop Advent Calendar", "drop key", "go north", "go south", "open chest", "open wooden door",
        "put Advent Calendar on chair"]  # sorted, as TextWorld lists them
    # Mexp's description holds the key on the counter and in hand (2026-11-26): taking it is not offered
    both = carrying.replace("box (open, in it: key)", "counter (on it: key)")
    assert "take key from counter" not in consistent_actions(both, ["take key from counter", "drop key"])
    assert consistent_actions("Page: login\nActions:\n[1] click [1]", ["click [1]"]) == ["click [1]"]


def test_the_registry_gives_the_grammar_to_textworld_families_only():
    assert action_grammar("custom") is consistent_actions and action_grammar("tw-cooking-1") is consistent_actions
    assert action_grammar("miniwob/click-button") is None and action_grammar("no-such-family") is None
    assert command_refusal("custom") is refusal and command_refusal("tw-cooking-1") is refusal
    assert command_refusal("miniwob/click-button") is None and command_refusal("no-such-family") is None


def test_free_text_is_refused_when_the_parser_has_no_such_verb_or_the_state_rules_it_out():
    assert refusal(SYNTHETIC, "dance with the chair") == "not a command"
    assert refusal(SYNTHETIC, "") == "not a command"
    for ruled in ("drop Advent Calendar", "go west", "take lamp", "close chest", "Unlock  chest with key"):
        assert refusal(SYNTHETIC, ruled) == "ruled out by the state", ruled
    for fine in ("examine chest", "look", "inventory", "open chest", "Take key from box", "go north", "take chair"):
        assert refusal(SYNTHETIC, fine) == "", fine
    # a state that is not TextWorld's rendering: only the verb is checked
    assert refusal("Page: login", "drop table") == "" and refusal("Page: login", "click [1]") == "not a command"


@pytest.mark.slow
async def test_a_real_state_rules_out_nothing_and_lists_everything_it_implies(tmp_path_factory):
    _root, splits = tw_splits_for(tmp_path_factory)
    rng, checked = random.Random(0), 0
    for task in splits.train + splits.heldout:
        for _episode in range(3):
            env = TextWorldEnv(max_steps=12)
            try:
                state, info = await env.reset(task)
                for _ in range(12):
                    listed = _actions(state)
                    assert ruled_out(state, listed) == [] and set(implied(state)) <= set(listed), state
                    assert consistent_actions(state, listed) == listed
                    assert [a for a in listed if refusal(state, a)] == []  # a listed command is free text the game takes
                    checked += 1
                    res = await env.step(rng.choice(info["candidates"]))
                    state, info = res.state, res.info
                    if res.done:
                        break
            finally:
                await env.close()
    assert checked > 60
