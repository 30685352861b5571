"""The wire schema: every message that crosses a process boundary (Task, Step, Trajectory).

One versioned module, msgpack only, never pickle. A message is a msgpack map
`{"v": SCHEMA_VERSION, "type": <kind>, ...fields}`; field names are the dataclass
field names below and stay stable within a schema version. Decoding checks the
version first and raises a typed error (`MalformedMessage`, `UnknownSchemaVersion`,
`InvalidField`) that the stream consumer turns into a dead letter.

Decoding also validates every field: its type, that numbers are finite and in range
(rewards, log-probs, values, timings), that the per-token lists of a step agree in
length, and that sizes stay under the bounds below. A message that passed `decode` is
safe to train on: no NaN reaches a loss, no string a tensor. Encoding does not
validate (workers build their own messages; the reader is the one who must not trust).

Per-token data: a Step carries the token ids of the policy's action and their
behaviour log-probs, plus a loss mask (1 = trained). In DreamGym's default
"choice" action mode the policy picks one labelled candidate with a single token
and `choice_token_ids` lists the label tokens the distribution was renormalised
over, so the learner recomputes exactly the same log-prob (see actors/policy.py).
In the "score" action mode the policy scores every candidate's text by its
log-likelihood: `choice_token_ids` holds the candidates' token ids end to end,
`choice_lengths` their lengths, `action_token_ids` the chosen candidate's tokens, and
`logprobs` and `loss_mask` one value each, for the choice as a whole. In both, `temperature`
is the one the behaviour log-prob was read at (the sampling temperature; 1 for a greedy pick),
so the learner reads the policy at the same one (learner/update.py); a message without it
(written before it existed) reads as 1.
In the "generate" action mode (schema version 2) the policy writes its reply token by
token: `action_token_ids` are the exact ids the engine sampled, `logprobs` and
`loss_mask` one per sampled token, `prompt_token_ids` the ids this turn appended to
the episode's chat before the reply (the whole prompt when `new_chat`, else the end of
the previous turn and the new observation: in the sequence, masked out of the loss),
`reply` the text written and `invalid_reason` why it named no legal action ("" when it
did). The learner concatenates a chat's prompt and reply ids and never re-tokenises.

Versions: this build writes 2 and reads 1 and 2 (a version-1 message is a version-2 one
without the generate-mode fields, which take their defaults); any other version is a
dead letter (`UnknownSchemaVersion`).
"""

from __future__ import annotations

import enum
import time
import uuid
from array import array
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar

import msgpack

SCHEMA_VERSION = 2
READABLE_VERSIONS = frozenset((1, 2))  # 1: before the generate mode's Step fields

# Bounds a decoded message must respect. Generous for DreamGym's shapes (a step is ~2.5 KB,
# an episode at most a few dozen steps) yet tight enough that one message cannot exhaust a
# learner's memory or overflow the float32 maths downstream.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # whole encoded message; a 20 KB trajectory is 1/400 of it
MAX_STEPS = 1024  # steps per trajectory; episodes are capped at actors/simulator.max_steps (8-20)
MAX_TEXT_CHARS = 1 << 20  # one text field (state, prompt, instruction): more than a 128k-token context
MAX_ID_CHARS = 256  # ids, names and labels (task_id, group_id, family, reasoning_source ...)
MAX_TOKENS = 32_768  # one per-token list (action tokens, log-probs, loss mask, choice labels)
MAX_TOKEN_ID = 2 ** 32 - 1  # a sanity bound (what array('I') holds); vocabularies are ~1e5
MAX_MAP_ITEMS = 256  # entries of Task.meta and Trajectory.timings
MAX_ABS_REWARD = 1e6  # |reward| and |value|: outcome rewards are 0/1; squares stay finite in float32
LOGPROB_RANGE = (-1e4, 1e-3)  # a log-prob is <= 0 (1e-3 of rounding allowed); -1e4 is already p = 0
MAX_SECONDS = 1e7  # one timing (~116 days)
TEMPERATURE_RANGE = (1e-3, 100.0)  # a step's log-prob temperature
MAX_TIMESTAMP = 1e11  # created_at, Unix seconds (year 5138)
MAX_VERSION = 2 ** 62  # policy_version and seeds fit in int64


class SchemaError(ValueError):
    """Base class for messages that cannot be decoded."""


class MalformedMessage(SchemaError):
    """The bytes are not a msgpack map of the expected shape."""


class UnknownSchemaVersion(SchemaError):
    """The message was written by an incompatible schema version."""


class InvalidField(SchemaError):
    """A field has the wrong type, a non-finite or out-of-range number, a length that
    disagrees with its sibling lists, or a size over its bound; the message names the field."""


class EnvKind(str, enum.Enum):
    SYNTHETIC = "synthetic"
    REAL = "real"


class Status(str, enum.Enum):
    """How an episode ended."""

    SUCCESS = "success"  # reached the goal (reward 1 at the final step)
    FAILURE = "failure"  # terminated without success
    TRUNCATED = "truncated"  # hit max_steps
    SIM_ERROR = "sim_error"  # Mexp output could not be parsed within the retry budget
    ENV_ERROR = "env_error"  # the real environment crashed


def new_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass
class Task:
    """A task instruction, optionally with the real initial state it starts from."""

    KIND: ClassVar[str] = "task"

    task_id: str
    instruction: str
    family: str = ""  # e.g. "tw-cooking", "miniwob/login-user"
    initial_state: str = ""  # abstract textual state; empty = Mexp invents it
    game_file: str = ""  # real env handle (TextWorld .z8 path or MiniWoB env id)
    seed: int = 0
    parent_id: str = ""  # set for curriculum variants
    generated: bool = False  # written by Mtask rather than taken from the real set
    meta: dict = field(default_factory=dict)


REPLAYED = "replay"  # a synthetic step answered by a real transition of the buffer (simulator.replay_real)


@dataclass
class Step:
    """One transition as the policy saw and acted in it."""

    KIND: ClassVar[str] = "step"

    state: str
    action: str
    reward: float = 0.0
    done: bool = False
    next_state: str = ""
    reasoning: str = ""  # Mexp's <think> text, or the env-derived rationale
    reasoning_source: str = ""  # "mexp", "env-facts", "env-dom-diff", "teacher", REPLAYED
    valid: bool = True  # the action was admissible/parseable
    policy_prompt: str = ""  # exact text the policy was conditioned on
    action_token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # behaviour log-prob per action token
    loss_mask: list = field(default_factory=list)  # 1 where the token is trained
    choice_token_ids: list = field(default_factory=list)  # label tokens renormalised over (choice mode)
    value: float = 0.0  # PPO value estimate at this state, if the worker computed one
    choice_lengths: list = field(default_factory=list)  # score mode: token count of each candidate in choice_token_ids
    prompt_token_ids: list = field(default_factory=list)  # generate mode: ids appended to the chat before the reply
    new_chat: bool = False  # generate mode: prompt_token_ids open a fresh chat (first turn, or past the chat's bound)
    reply: str = ""  # generate mode: the text the policy wrote (<think>...</think><action>...</action>)
    invalid_reason: str = ""  # generate mode: why the reply named no legal action ("" = it did)
    temperature: float = 1.0  # label and score mode: the temperature `logprobs` were read at (the sampling one)


@dataclass
class Trajectory:
    """One episode, the unit pushed to the trajectory stream."""

    KIND: ClassVar[str] = "trajectory"

    task_id: str
    group_id: str
    steps: list = field(default_factory=list)  # list[Step]
    env_kind: EnvKind = EnvKind.SYNTHETIC
    status: Status = Status.FAILURE
    success: bool = False
    policy_version: int = 0
    worker_id: str = ""
    trajectory_id: str = field(default_factory=new_id)
    created_at: float = field(default_factory=time.time)
    timings: dict = field(default_factory=dict)  # seconds: "policy", "env", "total" (+ labels: "policy_name")
    task: Task | None = None

    @property
    def total_reward(self) -> float:
        return float(sum(s.reward for s in self.steps))


_TYPES: dict[str, type] = {cls.KIND: cls for cls in (Task, Step, Trajectory)}
_FIELD_NAMES: dict[type, frozenset] = {cls: frozenset(f.name for f in fields(cls)) for cls in _TYPES.values()}


def to_dict(obj: Task | Step | Trajectory) -> dict:
    # Shallow copies, not dataclasses.asdict: asdict deep-copies recursively and cost
    # ~1 ms per 20 KB trajectory, which capped the stream path below 1k/s.
    d = dict(obj.__dict__)
    if isinstance(obj, Trajectory):
        d["steps"] = [dict(s.__dict__) for s in obj.steps]
        d["task"] = dict(obj.task.__dict__) if obj.task is not None else None
        d["env_kind"] = obj.env_kind.value
        d["status"] = obj.status.value
    d["v"] = SCHEMA_VERSION
    d["type"] = obj.KIND
    return d


# ----- validation at decode -----
# Scalars (rewards, values, timings) are int or float, never bool. Per-token lists follow
# what one C conversion accepts: token ids are ints in [0, MAX_TOKEN_ID], log-probs are
# numbers in LOGPROB_RANGE, loss-mask entries equal 0 or 1; msgpack booleans pass in lists
# as 0/1 (harmless there, and refusing them would cost a Python loop per list).
_NUMBER_TYPES = frozenset((int, float))
_LIST_NUMBER_TYPES = frozenset((int, float, bool))
_LIST_INT_TYPES = frozenset((int, bool))
_MASK_VALUES = frozenset((0, 1))
_STEP_TEXT = ("state", "action", "next_state", "reasoning", "policy_prompt", "reply")
_TASK_TEXT = ("instruction", "initial_state", "game_file")
_TASK_IDS = ("task_id", "family", "parent_id")
_TRAJ_IDS = ("task_id", "group_id", "worker_id", "trajectory_id")


def _invalid(name: str, value: Any, expected: str) -> InvalidField:
    shown = repr(value) if not isinstance(value, (str, bytes, list, dict)) or len(value) <= 40 else \
        f"{type(value).__name__} of length {len(value)}"
    return InvalidField(f"{name}: got {shown}; expected {expected}")


def _text(d: dict, names: tuple, limit: int) -> None:
    for name in names:
        v = d[name]
        if type(v) is not str or len(v) > limit:
            raise _invalid(name, v, f"a string of at most {limit} characters")


def _number(name: str, v: Any, lo: float, hi: float) -> None:
    # NaN fails both comparisons and the bounds are finite, so this is also the finiteness check.
    if type(v) not in _NUMBER_TYPES or not lo <= v <= hi:
        raise _invalid(name, v, f"a finite number in [{lo:g}, {hi:g}]")


def _flag(name: str, v: Any) -> None:
    if type(v) is not bool:
        raise _invalid(name, v, "true or false")


def _numbers(name: str, v: Any, lo: float, hi: float) -> int:
    """Check a list of finite numbers within [lo, hi]; returns its length."""
    if type(v) is not list or len(v) > MAX_TOKENS:
        raise _invalid(name, v, f"a list of at most {MAX_TOKENS} numbers")
    if v:
        if not _LIST_NUMBER_TYPES.issuperset(map(type, v)):
            raise _invalid(name, v, "numbers only")
        total = sum(v)  # any NaN or inf makes the sum non-finite, wherever it sits
        if total - total != 0 or not (lo <= min(v) and max(v) <= hi):
            raise _invalid(name, v, f"finite numbers in [{lo:g}, {hi:g}]")
    return len(v)


def _ints(name: str, v: Any, lo: int, hi: int) -> int:
    """Check a list of integers within [lo, hi]; returns its length."""
    if type(v) is not list or len(v) > MAX_TOKENS:
        raise _invalid(name, v, f"a list of at most {MAX_TOKENS} integers")
    if v and (not _LIST_INT_TYPES.issuperset(map(type, v)) or min(v) < lo or max(v) > hi):
        raise _invalid(name, v, f"integers in [{lo}, {hi}]")
    return len(v)


def _mask(name: str, v: Any) -> int:
    if type(v) is not list or len(v) > MAX_TOKENS or not _MASK_VALUES.issuperset(v):
        raise _invalid(name, v, f"a list of at most {MAX_TOKENS} zeros and ones")
    return len(v)


def _explain_step(d: dict) -> None:
    """The field-by-field checks of a step; raises InvalidField naming the first bad one."""
    _text(d, _STEP_TEXT, MAX_TEXT_CHARS)
    _text(d, ("reasoning_source", "invalid_reason"), MAX_ID_CHARS)
    _flag("new_chat", d["new_chat"])
    _ints("prompt_token_ids", d["prompt_token_ids"], 0, MAX_TOKEN_ID)
    _number("reward", d["reward"], -MAX_ABS_REWARD, MAX_ABS_REWARD)
    _number("value", d["value"], -MAX_ABS_REWARD, MAX_ABS_REWARD)
    _flag("done", d["done"])
    _flag("valid", d["valid"])
    _number("temperature", d["temperature"], *TEMPERATURE_RANGE)
    n = _ints("action_token_ids", d["action_token_ids"], 0, MAX_TOKEN_ID)
    n_choices = _ints("choice_token_ids", d["choice_token_ids"], 0, MAX_TOKEN_ID)
    if _ints("choice_lengths", d["choice_lengths"], 1, MAX_TOKENS) and sum(d["choice_lengths"]) != n_choices:
        raise InvalidField(f"choice_lengths: they sum to {sum(d['choice_lengths'])}, choice_token_ids holds {n_choices}")
    if d["choice_lengths"]:
        n = 1  # score mode: one log-prob and one mask value for the whole choice
    # Empty per-token lists are allowed (real-environment and offline steps carry none);
    # present ones must cover every action token.
    n_lp = _numbers("logprobs", d["logprobs"], *LOGPROB_RANGE)
    if n_lp and n_lp != n:
        raise InvalidField(f"logprobs: {n_lp} values for {n} action_token_ids")
    n_mask = _mask("loss_mask", d["loss_mask"])
    if n_mask and n_mask != n:
        raise InvalidField(f"loss_mask: {n_mask} values for {n} action_token_ids")


def _tokens_ok(tokens: list) -> bool:
    try:  # one C pass checks type and range: array("I") takes only ints in [0, 2**32 - 1]
        array("I", tokens)
    except (TypeError, OverflowError):
        return False
    return True


def _logprobs_ok(lps: list) -> bool:
    if len(lps) == 1:  # choice mode: one label token
        x = lps[0]
        return type(x) in _LIST_NUMBER_TYPES and LOGPROB_RANGE[0] <= x <= LOGPROB_RANGE[1]
    try:
        array("d", lps)  # numbers only, in one C pass
    except (TypeError, OverflowError):
        return False
    total = sum(lps)  # any NaN or inf makes the sum non-finite, wherever it sits
    return total - total == 0 and min(lps) >= LOGPROB_RANGE[0] and max(lps) <= LOGPROB_RANGE[1]


def _check_step(d: dict) -> None:
    # The same checks as _explain_step in one expression and a few C passes: a step is
    # checked on every decode (field by field it cost 2.5x as much), and only a failing
    # step pays for the named diagnosis.
    state, action, next_state, reasoning, prompt, source = (
        d["state"], d["action"], d["next_state"], d["reasoning"], d["policy_prompt"], d["reasoning_source"])
    reward, value, ids, lps, mask, choices = (
        d["reward"], d["value"], d["action_token_ids"], d["logprobs"], d["loss_mask"], d["choice_token_ids"])
    lens, pids, reply, why, temp = (d["choice_lengths"], d["prompt_token_ids"], d["reply"], d["invalid_reason"],
                                    d["temperature"])
    # score mode: one log-prob and one mask value for the choice; else one per action token
    per = 1 if type(lens) is list and lens else (len(ids) if type(ids) is list else -1)
    if not (type(state) is str and type(action) is str and type(next_state) is str and type(reasoning) is str
            and type(prompt) is str and type(source) is str and type(reply) is str and type(why) is str
            and len(reply) <= MAX_TEXT_CHARS and len(why) <= MAX_ID_CHARS and type(d["new_chat"]) is bool
            and type(pids) is list and len(pids) <= MAX_TOKENS and _tokens_ok(pids)
            and len(state) <= MAX_TEXT_CHARS and len(action) <= MAX_TEXT_CHARS and len(next_state) <= MAX_TEXT_CHARS
            and len(reasoning) <= MAX_TEXT_CHARS and len(prompt) <= MAX_TEXT_CHARS and len(source) <= MAX_ID_CHARS
            and type(reward) in _NUMBER_TYPES and -MAX_ABS_REWARD <= reward <= MAX_ABS_REWARD
            and type(value) in _NUMBER_TYPES and -MAX_ABS_REWARD <= value <= MAX_ABS_REWARD
            and type(d["done"]) is bool and type(d["valid"]) is bool
            and type(temp) in _NUMBER_TYPES and TEMPERATURE_RANGE[0] <= temp <= TEMPERATURE_RANGE[1]
            and type(ids) is list and type(choices) is list and type(lps) is list and type(mask) is list
            and len(ids) <= MAX_TOKENS and len(choices) <= MAX_TOKENS
            and type(lens) is list and (not lens or (_tokens_ok(lens) and min(lens) >= 1 and sum(lens) == len(choices)))
            and (not lps or len(lps) == per) and (not mask or len(mask) == per)
            and _tokens_ok(ids + choices) and _MASK_VALUES.issuperset(mask) and (not lps or _logprobs_ok(lps))):
        _explain_step(d)
        raise AssertionError(f"_check_step and _explain_step disagree on {d!r}")  # unreachable if they agree


def _check_task(d: dict) -> None:
    _text(d, _TASK_IDS, MAX_ID_CHARS)
    _text(d, _TASK_TEXT, MAX_TEXT_CHARS)
    _flag("generated", d["generated"])
    if type(d["seed"]) is not int or not -MAX_VERSION <= d["seed"] <= MAX_VERSION:
        raise _invalid("seed", d["seed"], "an integer")
    meta = d["meta"]
    if type(meta) is not dict or len(meta) > MAX_MAP_ITEMS:
        raise _invalid("meta", meta, f"a map of at most {MAX_MAP_ITEMS} entries")


def _explain_trajectory(d: dict) -> None:
    _text(d, _TRAJ_IDS, MAX_ID_CHARS)
    _flag("success", d["success"])
    if type(d["policy_version"]) is not int or not 0 <= d["policy_version"] <= MAX_VERSION:
        raise _invalid("policy_version", d["policy_version"], f"an integer in [0, {MAX_VERSION}]")
    _number("created_at", d["created_at"], 0.0, MAX_TIMESTAMP)
    timings = d["timings"]
    if type(timings) is not dict or len(timings) > MAX_MAP_ITEMS:
        raise _invalid("timings", timings, f"a map of at most {MAX_MAP_ITEMS} entries")
    for k, v in timings.items():
        if type(k) is not str or len(k) > MAX_ID_CHARS:
            raise _invalid("timings key", k, f"a string of at most {MAX_ID_CHARS} characters")
        if type(v) is str:  # a label (actors/collect.py tags "policy_name")
            if len(v) > MAX_ID_CHARS:
                raise _invalid(f"timings[{k!r}]", v, f"seconds, or a label of at most {MAX_ID_CHARS} characters")
        else:
            _number(f"timings[{k!r}]", v, 0.0, MAX_SECONDS)


def _check_trajectory(d: dict) -> None:
    # steps and task were validated when they were built (from_dict); env_kind/status by their enums.
    task_id, group_id, worker_id, traj_id, version, created, timings = (
        d["task_id"], d["group_id"], d["worker_id"], d["trajectory_id"], d["policy_version"], d["created_at"], d["timings"])
    if not (type(task_id) is str and type(group_id) is str and type(worker_id) is str and type(traj_id) is str
            and len(task_id) <= MAX_ID_CHARS and len(group_id) <= MAX_ID_CHARS and len(worker_id) <= MAX_ID_CHARS
            and len(traj_id) <= MAX_ID_CHARS and type(d["success"]) is bool
            and type(version) is int and 0 <= version <= MAX_VERSION
            and type(created) in _NUMBER_TYPES and 0.0 <= created <= MAX_TIMESTAMP
            and type(timings) is dict and len(timings) <= MAX_MAP_ITEMS
            and all(type(k) is str and len(k) <= MAX_ID_CHARS
                    and (type(v) in _NUMBER_TYPES and 0.0 <= v <= MAX_SECONDS or type(v) is str and len(v) <= MAX_ID_CHARS)
                    for k, v in timings.items())):
        _explain_trajectory(d)
        raise AssertionError(f"_check_trajectory and _explain_trajectory disagree on {d!r}")


_CHECKS: dict[type, Callable[[dict], None]] = {Task: _check_task, Step: _check_step, Trajectory: _check_trajectory}


def from_fields(cls: type, d: dict) -> Any:
    """A Task, Step or Trajectory from a map of its fields (no version header; nested ones already
    built), validated like a decoded message."""
    if not isinstance(d, dict):
        raise MalformedMessage(f"{cls.KIND}: expected a map, got {type(d).__name__}")
    if d.keys() == _FIELD_NAMES[cls]:
        # Fast path for exactly our fields: skip __init__ (4-5 us per Step), since msgpack
        # handed us a fresh dict we can own.
        _CHECKS[cls](d)
        obj = cls.__new__(cls)
        obj.__dict__ = d
        return obj
    try:  # extra keys (written by a newer minor revision) are ignored; missing required ones are not
        obj = cls(**{k: v for k, v in d.items() if k in _FIELD_NAMES[cls]})
    except TypeError as exc:
        raise MalformedMessage(f"{cls.KIND}: {exc}") from exc
    _CHECKS[cls](obj.__dict__)
    return obj


def _steps(raw: Any) -> list:
    if type(raw) is not list or len(raw) > MAX_STEPS:
        raise _invalid("steps", raw, f"a list of at most {MAX_STEPS} steps")
    out = []
    for i, s in enumerate(raw):
        try:
            out.append(from_fields(Step, s))
        except SchemaError as exc:  # name the step: "steps[3].reward: got nan ..."
            raise type(exc)(f"steps[{i}].{exc}") from None
    return out


def from_dict(d: Any) -> Task | Step | Trajectory:
    """Inverse of to_dict; raises SchemaError subclasses on anything unexpected."""
    if not isinstance(d, dict):
        raise MalformedMessage(f"expected a map, got {type(d).__name__}")
    version = d.get("v")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise UnknownSchemaVersion(f"schema version {version!r}; this build reads {sorted(READABLE_VERSIONS)}")
    kind = d.get("type")
    cls = _TYPES.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise MalformedMessage(f"unknown message type {kind!r}")
    d = {k: v for k, v in d.items() if k not in ("v", "type")}
    try:
        if cls is Trajectory:
            d["steps"] = _steps(d.get("steps", []))
            d["env_kind"] = EnvKind(d.get("env_kind", "synthetic"))
            d["status"] = Status(d.get("status", "failure"))
            if d.get("task") is not None:
                try:
                    d["task"] = from_fields(Task, d["task"])
                except SchemaError as exc:
                    raise type(exc)(f"task.{exc}") from None
        return from_fields(cls, d)
    except SchemaError:
        raise
    except (TypeError, ValueError, AttributeError, ArithmeticError) as exc:
        raise MalformedMessage(f"{kind}: {exc}") from exc


def encode(obj: Task | Step | Trajectory) -> bytes:
    return msgpack.packb(to_dict(obj), use_bin_type=True)


def decode(data: bytes) -> Task | Step | Trajectory:
    """Decode and validate bytes from the wire; SchemaError on corrupt bytes, a foreign
    version, or any field that breaks the schema's types, finiteness or bounds."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise InvalidField(f"message of {len(data)} bytes; the bound is {MAX_MESSAGE_BYTES}")
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise MalformedMessage(f"not msgpack: {exc}") from exc
    return from_dict(d)


def decode_as(data: bytes, cls: type) -> Any:
    obj = decode(data)
    if not isinstance(obj, cls):
        raise MalformedMessage(f"expected {cls.KIND}, got {type(obj).KIND}")  # type: ignore[attr-defined]
    return obj
