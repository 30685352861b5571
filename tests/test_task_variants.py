"""Mtask: the parser, each validation rule with the real MiniLM embedder, and an end-to-end
round against the real SmolLM2 engine."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from actors.envs.base import validate_state
from infra.config import CurriculumConfig
from infra.schema import Task
from simulator.task_variants import (OUTCOMES, CutOffReply, TaskVariantGenerator, VariantParseError, build_messages, derive_initial_state,
                                     parse_variant)

KITCHEN = """Goal: take the red key from the table
Room: Kitchen. You see a table with a red key and a blue key, and a closed fridge.
Inventory: nothing
Actions:
[1] take red key from table
[2] take blue key from table
[3] open fridge
[4] go north"""

SEED = Task(task_id="tw-1", instruction="take the red key from the table", family="tw-simple", initial_state=KITCHEN)
BARE = Task(task_id="web-1", instruction="click the Submit button", family="miniwob/click-button")


@pytest.mark.parametrize("reply, expected", [
    ("Task: take the blue key from the table", "take the blue key from the table"),
    ("Sure! Here is a new task:\n\n**Task:** open the fridge and take the milk.", "open the fridge and take the milk."),
    ("1. New task: \"put the blue key in the fridge\"", "put the blue key in the fridge"),
    ("- go north and take the lamp", "go north and take the lamp"),
    ("<think>swap the key</think>\nTask 2: take the blue key", "take the blue key"),
])
def test_parser_is_forgiving_of_formatting(reply, expected):
    assert parse_variant(reply) == expected


@pytest.mark.parametrize("reply", ["", "   \n ", "Task:", "Task: go", "Task: what should I take from the table?",
                                   "Task: take [object] from [place]", "Task: 1234 5678 9999 ####",
                                   "Task: " + "word " * 220])
def test_parser_is_strict_on_content(reply):
    with pytest.raises(VariantParseError):
        parse_variant(reply)


def test_action_types_of_a_state_and_their_synonyms():
    from actors.envs.base import AbstractState
    from simulator.task_variants import action_verbs, uses_action_types

    verbs = action_verbs(AbstractState.parse(KITCHEN))
    assert verbs == {"take", "open", "go"}
    assert uses_action_types("grab the blue key", verbs) and uses_action_types("opens the fridge", verbs)
    assert not uses_action_types("admire the fridge", verbs)
    web = AbstractState.parse("Form\n[1] button 'Login'\n[2] input_text #user")
    assert action_verbs(web) == {"click", "type"} and uses_action_types("enter the user name", action_verbs(web))


def test_derived_state_keeps_the_parents_actions_and_rewrites_the_goal():
    s = derive_initial_state(KITCHEN, "take the blue key from the table")
    assert s.splitlines()[0] == "Goal: take the blue key from the table"
    assert validate_state(s).items == validate_state(KITCHEN).items
    assert "take red key from table" in build_messages(SEED)[1]["content"]


def test_every_outcome_has_a_series_before_the_first_variant():
    assert all(REGISTRY.get_sample_value("curriculum_variants_total", {"outcome": o}) is not None for o in OUTCOMES)


def _count(outcome: str) -> float:
    return REGISTRY.get_sample_value("curriculum_variants_total", {"outcome": outcome}) or 0.0


@pytest.fixture(scope="module")
def embedder():
    from simulator.embedder import Embedder

    return Embedder()


@pytest.mark.model
async def test_invalid_duplicate_and_infeasible_variants_are_rejected_each_for_its_reason(embedder):
    async def start_state(task: Task) -> str:
        if "submit" in task.instruction.lower():
            return "Page: a form\nActions:\n[1] button 'Submit'\n[2] button 'Cancel'"
        return "the page could not be imagined"  # not an abstract state

    gen = TaskVariantGenerator(None, None, CurriculumConfig(duplicate_threshold=0.95), embedder, start_state)
    before = {o: _count(o) for o in OUTCOMES}
    existing = [SEED, BARE]
    proposals = [
        (SEED, "Sure! Here is one:\nTask: take the blue key from the table"),  # valid
        (SEED, "Task: [1] ???"),                                               # does not parse
        (SEED, "Task: Take the red key from the table."),                      # the seed again
        (SEED, "Task: take the blue key from the table please"),                # same as the one just accepted
        (SEED, "Task: fly the spaceship to planet mars"),                      # nothing of it in the kitchen
        (SEED, "Task: take a boulder from the river"),                         # only the verb is in the kitchen
        (SEED, "Task: admire the red key lying on the table"),                 # no take/open/go action in it
        (BARE, "Task: click the Submit button twice then Cancel"),             # simulator starts it
        (BARE, "Task: drag the slider all the way right"),                     # simulator cannot start it
        (BARE, TimeoutError("engine down")),
        (BARE, CutOffReply("Task: click the Submit button and then the")),
        (BARE, CutOffReply("Task: click the Cancel button on the Submit form\nActions the agent can")),
    ]
    r = await gen.validate(proposals, existing)
    assert [t.instruction for t in r.accepted] == ["take the blue key from the table",
                                                   "click the Submit button twice then Cancel",
                                                   "click the Cancel button on the Submit form"]
    why = {x.raw or x.detail: (x.reason, x.detail) for x in r.rejected}
    assert why["Task: [1] ???"][0] == "unparseable"
    assert why["Task: Take the red key from the table."][0] == "duplicate"
    assert why["Task: take the blue key from the table please"][0] == "duplicate"
    assert why["Task: fly the spaceship to planet mars"][0] == "infeasible"
    assert "names nothing present" in why["Task: fly the spaceship to planet mars"][1]
    assert why["Task: admire the red key lying on the table"][0] == "wrong_actions"
    assert why["Task: take a boulder from the river"][0] == "infeasible"
    assert why["Task: drag the slider all the way right"][0] == "infeasible"
    assert "invalid" in why["Task: drag the slider all the way right"][1]
    assert why["TimeoutError: engine down"][0] == "engine_error"
    assert why["Task: click the Submit button and then the"][0] == "unparseable"  # its only line was cut
    assert len(r.rejected) == 9
    kitchen, web, _ = r.accepted
    assert kitchen.parent_id == "tw-1" and kitchen.generated and kitchen.meta["depth"] == 1
    assert kitchen.initial_state.startswith("Goal: take the blue key") and kitchen.meta["initial_state_from"] == "parent"
    assert web.parent_id == "web-1" and validate_state(web.initial_state).items[0] == (1, "button 'Submit'")
    assert _count("accepted") - before["accepted"] == 3
    assert _count("duplicate") - before["duplicate"] == 2
    assert _count("infeasible") - before["infeasible"] == 3
    assert _count("unparseable") - before["unparseable"] == 2
    assert _count("engine_error") - before["engine_error"] == 1
    assert _count("wrong_actions") - before["wrong_actions"] == 1
    assert r.acceptance_rate == pytest.approx(3 / 12)


QUEST = """Goal: Put the licorice strip on the shelf in the pantry.
Room: pantry
You see: shelf, table (on it: spork)
Inventory: licorice strip
To do: licorice strip on shelf
Actions:
[1] drop licorice strip
[2] put licorice strip on shelf
[3] take spork from table"""


@pytest.mark.model
async def test_a_variant_whose_instruction_drops_what_the_quest_still_needs_is_off_goal(embedder):
    """The To do line decides the reward: a variant naming another target would be rewarded for the parent's."""
    seed = Task(task_id="tw-7", instruction="Put the licorice strip on the shelf in the pantry.", family="tw-custom",
                initial_state=QUEST)
    assert "must still end with: licorice strip on shelf" in build_messages(seed)[1]["content"]
    gen = TaskVariantGenerator(None, None, CurriculumConfig(duplicate_threshold=0.99), embedder)
    before = _count("off_goal")
    r = await gen.validate([(seed, "Task: put the spork on the shelf"),
                            (seed, "Task: quickly place the licorice strip onto the pantry shelf")], [seed])
    assert [t.instruction for t in r.accepted] == ["quickly place the licorice strip onto the pantry shelf"]
    assert [(x.reason, x.detail) for x in r.rejected] == [
        ("off_goal", "does not name what the quest still needs (licorice strip on shelf)")]
    assert "To do: licorice strip on shelf" in r.accepted[0].initial_state
    assert _count("off_goal") - before == 1


@pytest.mark.slow
@pytest.mark.model
async def test_variants_generated_end_to_end_with_the_real_smollm2_engine(embedder, smollm2, redis_url):
    engine_server = pytest.importorskip("infra.engine.server")
    engine_client = pytest.importorskip("infra.engine.client")
    from infra.streams import connect
    from simulator.curriculum import CurriculumScheduler

    _model, tokenizer = smollm2
    cfg = CurriculumConfig(seeds_per_round=2, variants_per_seed=3, generate_every=1, batch_size=2,
                           variant_max_new_tokens=48)  # kept small: ~1 min on 2 idle cores
    handle = await engine_server.start_embedded_engine("smollm2", max_batch_size=16, loaded=smollm2)
    try:
        async with engine_client.EngineClient([handle.url], role="mexp") as client:
            gen = TaskVariantGenerator(client, tokenizer, cfg, embedder)
            seeds = [SEED, Task(task_id="tw-2", instruction="open the fridge and take the milk", family="tw-simple",
                                initial_state=KITCHEN.replace("take the red key from the table",
                                                              "open the fridge and take the milk"))]
            rc = connect(redis_url)
            sched = CurriculumScheduler(rc, cfg, "e2e", seeds, variants=gen, seed=0)
            added = await sched.generate_round()
            r = gen.last_round
            print(f"\nMtask acceptance {len(r.accepted)}/{len(r.accepted) + len(r.rejected)}; "
                  f"rejected: {[(x.reason, x.detail, x.raw[:60]) for x in r.rejected]}\n"
                  f"accepted: {[t.instruction for t in r.accepted]}")
            assert len(r.accepted) + len(r.rejected) == 6  # every request came back and was judged
            assert all(x.reason != "engine_error" for x in r.rejected)
            for t in added:  # whatever was accepted is a valid, startable, novel child of a seed
                assert t.generated and t.parent_id in {"tw-1", "tw-2"}
                validate_state(t.initial_state)
                assert t.instruction.lower() not in {s.instruction.lower() for s in seeds}
            assert len(sched.pool) == 2 + len(added)
            await rc.aclose()
    finally:
        await handle.stop()
