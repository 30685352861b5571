"""The experience model Mexp: one synthetic transition per call, grounded on retrieval.

Owns the step of the synthetic environment (paper §4.1, Eq. 4): retrieve the top-k
most similar real/synthetic transitions (excluding the current episode), build the
prompt (simulator/prompts.py), sample from the Mexp engine through the engine
client, and parse the reply strictly (simulator/mexp_output.py). An unparseable
reply is re-sampled up to `cfg.parse_retries` times; after that the step raises
`MexpRejected` (a `SimulationError` of the environment interface), which propagates
through the synthetic environment to the episode loop (status `sim_error`). Writing synthetic transitions back into the
buffer is the rollout worker's job, once per finished group, with the policy
version (actors/rollout_worker.py; `cfg.write_back` decides whether it gets the
buffer), so this module only reads the buffer.

The buffer may be a local object or a remote proxy whose methods return
awaitables (the buffer actor); both are accepted. Switches for the paper's
ablations: `cfg.retrieval` (w/o replay) and `cfg.reasoning` (w/o reasoning).

Departures from the paper:
- `cfg.replay_real`: a step whose task, state and action are exactly those of a real
  transition among the retrieved neighbours (the offline data of a seed task, which the buffer
  holds) takes that transition's outcome instead of Mexp's. The games are deterministic, so it
  is what the real environment would answer, and Mexp is not called.
- `cfg.action_check`: a next state's action list is made the one its own description allows
  (the family's grammar, actors/envs/registry.py `action_grammar`): the actions it rules out
  ("drop cloak" under "Inventory: nothing") are dropped, the ones the world always offers and
  Mexp left out ("drop X" for each thing carried) are added, and a state left with none is
  re-sampled like an unparseable one.
- Free text (generate mode's `actors.free_text_actions`): an action the state does not list
  reaches `step` as written; the same grammar first says whether the game would refuse it
  (`refusal`: a verb it does not know, a command the description rules out, answered by the
  synthetic environment as an invalid step without a request), and otherwise Mexp writes what it
  does, its next state checked as any other. A family without a grammar leaves it all to Mexp.
- `cfg.reply_memo`: a greedy request identical to an earlier one is answered with that one's
  reply, not generated again (simulator/reply_memo.py).
- `cfg.reward_check`: a reward of 1 that the reply's own reasoning contradicts (its to-do check
  marks an item of the state's To do line "(not yet)" or leaves one out,
  simulator/mexp_output.py `contradicted_reward`) is set to 0; the next state and done stay as
  Mexp wrote them.
- `cfg.reward_affirm` (off by default): the mirror, a reward of 0 whose own reasoning checks off
  every item of the state's To do line (`affirmed_reward`) is set to 1 and the episode ends (a quest
  whose every item holds is won). A departure from the paper's Mexp, whose reward is what it writes:
  here the reward is read from the effect it predicted, where the state says what is left to do.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from typing import Any, Sequence

from actors.envs.base import AbstractState, SimulationError
from actors.envs.registry import action_grammar, command_refusal
from infra import metrics
from infra.config import SimulatorConfig
from infra.schema import Task
from simulator import prompts
from simulator.mexp_output import (MexpOutput, MexpParseError, affirmed_reward, contradicted_reward, parse_mexp_output,
                                   parse_state_only)
from simulator.replay_buffer import Transition
from simulator.reply_memo import ReplyMemo

log = logging.getLogger(__name__)


class MexpRejected(SimulationError):
    """Mexp produced no parseable output within the retry budget."""

    def __init__(self, reasons: list[str], last_text: str) -> None:
        super().__init__(f"Mexp output rejected after {len(reasons)} attempts: {', '.join(reasons)}")
        self.reasons = reasons
        self.last_text = last_text


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class ExperienceModel:
    def __init__(self, client: Any, buffer: Any, cfg: SimulatorConfig, tokenizer: Any,
                 memo: ReplyMemo | None = None) -> None:
        self.client = client
        self.buffer = buffer
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.memo = memo if memo is not None else ReplyMemo(0)  # shared by a run's models (reply_memo.py)
        self.attempts = 0
        self.parse_failures = 0

    async def retrieve(self, state: str, action: str, episode_id: str) -> list[Transition]:
        if not self.cfg.retrieval or self.buffer is None or self.cfg.top_k <= 0:
            return []
        res = await _maybe_await(self.buffer.query([(state, action)], self.cfg.top_k, [episode_id] if episode_id else None))
        return list(res[0]) if res else []

    def prompt(self, task: Task, history: Sequence[Any], retrieved: Sequence[Transition], state: str,
               action: str) -> str:
        msgs = prompts.step_messages(task, history, retrieved, state, action, reasoning=self.cfg.reasoning,
                                     history_window=self.cfg.history_window, state_chars=self.cfg.state_chars,
                                     retrieved_todo=self.cfg.retrieved_todo)
        return prompts.render(self.tokenizer, msgs, prompts.prefill(self.cfg.reasoning))

    def refusal(self, task: Task, state: str, action: str) -> str:
        """Why the task family's grammar refuses the free-text `action` in `state` ("" = Mexp is asked what
        it does; always "" with `cfg.action_check` off or a family without a grammar)."""
        check = command_refusal(task.family) if self.cfg.action_check else None
        return check(state, action) if check is not None else ""

    async def step(self, task: Task, history: Sequence[Any], state: str, action: str,
                   episode_id: str) -> MexpOutput:
        """The next state, reward and done for `action` in `state`; raises MexpRejected."""
        retrieved = await self.retrieve(state, action, episode_id)
        if self.cfg.replay_real and (known := _known_transition(retrieved, task, state, action)) is not None:
            metrics.SIMULATOR_REPLAYED_STEPS.inc()
            return MexpOutput(known.reasoning, known.next_state, float(known.reward), bool(known.done), replayed=True)
        prompt = self.prompt(task, history, retrieved, state, action)
        head = prompts.prefill(self.cfg.reasoning)
        grammar = action_grammar(task.family) if self.cfg.action_check else None
        parse = parse_mexp_output if grammar is None else lambda text: _check_actions(parse_mexp_output(text), grammar)
        out = await self._sample(prompt, head, parse, episode_id)
        out.next_state = prompts.join_goal(prompts.split_goal(state)[0], out.next_state)
        if self.cfg.reward_check and contradicted_reward(out, state):  # its own check leaves an item to do
            out.reward, out.contradicted = 0.0, True
            metrics.SIMULATOR_CONTRADICTED_REWARDS.inc()
        elif self.cfg.reward_affirm and affirmed_reward(out, state):  # its own check says the quest is won
            out.reward, out.done, out.affirmed = 1.0, True, True
            metrics.SIMULATOR_AFFIRMED_REWARDS.inc()
        metrics.SIMULATOR_STEPS.inc()
        return out

    async def initial_state(self, task: Task) -> str:
        """The task's real initial state if it has one; otherwise Mexp invents it."""
        if task.initial_state.strip():
            return task.initial_state
        prompt = prompts.render(self.tokenizer, prompts.initial_messages(task), "<state>")
        return await self._sample(prompt, "<state>", parse_state_only, task.task_id, stop="</state>")

    async def _sample(self, prompt: str, head: str, parse, affinity: str, stop: str = "</done>"):
        reasons: list[str] = []
        text = ""
        for _ in range(1 + self.cfg.parse_retries):
            self.attempts += 1
            params = {"max_new_tokens": self.cfg.max_new_tokens, "temperature": self.cfg.temperature, "stop": [stop]}
            res = await self.memo.get(ReplyMemo.key(prompt, params), functools.partial(
                self.client.generate, prompt, sampling_params=params, affinity_key=affinity or None))
            text = (head + res.text).rstrip()
            # The engine strips the matched stop string; put it back unless the reply was cut by length.
            if not text.endswith(stop) and str(res.finish_reason) != "length":
                text += stop
            try:
                return parse(text)
            except MexpParseError as exc:
                self.parse_failures += 1
                reasons.append(exc.reason)
                metrics.SIMULATOR_PARSE_FAILURES.labels(reason=exc.reason).inc()
                log.debug("Mexp parse failure (%s): %r", exc, text[-200:])
        metrics.SIMULATOR_REJECTED_STEPS.inc()
        raise MexpRejected(reasons, text)


def _known_transition(retrieved: Sequence[Transition], task: Task, state: str, action: str) -> Transition | None:
    """The real transition of this very task, state and action among the neighbours, if there is one.
    Identical (state, action) texts embed identically, so it is the top neighbour whenever the buffer
    holds it; replayed steps are not written back, so no synthetic copy can crowd it out."""
    state, action = state.strip(), action.strip()
    return next((t for t in retrieved if t.source == "real" and t.task_id == task.task_id
                 and t.action.strip() == action and t.state.strip() == state), None)


def _check_actions(out: MexpOutput, grammar) -> MexpOutput:
    """`out` with its next state's action list replaced by the one its own description allows
    (`grammar`, actors/envs/registry.py `action_grammar`); MexpParseError("actions") when that is
    none (the step is re-sampled)."""
    state = AbstractState.parse(out.next_state)
    listed = [text for _, text in state.items]
    allowed = grammar(out.next_state, listed)
    if allowed == listed:
        return out
    if not allowed:
        raise MexpParseError("actions", "the state's own description allows none of the actions it lists")
    metrics.SIMULATOR_CHECKED_ACTIONS.labels(change="dropped").inc(len(set(listed) - set(allowed)))
    metrics.SIMULATOR_CHECKED_ACTIONS.labels(change="added").inc(len(set(allowed) - set(listed)))
    out.next_state = AbstractState(state.description, list(enumerate(allowed, start=1))).render()
    return out


async def gather_steps(mexp: ExperienceModel, requests: Sequence[tuple]) -> list[MexpOutput | MexpRejected]:
    """Run many `step` calls concurrently (so the engine batches them); rejections are returned, not raised."""
    async def one(req):
        try:
            return await mexp.step(*req)
        except MexpRejected as exc:
            return exc
    return list(await asyncio.gather(*(one(r) for r in requests)))
