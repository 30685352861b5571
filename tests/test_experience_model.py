"""ExperienceModel and SyntheticEnv: prompt, retrieval, retries and rejection, episodes, gymnasium's checker.

The step logic is driven by a scripted engine client (fixed Mexp replies: the only way
to make a model's output exactly what a test needs); the real embedded engine with
SmolLM2 checks the same paths end to end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from dataclasses import dataclass, field

import pytest

from actors.envs.base import AbstractState
from infra import metrics
from infra.config import SimulatorConfig
from infra.schema import Task
from simulator import prompts
from simulator.embedder import Embedder
from simulator.experience_model import ExperienceModel, MexpRejected
from simulator.replay_buffer import EdgeBuffer, Transition
from simulator.reply_memo import ReplyMemo
from simulator.synthetic_env import SyntheticEnv

GOAL = "Goal: put the apple in the fridge"
START = f"{GOAL}\nRoom: Kitchen. A fridge.\nInventory: an apple\nActions:\n[1] open fridge\n[2] go east"
OPENED = "Room: Kitchen. The fridge is open.\nInventory: an apple\nActions:\n[1] put apple in fridge\n[2] close fridge"
GOOD = f"fridge opens</think>\n<state>\n{OPENED}\n</state>\n<reward>0</reward>\n<done>false"
WIN = "apple stored</think><state>\nRoom: Kitchen.\nActions:\n[1] close fridge\n</state><reward>1</reward><done>true"
TASK = Task("t-fridge", "put the apple in the fridge", initial_state=START)


@dataclass
class _Result:
    text: str
    finish_reason: str = "stop"
    output_ids: list = field(default_factory=list)


class ScriptedClient:
    """Replies with the given texts in turn (the engine strips the stop string, as SGLang does)."""

    def __init__(self, replies: list[str]):
        self.replies, self.prompts, self.params = list(replies), [], []

    async def generate(self, prompt=None, *, sampling_params=None, affinity_key=None, **_kw):
        self.prompts.append(prompt)
        self.params.append(sampling_params)
        return _Result(self.replies.pop(0))


@pytest.fixture(scope="module")
def tokenizer():
    from infra.engine.models import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def buffer(tmp_path_factory):
    path = tmp_path_factory.mktemp("buf")
    buf = EdgeBuffer(path / "edge", Embedder(cache_path=path / "emb.sqlite"))
    buf.add([Transition("t0", "cool the milk", START, "open fridge", "the fridge door swings open", OPENED, 0.0, False,
                        "real", "other-episode"),
             Transition("t0", "cool the milk", START, "open fridge", "SECRET own-episode effect", OPENED, 0.0, False,
                        "real", "this-episode")])
    yield buf
    buf.close()


def _count(counter, **labels) -> float:
    return (counter.labels(**labels) if labels else counter)._value.get()


@pytest.mark.slow
async def test_step_parses_retrieves_and_restores_the_goal_line(tokenizer, buffer):
    client = ScriptedClient([GOOD])
    mexp = ExperienceModel(client, buffer, SimulatorConfig(top_k=2), tokenizer)
    out = await mexp.step(TASK, ["look"], START, "open fridge", "this-episode")
    assert out.next_state == f"{GOAL}\n{OPENED}" and out.reward == 0.0 and out.done is False
    assert out.reasoning == "fridge opens"
    prompt = client.prompts[0]
    assert prompt.endswith("<think>") and "the fridge door swings open" in prompt
    assert "SECRET" not in prompt  # the episode's own transitions are never retrieved
    assert GOAL not in prompt.split("Current state:")[1]  # the goal line is factored out of states
    assert client.params[0]["stop"] == ["</done>"]


@pytest.mark.slow
async def test_ablations_change_the_prompt(tokenizer, buffer):
    client = ScriptedClient([f"\n{OPENED}\n</state><reward>0</reward><done>false"])
    mexp = ExperienceModel(client, buffer, SimulatorConfig(retrieval=False, reasoning=False), tokenizer)
    out = await mexp.step(TASK, [], START, "open fridge", "e1")
    assert out.reasoning == "" and out.next_state.endswith(OPENED)
    assert client.prompts[0].endswith("<state>") and "Similar past transitions" not in client.prompts[0]
    assert "<think>" not in client.prompts[0]


@pytest.mark.slow
async def test_retries_then_rejects_and_counts(tokenizer):
    cfg = SimulatorConfig(parse_retries=2, retrieval=False)
    before_rej = _count(metrics.SIMULATOR_REJECTED_STEPS)
    before_state = _count(metrics.SIMULATOR_PARSE_FAILURES, reason="state")
    ok = ExperienceModel(ScriptedClient(["junk", "x</think><state>no items</state><reward>0</reward><done>true", GOOD]),
                         None, cfg, tokenizer)
    assert (await ok.step(TASK, [], START, "open fridge", "e")).next_state.endswith(OPENED)
    assert ok.attempts == 3 and ok.parse_failures == 2
    bad = ExperienceModel(ScriptedClient(["junk"] * 3), None, cfg, tokenizer)
    with pytest.raises(MexpRejected) as err:
        await bad.step(TASK, [], START, "open fridge", "e")
    assert err.value.reasons == ["structure"] * 3
    assert _count(metrics.SIMULATOR_REJECTED_STEPS) == before_rej + 1
    assert _count(metrics.SIMULATOR_PARSE_FAILURES, reason="state") == before_state + 1


@pytest.mark.slow
async def test_a_reward_its_own_check_contradicts_is_set_to_zero(tokenizer):
    todo = START.replace("\nActions:", "\nTo do: apple in fridge, fridge closed\nActions:")

    def reply(check: str, reasoning: bool = True, now: str = "apple in fridge, fridge closed") -> str:
        think = f"put apple in fridge: now {now}; to do: {check}</think>" if reasoning else ""
        return (think + "<state>\nRoom: Kitchen.\nTo do: nothing\nActions:\n[1] close fridge\n</state>"
                "<reward>1</reward><done>true")

    contradicted = [reply("apple in fridge (done), fridge closed (not yet)"),  # an item still to do
                    reply("apple in fridge (done)", now="apple in fridge"),  # an item left out
                    # marked done, but the step's own "now" clause did not bring it about (a variant's
                    # "put licorice strip on shelf" checked off "spork on shelf (done)", 2026-11-26)
                    reply("apple in fridge (done), fridge closed (done)", now="apple in fridge")]
    kept = [reply("apple in fridge (done), fridge closed (done)"),  # every item done, by this step
            reply("apple in fridge (done), fridge closed (done), chest locked (not yet)")]  # a copied item
    before = _count(metrics.SIMULATOR_CONTRADICTED_REWARDS)
    mexp = ExperienceModel(ScriptedClient(contradicted + kept), None, SimulatorConfig(retrieval=False), tokenizer)
    for _ in contradicted:
        out = await mexp.step(TASK, [], todo, "put apple in fridge", "e")
        assert out.reward == 0.0 and out.contradicted and out.done is True  # only the reward changes
        assert "To do: nothing" in out.next_state
    for _ in kept:
        assert (await mexp.step(TASK, [], todo, "put apple in fridge", "e")).reward == 1.0
    assert _count(metrics.SIMULATOR_CONTRADICTED_REWARDS) == before + 3
    # no To do line in the state: any "(not yet)" contradicts; no reasoning (w/o reasoning): nothing to check
    no_line = ExperienceModel(ScriptedClient([contradicted[0], kept[0]]), None, SimulatorConfig(retrieval=False),
                              tokenizer)
    assert (await no_line.step(TASK, [], START, "put apple in fridge", "e")).reward == 0.0
    assert (await no_line.step(TASK, [], START, "put apple in fridge", "e")).reward == 1.0
    bare = ExperienceModel(ScriptedClient([reply("", reasoning=False)]), None,
                           SimulatorConfig(retrieval=False, reasoning=False), tokenizer)
    assert (await bare.step(TASK, [], todo, "put apple in fridge", "e")).reward == 1.0
    off = ExperienceModel(ScriptedClient([contradicted[0]]), None, SimulatorConfig(retrieval=False, reward_check=False),
                          tokenizer)
    assert (await off.step(TASK, [], todo, "put apple in fridge", "e")).reward == 1.0


@pytest.mark.slow
async def test_a_reward_its_own_check_affirms_is_set_to_one_with_reward_affirm(tokenizer):
    """The replies textworld_long's Mexp wrote on rewarded steps: the effect right, reward 0 (collection 47)."""
    todo = START.replace("\nActions:", "\nTo do: apple in fridge, fridge closed\nActions:")

    def reply(check: str, now: str = "apple in fridge, fridge closed", reasoning: bool = True) -> str:
        think = f"put apple in fridge: now {now}; to do: {check}</think>" if reasoning else ""
        return think + "<state>\nRoom: Kitchen.\nActions:\n[1] close fridge\n</state><reward>0</reward><done>false"

    affirmed = [reply("apple in fridge (done), fridge closed (done)"),
                reply("apple in fridge (done), fridge closed (done), chest locked (not yet)")]  # a copied item
    kept = [reply("apple in fridge (done), fridge closed (not yet)"),  # an item still to do
            reply("apple in fridge (done), fridge closed (done)", now="apple in fridge")]  # not this step's effect
    before = _count(metrics.SIMULATOR_AFFIRMED_REWARDS)
    cfg = SimulatorConfig(retrieval=False, reward_affirm=True)
    mexp = ExperienceModel(ScriptedClient(affirmed + kept), None, cfg, tokenizer)
    for _ in affirmed:
        out = await mexp.step(TASK, [], todo, "put apple in fridge", "e")
        assert out.reward == 1.0 and out.done is True and out.affirmed  # a won quest ends the episode
    for _ in kept:
        out = await mexp.step(TASK, [], todo, "put apple in fridge", "e")
        assert out.reward == 0.0 and out.done is False and not out.affirmed
    assert _count(metrics.SIMULATOR_AFFIRMED_REWARDS) == before + 2
    # no To do line in the state, or no reasoning (w/o reasoning): nothing to read; the setting off (the
    # default): the reply as written
    no_line = ExperienceModel(ScriptedClient([affirmed[0]]), None, cfg, tokenizer)
    assert (await no_line.step(TASK, [], START, "put apple in fridge", "e")).reward == 0.0
    bare = ExperienceModel(ScriptedClient([reply("", reasoning=False)]), None,
                           SimulatorConfig(retrieval=False, reasoning=False, reward_affirm=True), tokenizer)
    assert (await bare.step(TASK, [], todo, "put apple in fridge", "e")).reward == 0.0
    off = ExperienceModel(ScriptedClient([affirmed[0]]), None, SimulatorConfig(retrieval=False), tokenizer)
    assert (await off.step(TASK, [], todo, "put apple in fridge", "e")).reward == 0.0


@pytest.mark.slow
async def test_synthetic_episode_invalid_actions_win_and_truncation(tokenizer):
    client = ScriptedClient([GOOD, WIN])
    env = SyntheticEnv(ExperienceModel(client, None, SimulatorConfig(retrieval=False), tokenizer), max_steps=3)
    state, info = await env.reset(TASK)
    assert state == START and info["candidates"] == ["open fridge", "go east"]
    res = await env.step("dance")  # not a candidate: answered without Mexp
    assert not res.info["valid"] and res.state.startswith("Invalid action") and client.prompts == []
    res = await env.step("[1]")  # item 1 = "open fridge"
    assert res.info["candidates"] == ["put apple in fridge", "close fridge"] and not res.done
    assert res.info["reasoning"] == "fridge opens"
    res = await env.step("put apple in fridge")
    assert res.done and res.reward == 1.0 and res.info["won"]
    assert "Previous actions: open fridge" in client.prompts[1]

    client = ScriptedClient([GOOD, GOOD])
    env = SyntheticEnv(ExperienceModel(client, None, SimulatorConfig(retrieval=False), tokenizer), max_steps=2)
    await env.reset(TASK)
    assert not (await env.step("open fridge")).done
    res = await env.step("close fridge")
    assert res.done and res.info["truncated"] and not res.info["won"]


@pytest.mark.slow
async def test_initial_state_invented_when_the_task_has_none(tokenizer):
    client = ScriptedClient([f"\nRoom: Hall.\nActions:\n[1] go north\n"])
    mexp = ExperienceModel(client, None, SimulatorConfig(), tokenizer)
    state = await mexp.initial_state(Task("t2", "find the hall"))
    assert state == "Room: Hall.\nActions:\n[1] go north"
    assert await mexp.initial_state(TASK) == START  # a real initial state is used as is


# ---------------------------------------------------------------- real engine
@pytest.mark.slow
@pytest.mark.model
async def test_real_engine_step_is_parsed_or_rejected_and_counted(smollm2, buffer):
    from infra.engine.client import EngineClient
    from infra.engine.server import start_embedded_engine

    model, tok = smollm2
    engine = await start_embedded_engine(loaded=(model, tok), max_batch_size=4)
    try:
        async with EngineClient([engine.url]) as client:
            cut = ExperienceModel(client, buffer, SimulatorConfig(max_new_tokens=4, parse_retries=1), tok)
            with pytest.raises(MexpRejected) as err:  # 4 tokens can never close the tags
                await cut.step(TASK, [], START, "open fridge", "e")
            assert len(err.value.reasons) == 2 and cut.attempts == 2
            mexp = ExperienceModel(client, buffer, SimulatorConfig(max_new_tokens=160, parse_retries=0), tok)
            try:
                out = await mexp.step(TASK, [], START, "open fridge", "e")
                assert out.next_state.startswith(GOAL)
            except MexpRejected as exc:  # the untrained 135M model mostly misses the format
                assert len(exc.reasons) == 1
    finally:
        await engine.stop()


class _EngineThread:
    """The embedded engine on its own event loop, for synchronous (gymnasium) callers."""

    def __init__(self, loaded):
        from infra.engine.server import start_embedded_engine

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = asyncio.run_coroutine_threadsafe(
            start_embedded_engine(loaded=loaded, max_batch_size=2), self.loop).result(120)

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.engine.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.mark.slow
@pytest.mark.model
def test_synthetic_env_passes_gymnasium_checker(smollm2):
    from gymnasium.utils.env_checker import check_env

    from actors.envs.gym_wrapper import DreamGymTextEnv
    from infra.engine.client import EngineClient

    model, tok = smollm2
    server = _EngineThread((model, tok))
    try:
        client = EngineClient([server.engine.url])
        cfg = SimulatorConfig(retrieval=False, temperature=0.0, max_new_tokens=8, parse_retries=0)
        env = DreamGymTextEnv(SyntheticEnv(ExperienceModel(client, None, cfg, tok), max_steps=3, on_reject="end"),
                              [TASK], max_actions=4)
        check_env(env, skip_render_check=True)
        obs, info = env.reset(seed=0)
        assert obs == START and info["candidates"] == ["open fridge", "go east"]
        env._loop.run_until_complete(client.close())
        env.close()
    finally:
        server.stop()


async def test_action_check_makes_the_list_the_one_the_next_state_allows_and_resamples_an_empty_one(tokenizer):
    tw = Task("t-cloak", "drop the cloak in the cellar", family="custom", initial_state=START)
    dropped, added = (_count(metrics.SIMULATOR_CHECKED_ACTIONS, change=c) for c in ("dropped", "added"))

    def reply(inventory: str, *actions: str, exits: str = "north to shower", see: str = "safe (closed)") -> str:
        listed = "\n".join(f"[{i}] {a}" for i, a in enumerate(actions, start=1))
        return (f"go south: now you in cellar</think><state>\nRoom: cellar\nYou see: {see}\n"
                f"Exits: {exits}\nInventory: {inventory}\nActions:\n{listed}\n</state>"
                f"<reward>0</reward><done>false")

    mexp = ExperienceModel(ScriptedClient([reply("nothing", "go north", "drop cloak", "open safe", "go east"),
                                           reply("nothing", "drop cloak", exits="none", see="nothing"),  # none left: re-sampled
                                           reply("cloak", "open safe", exits="none")]),
                           None, SimulatorConfig(retrieval=False), tokenizer)
    out = await mexp.step(tw, [], START, "go south", "e")
    assert AbstractState.parse(out.next_state).items == [(1, "go north"), (2, "open safe")]
    assert out.next_state.startswith(GOAL) and "Inventory: nothing" in out.next_state
    out = await mexp.step(tw, [], START, "go south", "e")  # "drop cloak" added: the cloak is carried
    assert AbstractState.parse(out.next_state).items == [(1, "drop cloak"), (2, "open safe")]
    assert mexp.parse_failures == 1 and _count(metrics.SIMULATOR_PARSE_FAILURES, reason="actions") >= 1
    assert _count(metrics.SIMULATOR_CHECKED_ACTIONS, change="dropped") == dropped + 2  # a rejected reply counts nothing
    assert _count(metrics.SIMULATOR_CHECKED_ACTIONS, change="added") == added + 1
    # off, or a family without a grammar: the state is Mexp's as written
    off = ExperienceModel(ScriptedClient([reply("nothing", "drop cloak", "go east")]), None,
                          SimulatorConfig(retrieval=False, action_check=False), tokenizer)
    assert len(AbstractState.parse((await off.step(tw, [], START, "go south", "e")).next_state).items) == 2
    web = ExperienceModel(ScriptedClient([reply("nothing", "drop cloak", "go east")]), None,
                          SimulatorConfig(retrieval=False), tokenizer)
    assert len(AbstractState.parse((await web.step(TASK, [], START, "go south", "e")).next_state).items) == 2


@pytest.mark.slow
async def test_replay_real_answers_only_the_same_tasks_exact_real_step(tokenizer, buffer):
    """The buffer holds t0's real (START, open fridge) from two episodes: t0 replays the one that is not
    its own without calling Mexp; another task, another action or the setting off ask Mexp."""
    t0 = Task("t0", "cool the milk", initial_state=START)
    client = ScriptedClient([GOOD] * 4)
    mexp = ExperienceModel(client, buffer, SimulatorConfig(top_k=2), tokenizer)
    out = await mexp.step(t0, [], START, "open fridge", "this-episode")
    assert out.replayed and out.next_state == OPENED and client.prompts == []
    assert out.reasoning == "the fridge door swings open"  # the other episode's; its own one is excluded
    for task, action, cfg in [(TASK, "open fridge", SimulatorConfig(top_k=2)), (t0, "go east", SimulatorConfig(top_k=2)),
                              (t0, "open fridge", SimulatorConfig(top_k=2, replay_real=False))]:
        out = await ExperienceModel(client, buffer, cfg, tokenizer).step(task, [], START, action, "e")
        assert not out.replayed
    assert len(client.prompts) == 3


def test_drop_todo_removes_only_the_to_do_clause():
    effect = "close portal: now portal closed; no longer portal open; to do: you in workshop (not yet), portal closed (done)"
    assert prompts.drop_todo(effect) == "close portal: now portal closed; no longer portal open"
    won = "put apple in fridge: now apple in fridge; to do: apple in fridge (done); the goal is reached"
    assert prompts.drop_todo(won) == "put apple in fridge: now apple in fridge; the goal is reached"
    assert prompts.drop_todo("look: nothing in the world changed") == "look: nothing in the world changed"


@pytest.mark.slow
async def test_retrieved_todo_off_hides_the_neighbours_to_do_lists_but_not_the_states(tokenizer, tmp_path):
    """simulator.retrieved_todo=false: a retrieved transition is shown without its "to do: ..." clause
    (another episode's list, which textworld_long's Mexp copied), while the current state keeps its To do line."""
    todo_state = START.replace("\nActions:", "\nTo do: apple in fridge\nActions:")
    buf = EdgeBuffer(tmp_path / "edge", Embedder(cache_path=tmp_path / "emb.sqlite"))
    buf.add([Transition("t0", "cool the milk", todo_state, "open fridge",
                        "open fridge: now fridge open; to do: milk in fridge (not yet), fridge closed (not yet)",
                        OPENED, 0.0, False, "real", "other-episode")])
    shown = {}
    for todo in (True, False):
        client = ScriptedClient([GOOD])
        await ExperienceModel(client, buf, SimulatorConfig(top_k=1, replay_real=False, retrieved_todo=todo),
                              tokenizer).step(TASK, [], todo_state, "open fridge", "e")
        neighbours, _, current = client.prompts[0].partition("Current state:")
        shown[todo] = neighbours
        assert "open fridge: now fridge open" in neighbours and "To do: apple in fridge" in current
    buf.close()
    assert "milk in fridge (not yet)" in shown[True] and "to do:" not in shown[False]


@pytest.mark.slow
async def test_a_shared_reply_memo_generates_a_greedy_step_once_and_a_sampled_one_each_time(tokenizer):
    class Slow(ScriptedClient):  # the group's rollouts ask while the first request is still generating
        async def generate(self, prompt=None, **kw):
            await asyncio.sleep(0.01)
            return await super().generate(prompt, **kw)

    greedy = SimulatorConfig(retrieval=False, temperature=0.0, parse_retries=1)
    client, memo = Slow([GOOD] * 4 + ["junk"]), ReplyMemo(greedy.reply_memo)
    group = [ExperienceModel(client, None, greedy, tokenizer, memo) for _ in range(4)]
    outs = await asyncio.gather(*(m.step(TASK, [], START, "open fridge", f"e{i}") for i, m in enumerate(group)))
    assert len(client.prompts) == 1 and {o.next_state for o in outs} == {f"{GOAL}\n{OPENED}"}
    await group[0].step(TASK, [], START, "open fridge", "e9")  # a later group: still the kept reply
    assert len(client.prompts) == 1 and memo.hits == 4
    await group[0].step(TASK, [], START, "go east", "e0")  # another action: another request
    assert len(client.prompts) == 2
    sampled = ExperienceModel(client, None, dataclasses.replace(greedy, temperature=0.7), tokenizer, memo)
    for _ in range(2):
        await sampled.step(TASK, [], START, "open fridge", "e0")
    assert len(client.prompts) == 4
    bad = ExperienceModel(client, None, greedy, tokenizer, memo)  # a greedy retry reproduces the reply: not asked again
    with pytest.raises(MexpRejected):
        await bad.step(TASK, [], START, "look", "e0")
    assert len(client.prompts) == 5 and bad.attempts == 2
