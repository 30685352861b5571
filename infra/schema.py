"""The wire schema: every message that crosses a process boundary (Task, Step, Trajectory).

One versioned module, msgpack only, never pickle. A message is a msgpack map
`{"v": SCHEMA_VERSION, "type": <kind>, ...fields}`; field names are the dataclass
field names below and stay stable within a schema version. Decoding checks the
version first and raises a typed error (`MalformedMessage`, `UnknownSchemaVersion`)
that the stream consumer turns into a dead letter.

Per-token data: a Step carries the token ids of the policy's action and their
behaviour log-probs, plus a loss mask (1 = trained). In DreamGym's default
"choice" action mode the policy picks one labelled candidate with a single token
and `choice_token_ids` lists the label tokens the distribution was renormalised
over, so the learner recomputes exactly the same log-prob (see actors/policy.py).
"""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

SCHEMA_VERSION = 1


class SchemaError(ValueError):
    """Base class for messages that cannot be decoded."""


class MalformedMessage(SchemaError):
    """The bytes are not a msgpack map of the expected shape."""


class UnknownSchemaVersion(SchemaError):
    """The message was written by an incompatible schema version."""


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
    reasoning_source: str = ""  # "mexp", "env-facts", "env-dom-diff", "teacher"
    valid: bool = True  # the action was admissible/parseable
    policy_prompt: str = ""  # exact text the policy was conditioned on
    action_token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # behaviour log-prob per action token
    loss_mask: list = field(default_factory=list)  # 1 where the token is trained
    choice_token_ids: list = field(default_factory=list)  # label tokens renormalised over (choice mode)
    value: float = 0.0  # PPO value estimate at this state, if the worker computed one


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
    timings: dict = field(default_factory=dict)  # seconds: "policy", "env", "total"
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


def _from_fields(cls: type, d: dict) -> Any:
    if not isinstance(d, dict):
        raise MalformedMessage(f"{cls.KIND}: expected a map, got {type(d).__name__}")
    if d.keys() == _FIELD_NAMES[cls]:
        # Fast path for exactly our fields: skip __init__ (4-5 us per Step), since msgpack
        # handed us a fresh dict we can own.
        obj = cls.__new__(cls)
        obj.__dict__ = d
        return obj
    try:  # extra keys (written by a newer minor revision) are ignored; missing required ones are not
        return cls(**{k: v for k, v in d.items() if k in _FIELD_NAMES[cls]})
    except TypeError as exc:
        raise MalformedMessage(f"{cls.KIND}: {exc}") from exc


def from_dict(d: Any) -> Task | Step | Trajectory:
    """Inverse of to_dict; raises SchemaError subclasses on anything unexpected."""
    if not isinstance(d, dict):
        raise MalformedMessage(f"expected a map, got {type(d).__name__}")
    version = d.get("v")
    if version != SCHEMA_VERSION:
        raise UnknownSchemaVersion(f"schema version {version!r}; this build reads {SCHEMA_VERSION}")
    kind = d.get("type")
    cls = _TYPES.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise MalformedMessage(f"unknown message type {kind!r}")
    d = {k: v for k, v in d.items() if k not in ("v", "type")}
    try:
        if cls is Trajectory:
            d["steps"] = [_from_fields(Step, s) for s in d.get("steps", [])]
            d["env_kind"] = EnvKind(d.get("env_kind", "synthetic"))
            d["status"] = Status(d.get("status", "failure"))
            if d.get("task") is not None:
                d["task"] = _from_fields(Task, d["task"])
        return _from_fields(cls, d)
    except SchemaError:
        raise
    except (TypeError, ValueError, AttributeError) as exc:
        raise MalformedMessage(f"{kind}: {exc}") from exc


def encode(obj: Task | Step | Trajectory) -> bytes:
    return msgpack.packb(to_dict(obj), use_bin_type=True)


def decode(data: bytes) -> Task | Step | Trajectory:
    """Decode bytes from the wire; SchemaError on corrupt bytes or a foreign version."""
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
