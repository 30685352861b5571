"""Mtask: task variants written by the Mexp backbone, and their validation (paper §4.2, Eq. 6).

Owns the prompt that asks the backbone for a variant of a seed task, the parser of
its reply, and the checks a variant passes before it joins the pool:

1. it parses: one instruction line, forgiving of harmless formatting (a "Task:" /
   "New task:" label or none, bullets, numbering, markdown, quotes, a chatty
   preamble line), strict on content (no line cut off at the token cap, 3-200 words, mostly letters, no tags or
   placeholders, not a question, not the seed itself);
2. it is not a duplicate: MiniLM cosine to every task in the pool and to the
   variants accepted earlier in the round stays below `duplicate_threshold`;
3. it is feasible, i.e. the simulator can start it. A seed with a real initial
   state passes that state on (its actionable items are the seed's, so the
   variant keeps the seed's action types), with the goal line rewritten; the
   variant must name something in that state, else its target does not exist
   there, and use one of its action types (the first word of a candidate action,
   or a listed synonym), else it is rejected as `wrong_actions`; and where that
   state has a "To do:" line (TextWorld: the facts the quest still needs, which the
   reward check reads, simulator/mexp_output.py), the variant must name every
   item's objects, else it is rejected as `off_goal`: its reward would be decided
   by a goal its instruction does not state. A seed without one is started by the simulator (`ExperienceModel.
   initial_state`, or any `StartState`), whose reply must be a valid abstract
   state; that state is kept as the variant's initial state, so all rollouts of a
   group start alike.

Departures from the paper: Mtask writes one variant per request (several requests
per seed, sampled concurrently so the engine batches them) rather than a list in
one reply: a 135M model keeps one line on topic far more often than a list. A
TextWorld variant keeps its parent's To do line, so it changes the wording, a
constraint or a detail of the quest, never its target (the prompt asks for that):
the variants of stop 37's runs changed the target in their instruction only
("I will drop three paces, but you can't take more from the cookhouse.") while the
reward still followed the parent's To do line, and DreamGym GRPO with them lost
20.8 and 8.3 points where the same run without variants gained 6.2.
Each outcome is counted in CURRICULUM_VARIANTS{outcome}.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Protocol

import numpy as np

from actors.envs.base import AbstractState, StateFormatError, candidate_actions, to_do_items, validate_state
from infra import metrics
from infra.config import CurriculumConfig
from infra.schema import Task, new_id

log = logging.getLogger(__name__)

StartState = Callable[[Task], Awaitable[str]]  # the simulator's initial state for a task (may raise)

OUTCOMES = ("accepted", "unparseable", "duplicate", "infeasible", "wrong_actions", "off_goal", "engine_error")
for _outcome in OUTCOMES:  # every outcome has a series from the start (a rate over it is 0, not absent)
    metrics.CURRICULUM_VARIANTS.labels(_outcome)

SYSTEM = ("You write new training tasks for a text-game agent. Given a task, write ONE new task of the same kind: "
          "the same kind of actions, but a different target object, place, constraint or detail; where you are "
          "told what the task must end with, keep that end and change only the rest. "
          "Reply with a single line that starts with 'Task:'.")

_STOP = {"the", "a", "an", "to", "of", "in", "on", "at", "and", "or", "with", "from", "into", "for", "your", "you",
         "it", "is", "then", "that", "this", "by", "up", "out", "all", "be", "as", "task", "goal", "game"}
_LABEL = re.compile(r"^(?:new\s+|variant\s+|modified\s+)?(?:task|instruction|variant|goal|objective)\s*\d*\s*[:\-–]\s*(.*)$", re.I)
_BULLET = re.compile(r"^(?:[-*•>#]+|\d+[.)])\s*")
_PREAMBLE = re.compile(r"^(sure|here|okay|ok|certainly|of course|new task|variant)\b.*[:!.]?$", re.I)
_THINK = re.compile(r"<think>.*?(</think>|$)", re.S | re.I)


class VariantParseError(ValueError):
    """The reply holds no usable task instruction."""


class CutOffReply(str):
    """A reply the engine stopped at max_new_tokens: its last instruction may be half a sentence."""


class Embedder(Protocol):
    def embed(self, texts: list[str]) -> np.ndarray: ...  # (n, d) float32, rows unit-norm


class TextClient(Protocol):
    """The part of infra/engine/client.EngineClient that Mtask uses."""

    async def generate(self, prompt: str | None = None, **kw: Any) -> Any: ...


def _clean(line: str) -> str:
    line = line.strip()
    for _ in range(3):
        line = _BULLET.sub("", line).strip().strip("*_`").strip()
    return line


def parse_variant(text: str) -> str:
    """The instruction in an Mtask reply; VariantParseError with the reason if none is usable."""
    if not isinstance(text, str):
        raise VariantParseError("reply is not text")
    lines = [_clean(l) for l in _THINK.sub("", text).splitlines()]
    lines = [l for l in lines if l]
    if not lines:
        raise VariantParseError("empty reply (or its only line was cut at the token cap)")
    candidate = None
    for l in lines:
        m = _LABEL.match(l)
        if m and m.group(1).strip():
            candidate = m.group(1)
            break
    if candidate is None:
        rest = [l for l in lines if not _PREAMBLE.match(l) and not l.endswith(":")]
        if not rest:
            raise VariantParseError("no task line")
        candidate = rest[0]
    instr = re.sub(r"\s+", " ", _clean(candidate).strip().strip("\"'“”").strip()).rstrip(" ,;")
    check_instruction(instr)
    return instr


def check_instruction(instr: str) -> None:
    """Content rules for an instruction (raises VariantParseError)."""
    words = instr.split()
    if not 3 <= len(words) <= 200:  # TextWorld objectives run to ~150 words
        raise VariantParseError(f"{len(words)} words; expected 3-200")
    letters = sum(c.isalpha() for c in instr)
    if letters < 0.6 * len(instr.replace(" ", "")):
        raise VariantParseError("mostly not letters")
    if re.search(r"[<>{}]|\[[^\]]*\]", instr):
        raise VariantParseError("holds tags or placeholders")
    if instr.endswith("?"):
        raise VariantParseError("a question, not a task")


def content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 2 and w not in _STOP}


# Words a task may use for an action type (Eq. 6: a variant keeps the seed's action types).
_SYNONYMS = {"take": {"pick", "get", "grab", "retrieve", "collect", "fetch"}, "go": {"move", "walk", "head", "travel"},
             "click": {"press", "select", "choose", "check", "tick", "pick"}, "type": {"enter", "fill", "write", "input"},
             "put": {"place", "set", "drop", "insert"}, "insert": {"put", "place"}, "open": {"unlock"},
             "unlock": {"open"}, "eat": {"consume"}, "examine": {"look", "inspect", "check"}}


def action_verbs(state: AbstractState) -> set[str]:
    """The action types available in a state: the first word of each candidate action."""
    return {a.split()[0].lower() for a in candidate_actions(state, ("x",)) if a.split()}


def uses_action_types(instruction: str, verbs: set[str]) -> bool:
    words = set(re.findall(r"[a-z]+", instruction.lower()))
    allowed = set(verbs).union(*(_SYNONYMS.get(v, set()) for v in verbs))
    return any(w in allowed or any(len(v) > 2 and w.startswith(v) and len(w) - len(v) <= 3 for v in allowed) for w in words)


def derive_initial_state(parent_state: str, instruction: str) -> str:
    """The parent's real initial state with its goal line rewritten to the variant's instruction."""
    lines = parent_state.splitlines()
    for i, l in enumerate(lines):
        if re.match(r"^\s*(goal|objective|task)\s*:", l, re.I):
            lines[i] = f"Goal: {instruction}"
            break
    return "\n".join(lines)


def build_messages(seed: Task) -> list[dict]:
    user = [f"Task: {seed.instruction.strip()}"]
    if seed.initial_state:
        try:
            items = AbstractState.parse(seed.initial_state).items[:8]
            user.append("Actions the agent can take there: " + "; ".join(t for _, t in items))
        except StateFormatError:
            pass
        goal = to_do_items(seed.initial_state)
        if goal:
            user.append("The new task must still end with: " + ", ".join(goal)
                        + ". Change the wording, a constraint or a detail, not that.")
    user.append("Write one new task of the same kind.")
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\n".join(user)}]


@dataclass
class Rejection:
    parent_id: str
    reason: str  # one of OUTCOMES
    detail: str
    raw: str = ""


@dataclass
class VariantRound:
    accepted: list[Task] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        n = len(self.accepted) + len(self.rejected)
        return len(self.accepted) / n if n else 0.0


class TaskVariantGenerator:
    """Asks the backbone for variants of seed tasks and keeps the valid ones."""

    def __init__(self, client: TextClient | None, tokenizer: Any, cfg: CurriculumConfig, embedder: Embedder,
                 start_state: StartState | None = None):
        self.client, self.tokenizer, self.cfg = client, tokenizer, cfg
        self.embedder, self.start_state = embedder, start_state
        self.last_round = VariantRound()
        self._vectors: dict[str, np.ndarray] = {}

    def prompt(self, seed: Task) -> str:
        return self.tokenizer.apply_chat_template(build_messages(seed), tokenize=False, add_generation_prompt=True)

    async def propose(self, seeds: list[Task]) -> list[tuple[Task, str | BaseException]]:
        """`variants_per_seed` raw replies per seed, all requests in flight together."""
        sp = {"max_new_tokens": self.cfg.variant_max_new_tokens, "temperature": self.cfg.variant_temperature,
              "top_p": 0.95}
        jobs = [(s, self.prompt(s)) for s in seeds for _ in range(self.cfg.variants_per_seed)]
        results = await asyncio.gather(*(self.client.generate(p, sampling_params=sp, affinity_key=s.task_id)
                                         for s, p in jobs), return_exceptions=True)
        def raw(r: Any) -> str | BaseException:
            if isinstance(r, BaseException):
                return r
            return CutOffReply(r.text) if str(r.finish_reason) == "length" else r.text
        return [(s, raw(r)) for (s, _), r in zip(jobs, results)]

    async def validate(self, proposals: list[tuple[Task, str | BaseException]], existing: list[Task]) -> VariantRound:
        """Parse, dedupe and feasibility-check raw replies; every outcome is counted."""
        out = VariantRound()

        def reject(seed: Task, reason: str, detail: str, raw: str = "") -> None:
            out.rejected.append(Rejection(seed.task_id, reason, detail, raw))
            metrics.CURRICULUM_VARIANTS.labels(reason).inc()

        parsed: list[tuple[Task, str, str]] = []
        for seed, raw in proposals:
            if isinstance(raw, BaseException):
                reject(seed, "engine_error", f"{type(raw).__name__}: {raw}")
                continue
            try:
                # A reply cut at the token cap loses its unfinished last line, never half an instruction.
                instr = parse_variant(raw.rsplit("\n", 1)[0] if "\n" in raw else "") if isinstance(raw, CutOffReply) \
                    else parse_variant(raw)
            except VariantParseError as exc:
                reject(seed, "unparseable", str(exc), raw)
                continue
            parsed.append((seed, instr, raw))

        known = [t.instruction for t in existing]
        known_vecs = await self._embed(known)
        new_vecs = await self._embed([instr for _, instr, _ in parsed])
        known_norm = {_norm(t) for t in known}
        for (seed, instr, raw), vec in zip(parsed, new_vecs):
            sim = float((known_vecs @ vec).max()) if len(known_vecs) else 0.0
            if _norm(instr) in known_norm or sim >= self.cfg.duplicate_threshold:
                reject(seed, "duplicate", f"cosine {sim:.3f} >= {self.cfg.duplicate_threshold}", raw)
                continue
            task = Task(task_id=f"v-{new_id()[:12]}", instruction=instr, family=seed.family, seed=seed.seed,
                        parent_id=seed.task_id, generated=True,
                        meta={"depth": int(seed.meta.get("depth", 0)) + 1,
                              "root": seed.meta.get("root", seed.task_id) if seed.generated else seed.task_id})
            why = await self._feasibility(seed, task)
            if isinstance(why, str):
                named_reason = why.startswith(("wrong_actions", "off_goal"))
                reason, _, detail = why.partition(": ") if named_reason else ("infeasible", "", why)
                reject(seed, reason, detail, raw)
                continue
            out.accepted.append(why)
            metrics.CURRICULUM_VARIANTS.labels("accepted").inc()
            known_vecs = np.vstack([known_vecs, vec[None]]) if len(known_vecs) else vec[None]
            known_norm.add(_norm(instr))
        return out

    async def _embed(self, texts: list[str]) -> np.ndarray:
        """Embeddings, memoised per text (the pool is re-checked every round) and computed off the event
        loop (an embedded engine may be serving on it)."""
        todo = list(dict.fromkeys(t for t in texts if t not in self._vectors))
        if todo:
            for t, v in zip(todo, await asyncio.to_thread(self.embedder.embed, todo)):
                self._vectors[t] = np.asarray(v, dtype=np.float32)
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        return np.stack([self._vectors[t] for t in texts])

    async def _feasibility(self, seed: Task, task: Task) -> Task | str:
        """The task with its initial state if the simulator can start it, else the reason it cannot."""
        if seed.initial_state:
            state = derive_initial_state(seed.initial_state, task.instruction)
            try:
                parsed = validate_state(state)
            except StateFormatError as exc:
                return f"parent's initial state is not an abstract state: {exc}"
            scene = content_words(state.replace(task.instruction, "")) | content_words(" ".join(t for _, t in parsed.items))
            verbs = action_verbs(parsed)
            named = content_words(task.instruction) - verbs.union(*(_SYNONYMS.get(v, set()) for v in verbs))
            if not named & scene:  # the action words alone do not make a target
                return "names nothing present in the start state"
            if verbs and not uses_action_types(task.instruction, verbs):
                return f"wrong_actions: uses none of the seed's action types ({', '.join(sorted(verbs)[:8])})"
            missing = [i for i in to_do_items(state) or [] if not content_words(i) <= content_words(task.instruction)]
            if missing:
                return f"off_goal: does not name what the quest still needs ({', '.join(missing)})"
            return replace(task, initial_state=state, meta={**task.meta, "initial_state_from": "parent"})
        if self.start_state is None:
            return "no simulator to start a task without an initial state"
        try:
            state = await self.start_state(task)
            validate_state(state)
        except StateFormatError as exc:
            return f"simulator start state invalid: {exc}"
        except Exception as exc:  # MexpRejected, engine failures: the simulator could not start it
            return f"simulator could not start it: {type(exc).__name__}: {exc}"
        return replace(task, initial_state=state, meta={**task.meta, "initial_state_from": "mexp"})

    async def generate(self, seeds: list[Task], existing: list[Task]) -> list[Task]:
        """One round: propose, validate; the round's details stay in `last_round`."""
        self.last_round = await self.validate(await self.propose(seeds), existing)
        r = self.last_round
        reasons: dict[str, int] = {}
        for x in r.rejected:
            reasons[x.reason] = reasons.get(x.reason, 0) + 1
        log.info("Mtask round: %d accepted of %d (%s)", len(r.accepted), len(r.accepted) + len(r.rejected), reasons)
        return r.accepted


def _norm(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))
