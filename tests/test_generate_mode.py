"""Generate mode, worker side: the chat's token ids, invalid replies, free text, restarts, the warm start's layout.

A canned engine client (it records the input_ids it is sent and answers fixed replies, as
token ids of SmolLM2's real tokenizer) stands in for the policy engine, except in the last
test, which plays against the real embedded engine with the tiny model.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from actors.envs.base import AbstractState
from actors.episode import run_episode
from actors.generate_mode import chat_delta_text, expert_reply, expert_turns, system_prompt, user_message
from actors.policy import Policy
from actors.reply import NO_ACTION, NOT_ADMISSIBLE, REASON_TEXT, TRUNCATED
from infra import metrics
from infra.config import ActorsConfig
from infra.engine.client import GenerateResult
from infra.schema import Status, Task
from tests.rollout_fakes import LadderEnv
from tests.test_reply import _fuzzed

TASK = Task(task_id="t1", instruction="climb the ladder")
GOOD = "<think>up is closer</think><action>up</action>"


@pytest.fixture(scope="module")
def tok():
    from infra.engine.models import load_tokenizer

    return load_tokenizer("smollm2")


class CannedClient:
    """Answers `replies` in turn, cycling: (text, finish_reason, ends with EOS); a callable draws one."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.calls = tok, replies, []

    async def generate(self, prompt=None, *, input_ids=None, sampling_params=None, return_logprob=False,
                       token_ids_logprob=None, affinity_key=None):
        assert prompt is None and input_ids is not None and return_logprob
        self.calls.append({"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                           "affinity_key": affinity_key})
        r = self.replies[(len(self.calls) - 1) % len(self.replies)] if isinstance(self.replies, list) else self.replies()
        text, finish, eos = r
        ids = self.tok.encode(text, add_special_tokens=False) + ([self.tok.eos_token_id] if eos else [])
        return GenerateResult(text=text, output_ids=ids, output_logprobs=[-0.01 * (i + 1) for i in range(len(ids))],
                              token_ids_logprobs=None, weight_version=7, finish_reason=finish,
                              prompt_tokens=len(input_ids))


class CountingLadder(LadderEnv):
    def __init__(self, height, free_text=False):
        super().__init__(height)
        self.actions = []
        self.accepts_free_text = free_text

    async def step(self, action):
        self.actions.append(action)
        return await super().step(action)


def policy(client, tok, **kw):
    cfg = ActorsConfig(action_mode="generate", multi_turn=True, max_reply_tokens=kw.pop("max_reply_tokens", 48), **kw)
    return Policy.from_config(cfg, client, tok, seed=0)


async def play(pol, env, max_steps=6):
    async def choose(task, state, candidates, history):
        return await pol.act(task, state, candidates, history, task.task_id)

    return await run_episode(env, TASK, choose, max_steps)


def _invalid_count(reason):
    return metrics.POLICY_INVALID_REPLIES.labels(reason)._value.get()


async def test_each_call_sees_exactly_the_previous_ids_and_the_steps_carry_them(tok):
    replies = [(GOOD, "stop", False), ("<think>climbing needs a plan and", "length", False),
               ("<think>x</think><action>UP.</action>", "stop", True), ("<action>down</action>", "stop", False),
               ("no tags at all", "stop", True)]
    client = CannedClient(tok, replies)
    traj = await play(policy(client, tok), CountingLadder(9), max_steps=5)
    assert len(traj.steps) == len(client.calls) == 5
    running: list[int] = []
    for call, step, (text, finish, eos) in zip(client.calls, traj.steps, replies):
        if step.new_chat:
            running = []
        assert call["input_ids"] == running + step.prompt_token_ids
        assert call["sampling_params"] == {"max_new_tokens": 48, "temperature": 1.0, "stop": ["</action>"]}
        assert call["affinity_key"] == "t1"
        want = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
        assert step.action_token_ids == want and step.loss_mask == [1] * len(want)
        assert step.logprobs == pytest.approx([-0.01 * (i + 1) for i in range(len(want))])
        assert step.reply == text and not step.choice_token_ids
        running += step.prompt_token_ids + step.action_token_ids
    assert [s.new_chat for s in traj.steps] == [True, False, False, False, False]
    assert [s.invalid_reason for s in traj.steps] == ["", TRUNCATED, "", "", NO_ACTION]
    assert [s.action for s in traj.steps] == ["up", "", "up", "down", ""]

    # The ids decode to the chat template's own rendering of the same conversation.
    msgs = [{"role": "system", "content": system_prompt(True)}]
    for k, step in enumerate(traj.steps):
        reason = traj.steps[k - 1].invalid_reason if k else ""
        msgs.append({"role": "user", "content": user_message(TASK, step.state, ["up", "down"], (), k == 0, True,
                                                             reason)[0]})
        prompt_so_far = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = [t for s in traj.steps[:k] for t in s.prompt_token_ids + s.action_token_ids] + step.prompt_token_ids
        assert tok.decode(ids, skip_special_tokens=False) == prompt_so_far
        assert step.policy_prompt == prompt_so_far
        msgs.append({"role": "assistant", "content": replies[k][0]})
    # a reply that stopped on the end-of-turn token is not closed twice
    assert not tok.decode(traj.steps[3].prompt_token_ids, skip_special_tokens=False).startswith("<|im_end|>")
    assert tok.decode(traj.steps[1].prompt_token_ids, skip_special_tokens=False).startswith("<|im_end|>")
    assert REASON_TEXT[TRUNCATED] in tok.decode(traj.steps[2].prompt_token_ids)


def test_the_turn_delta_comes_from_the_template(tok):
    delta = chat_delta_text(tok, "State: x")
    assert delta == "<|im_end|>\n<|im_start|>user\nState: x<|im_end|>\n<|im_start|>assistant\n"
    assert chat_delta_text(tok, "State: x", "<|im_end|>") == delta[len("<|im_end|>"):]
    assert tok.decode(tok.encode(delta, add_special_tokens=False), skip_special_tokens=False) == delta


async def test_invalid_replies_leave_the_env_alone_are_counted_and_the_episode_goes_on(tok):
    garbage = "\x00漢字 <action <|im_start|>🙂" + "".join(chr(c) for c in range(0x300, 0x340))
    replies = [("<think>I should think about this for a very", "length", False), ("I climb.", "stop", True),
               ("<think>x</think><action>fly away</action>", "stop", False), (garbage, "stop", False),
               (GOOD, "stop", False), (GOOD, "stop", False)]
    before = {r: _invalid_count(r) for r in (TRUNCATED, NO_ACTION, NOT_ADMISSIBLE)}
    env = CountingLadder(2)
    traj = await play(policy(CannedClient(tok, replies), tok, format_penalty=0.25), env, max_steps=8)
    assert traj.status == Status.SUCCESS and env.actions == ["up", "up"]
    assert [s.invalid_reason for s in traj.steps] == [TRUNCATED, NO_ACTION, NOT_ADMISSIBLE, NO_ACTION, "", ""]
    for s in traj.steps[:4]:
        assert not s.valid and s.reward == -0.25 and s.next_state == s.state and not s.done and s.action_token_ids
    assert traj.steps[4].valid and traj.steps[4].reward == 0.0 and traj.steps[5].reward == 1.0
    assert {r: _invalid_count(r) - before[r] for r in before} == {TRUNCATED: 1, NO_ACTION: 2, NOT_ADMISSIBLE: 1}
    # the next user message says why; invalid steps count toward max_steps
    assert REASON_TEXT[NOT_ADMISSIBLE] in tok.decode(traj.steps[3].prompt_token_ids)
    short = await play(policy(CannedClient(tok, [("nothing", "stop", False)]), tok), CountingLadder(2), max_steps=3)
    assert len(short.steps) == 3 and short.status == Status.TRUNCATED and short.total_reward == 0.0


async def test_free_text_goes_to_an_env_that_takes_it_and_is_invalid_elsewhere(tok):
    reply = [("<think>x</think><action>Climb Down</action>", "stop", False)]
    env = CountingLadder(5, free_text=True)
    traj = await play(policy(CannedClient(tok, reply), tok, free_text_actions=True), env, max_steps=2)
    assert env.actions == ["Climb Down", "Climb Down"]
    assert all(s.valid and s.invalid_reason == "" and s.action == "Climb Down" for s in traj.steps)
    # the next turn does not call it invalid
    assert "Your last" not in tok.decode(traj.steps[1].prompt_token_ids)
    for free, takes in ((True, False), (False, True)):
        env = CountingLadder(5, free_text=takes)
        traj = await play(policy(CannedClient(tok, reply), tok, free_text_actions=free), env, max_steps=2)
        assert env.actions == [] and [s.invalid_reason for s in traj.steps] == [NOT_ADMISSIBLE] * 2


async def test_an_invalid_reply_in_a_real_episode_spends_a_real_transition(tok, redis_url):
    """A real-transition budget pays for every turn of a real episode, a reply that named no action too
    (actors/episode.py): the environment sees only the valid ones, the budget counts them all, and once
    it is spent the episode ends where it stands."""
    from infra.budget import StepBudget
    from infra.streams import connect

    client = connect(redis_url)
    budget = StepBudget(client, "gen-budget", limit=5)
    replies = [("no tags", "stop", False), (GOOD, "stop", False), ("<action>fly</action>", "stop", False)]
    env = CountingLadder(50)
    pol = policy(CannedClient(tok, replies), tok)

    async def choose(task, state, candidates, history):
        return await pol.act(task, state, candidates, history, task.task_id)

    traj = await run_episode(env, TASK, choose, 8, env_kind="real", budget=budget)
    assert [s.invalid_reason for s in traj.steps] == [NO_ACTION, "", NOT_ADMISSIBLE, NO_ACTION, ""]
    assert env.actions == ["up", "up"] and await budget.used() == 5 and traj.status == Status.TRUNCATED
    await client.aclose()


async def test_a_long_chat_restarts_with_the_last_actions_and_greedy_works(tok):
    client = CannedClient(tok, [(GOOD, "stop", False), ("<action>down</action>", "stop", False)])
    traj = await play(policy(client, tok, chat_max_chars=900, temperature=0.0), CountingLadder(50), max_steps=6)
    assert traj.steps[0].new_chat and any(s.new_chat for s in traj.steps[1:])
    assert {c["sampling_params"]["temperature"] for c in client.calls} == {0.0}
    for call, step in zip(client.calls, traj.steps):
        if step.new_chat:
            assert call["input_ids"] == step.prompt_token_ids
            assert len(step.policy_prompt) <= 900 or step is traj.steps[0]
    k = next(i for i, s in enumerate(traj.steps) if i and s.new_chat)
    assert "Previous actions: " + "; ".join(s.action for s in traj.steps[:k][-3:]) in traj.steps[k].policy_prompt
    # the token bound: a request never passes chat_max_tokens, the reply included
    client = CannedClient(tok, [(GOOD, "stop", False)])
    traj = await play(policy(client, tok, chat_max_tokens=360, max_reply_tokens=32), CountingLadder(50), max_steps=8)
    assert any(s.new_chat for s in traj.steps[1:])
    assert all(len(c["input_ids"]) + 32 <= 360 for c in client.calls)


async def test_expert_turns_lay_out_tokens_as_the_worker_does(tok):
    env = CountingLadder(50)
    think = False
    replies = [expert_reply(a, "r", think) for a in ("up", "down", "up")] + ["<action>fly</action>",
                                                                               expert_reply("up", "", think)]
    client = CannedClient(tok, [(r, "stop", False) for r in replies])
    traj = await play(policy(client, tok, think=think, chat_max_chars=1000), env, max_steps=5)
    assert any(s.new_chat for s in traj.steps[1:])  # the bound is crossed: the restart matches too
    turns = expert_turns(tok, TASK, [(s.state, ["up", "down"], r) for s, r in zip(traj.steps, replies)], think,
                         max_chat_chars=1000, max_reply_tokens=48)
    assert [(t.prompt_token_ids, t.reply_token_ids, t.new_chat) for t in turns] == \
        [(s.prompt_token_ids, s.action_token_ids, s.new_chat) for s in traj.steps]
    assert expert_reply("go east", " the\n door ", True) == "<think>the door</think><action>go east</action>"
    assert expert_reply("go east", "why", False) == "<action>go east</action>"


async def test_in_dreamgym_mexp_gets_the_matched_action_and_never_an_invalid_reply(tok):
    from actors.envs.base import AbstractState
    from infra.config import SimulatorConfig
    from simulator.experience_model import ExperienceModel
    from simulator.synthetic_env import SyntheticEnv
    from tests.test_experience_model import ScriptedClient

    rung = [AbstractState(f"Rung {i} of 2", [(1, "climb up"), (2, "climb down")]).render() for i in range(3)]
    mexp = ScriptedClient([f"moved</think><state>\n{rung[1]}\n</state><reward>0</reward><done>false",
                           f"moved</think><state>\n{rung[2]}\n</state><reward>1</reward><done>true"])
    env = SyntheticEnv(ExperienceModel(mexp, None, SimulatorConfig(retrieval=False), tok), max_steps=6)
    replies = [("<action>Climb  Up.</action>", "stop", False), ("<action>jump</action>", "stop", False),
               ("<think>again</think><action>\"climb up\"</action>", "stop", False)]
    task = Task(task_id="s1", instruction="climb", initial_state=rung[0])
    pol = policy(CannedClient(tok, replies), tok, free_text_actions=True)  # an env built without free_text

    async def choose(task, state, candidates, history):
        return await pol.act(task, state, candidates, history, task.task_id)

    traj = await run_episode(env, task, choose, 6, env_kind="synthetic")
    assert traj.success and [(s.action, s.invalid_reason) for s in traj.steps] == \
        [("climb up", ""), ("", NOT_ADMISSIBLE), ("climb up", "")]
    assert len(mexp.prompts) == 2 and all("jump" not in p for p in mexp.prompts)
    assert traj.steps[0].reasoning == "moved" and traj.steps[1].next_state == traj.steps[1].state


CELLAR = ("Goal: open the safe\nRoom: cellar\nYou see: safe (closed)\nExits: north to shower\nInventory: nothing\n"
          "Actions:\n[1] go north\n[2] open safe")  # TextWorld's rendering, which the grammar reads
FREE = [("<action>dance</action>", "stop", False), ("<action>drop cloak</action>", "stop", False),
        ("<action>Examine  the safe</action>", "stop", False)]


def _free_text_env(client, tok, free_text=True):
    from infra.config import SimulatorConfig
    from simulator.experience_model import ExperienceModel
    from simulator.synthetic_env import SyntheticEnv

    cfg = SimulatorConfig(retrieval=False, parse_retries=0, max_new_tokens=24)
    return SyntheticEnv(ExperienceModel(client, None, cfg, tok), max_steps=6, free_text=free_text)


async def _play_free_text(env, tok, max_steps=3):
    task = Task(task_id="cellar", instruction="open the safe", family="custom", initial_state=CELLAR)
    pol = policy(CannedClient(tok, FREE), tok, free_text_actions=True, think=False)

    async def choose(task, state, candidates, history):
        return await pol.act(task, state, candidates, history, task.task_id)

    return await run_episode(env, task, choose, max_steps, env_kind="synthetic")


async def test_free_text_in_dreamgym_reaches_mexp_unless_the_grammar_refuses_it(tok):
    """actors.free_text_actions in DreamGym: a written action that is no candidate goes to Mexp as written
    (its prompt holds it; its next state is checked by the grammar as any other), unless TextWorld's grammar
    refuses it in that state: a verb it does not have ('dance'), or what the description rules out ('drop
    cloak', nothing carried). Those are invalid steps that Mexp never sees, as the real game refuses them."""
    from tests.test_experience_model import ScriptedClient

    mexp = ScriptedClient(["the safe is closed</think><state>\nRoom: cellar\nYou see: safe (closed)\n"
                           "Exits: north to shower\nInventory: nothing\nActions:\n[1] drop cloak\n[2] open safe\n"
                           "</state><reward>0</reward><done>false"])
    traj = await _play_free_text(_free_text_env(mexp, tok), tok)
    assert [(s.action, s.valid, s.invalid_reason) for s in traj.steps] == \
        [("dance", False, ""), ("drop cloak", False, ""), ("Examine  the safe", True, "")]
    assert traj.steps[0].next_state.startswith("Invalid action") and traj.steps[1].next_state.endswith(CELLAR)
    assert len(mexp.prompts) == 1 and "Action: Examine  the safe" in mexp.prompts[0]
    # Mexp's listed actions were checked: 'drop cloak' ruled out, 'go north' (the exit) added
    assert AbstractState.parse(traj.steps[2].next_state).items == [(1, "go north"), (2, "open safe")]
    assert traj.steps[2].reasoning == "the safe is closed"
    # without free text the synthetic environment refuses all three, and Mexp is never asked
    mexp = ScriptedClient([])
    traj = await _play_free_text(_free_text_env(mexp, tok, free_text=False), tok)
    assert [s.valid for s in traj.steps] == [False] * 3 and mexp.prompts == []


@pytest.mark.slow
@pytest.mark.model
async def test_free_text_reaches_the_embedded_mexp(tiny_dir):
    """The same free text against the embedded engine serving the tiny model as Mexp: the two refused
    actions send no request; the third is the one request, with the action as written in its prompt."""
    from infra.engine.client import EngineClient
    from infra.engine.models import load_model
    from infra.engine.server import start_embedded_engine

    model, tok = load_model(str(tiny_dir))
    engine = await start_embedded_engine(loaded=(model, tok), max_batch_size=2)
    try:
        async with EngineClient([engine.url], role="mexp") as client:
            class Recording:
                def __init__(self):
                    self.prompts = []

                async def generate(self, prompt=None, **kw):
                    self.prompts.append(prompt)
                    return await client.generate(prompt, **kw)

            rec = Recording()
            traj = await _play_free_text(_free_text_env(rec, tok), tok)
    finally:
        await engine.stop()
    assert [s.action for s in traj.steps[:2]] == ["dance", "drop cloak"] and not any(s.valid for s in traj.steps[:2])
    assert len(rec.prompts) == 1 and "Action: Examine  the safe" in rec.prompts[0]
    # the random tiny Mexp writes no parseable state: the episode ends as sim_error, or with its step
    assert traj.status == Status.SIM_ERROR or traj.steps[2].action == "Examine  the safe"


async def test_a_rollout_worker_survives_any_reply_and_counts_it(tok, redis_url):
    from actors.rollout_worker import RolloutWorker
    from infra.schema import Trajectory, decode_as
    from infra.streams import connect, trajectories_stream
    from tests.test_rollout_worker import PREFIX, ListSink, push_tasks

    rng = random.Random(7)

    def draw():
        if rng.random() < 0.3:
            return GOOD, "stop", False
        text = _fuzzed(rng).encode("utf-8", "replace").decode()  # an engine decodes ids to valid UTF-8
        return text, rng.choice(["stop", "length"]), rng.random() < 0.5

    client = connect(redis_url)
    cfg = ActorsConfig(action_mode="generate", multi_turn=True, group_size=4, concurrent_episodes=4, max_steps=6)
    sink = ListSink()
    before = sum(_invalid_count(r) for r in (TRUNCATED, NO_ACTION, NOT_ADMISSIBLE))
    w = RolloutWorker("w0", client, PREFIX, Policy.from_config(cfg, CannedClient(tok, draw), tok, seed=0),
                      lambda: LadderEnv(3), cfg, buffer=sink, reclaim_idle_ms=300)
    await push_tasks(client, 3)
    await asyncio.wait_for(w.run(max_groups=3), 120)
    trajs = [decode_as(f[b"d"], Trajectory) for _, f in await client.xrange(trajectories_stream(PREFIX))]
    assert len(trajs) == 12 and w.groups_failed == 0
    steps = [s for t in trajs for s in t.steps]
    bad = [s for s in steps if s.invalid_reason]
    assert bad and all(not s.valid and s.next_state == s.state for s in bad)
    assert sum(_invalid_count(r) for r in (TRUNCATED, NO_ACTION, NOT_ADMISSIBLE)) - before == len(bad)
    assert all(s.prompt_token_ids and len(s.logprobs) == len(s.action_token_ids) for s in steps)
    assert len(sink.items) == len(steps) - len(bad)  # invalid replies are not written back
    await client.aclose()


@pytest.mark.slow
@pytest.mark.model
async def test_against_the_real_engine_the_steps_carry_its_ids_and_logprobs(tiny_dir):
    import torch

    from infra.engine.client import EngineClient
    from infra.engine.models import load_model
    from infra.engine.server import start_embedded_engine

    model, tok = load_model(str(tiny_dir))
    engine = await start_embedded_engine(loaded=(model, tok), max_batch_size=4)
    try:
        async with EngineClient([engine.url], role="policy") as client:
            pol = policy(client, tok, max_reply_tokens=12)
            trajs = await asyncio.gather(*(play(pol, CountingLadder(3), max_steps=3) for _ in range(2)))
            greedy = await play(policy(client, tok, max_reply_tokens=12, temperature=0.0), CountingLadder(3), 2)
    finally:
        await engine.stop()
    for traj in [*trajs, greedy]:
        assert traj.steps and traj.steps[0].new_chat
        seq: list[int] = []
        for step in traj.steps:
            assert 0 < len(step.action_token_ids) <= 12 and len(step.logprobs) == len(step.action_token_ids)
            if step.new_chat:
                seq = []
            seq += step.prompt_token_ids
            start = len(seq)
            seq += step.action_token_ids
            with torch.no_grad():  # the sampled ids' log-probs, recomputed from the packed chat
                logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
            mine = [float(logp[p - 1, seq[p]]) for p in range(start, len(seq))]
            assert max(abs(a - b) for a, b in zip(mine, step.logprobs)) <= 1e-4
            assert step.reply == tok.decode(step.action_token_ids, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.model
async def test_train_and_eval_build_the_generate_mode_through_the_cli(tiny_run, tmp_path):
    """The driver's held-out evaluation and `dreamgym eval --policy checkpoint` play in generate mode
    when the config names it (the base regime: no RL, the starting policy evaluated)."""
    import json
    import os
    import subprocess
    import sys

    from infra.config import load_config
    from infra.run.driver import train

    over = [*tiny_run, "learner.total_updates=0", "learner.warm_start_steps=0", "actors.action_mode=generate",
            "actors.max_reply_tokens=8"]
    before = sum(_invalid_count(r) for r in (TRUNCATED, NO_ACTION, NOT_ADMISSIBLE))
    await train(load_config(None, over), "gen-base")
    # the tiny random model writes no <action>: every held-out step was a counted invalid reply
    assert sum(_invalid_count(r) for r in (TRUNCATED, NO_ACTION, NOT_ADMISSIBLE)) > before
    out = subprocess.run([sys.executable, "-m", "infra.cli", "eval", *over, "--policy", "checkpoint",
                          "--checkpoint", str(tmp_path / "runs" / "gen-base"), "--limit", "1",
                          "--out", str(tmp_path / "eval.json")], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["episodes"] == 1 and report["invalid_rate"] > 0


@pytest.mark.slow
@pytest.mark.model
def test_dreamgym_train_runs_sim_to_real_in_generate_mode_and_spends_its_real_budget(tiny_run, redis_url):
    """`dreamgym train ... learner.s2r_real_transitions=4` in generate mode: the DreamGym phase updates, then
    the real phase spends exactly its 4 real transitions and trains on them. The tiny random policy writes no
    valid reply, so each of the 4 is an invalid reply in a real episode: a turn spent there (actors/episode.py),
    the environment left alone. Before, such a phase took none and ran until its train budget.
    PPO: the all-invalid, equal-reward groups that GRPO would set aside still make updates."""
    import json
    from pathlib import Path

    import redis

    from infra.cli import main
    from infra.config import load_config
    from infra.run.driver import S2R_PHASE
    from infra.schema import EnvKind, Trajectory, decode_as
    from infra.streams import DATA_FIELD, run_prefix, trajectories_stream

    over = [*tiny_run, "actors.env_kind=synthetic", "actors.action_mode=generate", "actors.multi_turn=true",
            "actors.think=false", "actors.max_reply_tokens=6", "learner.algo=ppo", "learner.total_updates=1",
            "learner.warm_start_steps=0", "learner.s2r_real_transitions=4", "simulator.max_steps=2",
            "simulator.max_new_tokens=16", "evaluation.max_steps=2"]
    real_steps = metrics.ROLLOUT_STEPS.labels("real")._value.get()
    assert main(["train", "--name", "gen-s2r", *over]) == 0
    cfg = load_config(None, over)
    summary = json.loads((Path(cfg.infra.run_dir) / "gen-s2r" / "summary.json").read_text())
    dream, real = summary["phases"]
    assert dream["env_kind"] == "synthetic" and dream["updates"] == 1 and dream["synthetic_transitions"] > 0
    assert real["phase"] == S2R_PHASE and real["env_kind"] == "real" and real["updates"] >= 1
    assert real["real_transitions"] == 4 and real["transition_budget_spent"] and real["real_transitions_trained"] == 4
    assert summary["transitions"]["online_real"] == 4 and summary["s2r_real_transitions"] == 4
    client = redis.Redis.from_url(redis_url)
    entries = client.xrange(trajectories_stream(run_prefix(cfg.infra.stream_prefix, "gen-s2r")))
    trajs = [decode_as(fields[DATA_FIELD], Trajectory) for _, fields in entries]
    steps = [s for t in trajs if t.env_kind == EnvKind.REAL for s in t.steps]  # those the stream still holds
    assert steps and all(s.invalid_reason and s.action_token_ids for s in steps)
    # the real environment was never stepped: the 4 real transitions were the replies
    assert metrics.ROLLOUT_STEPS.labels("real")._value.get() == real_steps
