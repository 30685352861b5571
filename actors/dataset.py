"""Offline datasets on disk: trajectory files and task splits.

Owns the two file formats the rest of DreamGym reads offline data through:

- a trajectory file: schema-encoded `Trajectory` messages (infra/schema.py)
  written back to back, which is itself a valid msgpack stream; `read_trajectories`
  streams them and raises `SchemaError` on a corrupt or foreign record rather than
  skipping it silently. Default place: `<data_dir>/offline/<family>/trajectories.msgpack`.
- task splits: `TaskSplits(train, heldout)` as JSON (`<data_dir>/<family>/splits.json`),
  each task in the wire schema's field names.

Both are stamped (`<file>.key.json`) with the content key of the settings that made
them (`splits_settings`, `offline_settings`): a reader whose settings differ rebuilds
them rather than silently reusing data made with other settings. Artifacts built on
them (the Mexp SFT checkpoint, the policy warm start) fold the offline key into their own.

Writes go to a temporary file renamed into place, so a crash never leaves half a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgpack

from infra.config import section_settings, settings_key
from infra.schema import MalformedMessage, SchemaError, Task, Trajectory, encode, from_dict, from_fields

__all__ = ["TaskSplits", "write_trajectories", "read_trajectories", "trajectories_path", "splits_path", "SchemaError",
           "splits_settings", "offline_settings", "write_stamp", "stamp_matches"]

# The `data` fields that shape a family's task splits (besides the seed).
_SPLIT_PREFIXES = {"textworld": ("textworld_",), "miniwob": ("miniwob_",), "alfworld": ("alfworld_",),
                   "browsergym": ("browsergym_",)}
# The version of each family's state rendering: bump it when an environment renders states or rationales
# differently, so cached splits (their initial states) and trajectories are rebuilt.
# textworld 3: a "To do" line (the win condition's missing facts), each item checked in the rationale.
_STATE_FORMAT = {"textworld": 3}
# ... and the collection itself.
_COLLECT_FIELDS = ("policies", "episodes_per_task", "noise_eps", "max_steps", "teacher_endpoint", "teacher_model")


def splits_settings(kind: str, data_cfg, seed: int) -> dict:
    """What shapes the task splits of `kind` (a canonical family: textworld, miniwob, alfworld, browsergym)."""
    return {"family": kind, "seed": seed, "state_format": _STATE_FORMAT.get(kind, 1),
            **section_settings(data_cfg, prefixes=_SPLIT_PREFIXES.get(kind, ("env_",)))}  # env_: a plug-in's


def offline_settings(kind: str, data_cfg, seed: int) -> dict:
    """What shapes the offline trajectories: the splits they were collected on and how they were collected."""
    return {"splits": settings_key(splits_settings(kind, data_cfg, seed)), **section_settings(data_cfg, _COLLECT_FIELDS)}


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".key.json")


def write_stamp(path: str | Path, settings: dict) -> None:
    """Record next to `path` the key (and the settings) it was made with."""
    doc = {"key": settings_key(settings), "settings": settings}
    _atomic_write(_stamp_path(Path(path)), json.dumps(doc, indent=1, default=str).encode())


def stamp_matches(path: str | Path, settings: dict) -> bool:
    """True when `path` exists and was made with these settings (an unstamped file is not trusted)."""
    path, stamp = Path(path), _stamp_path(Path(path))
    if not path.exists() or not stamp.exists():
        return False
    try:
        return json.loads(stamp.read_text()).get("key") == settings_key(settings)
    except (json.JSONDecodeError, AttributeError):
        return False


def trajectories_path(data_dir: str | Path, family: str) -> Path:
    return Path(data_dir) / "offline" / family / "trajectories.msgpack"


def splits_path(data_dir: str | Path, family: str) -> Path:
    return Path(data_dir) / family / "splits.json"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def write_trajectories(path: str | Path, trajectories: Iterable[Trajectory], append: bool = False) -> int:
    """Write (or append) trajectories; returns how many were written."""
    path = Path(path)
    blobs = []
    for t in trajectories:
        if not isinstance(t, Trajectory):
            raise TypeError(f"expected Trajectory, got {type(t).__name__}")
        blobs.append(encode(t))
    if append:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as fh:
            fh.write(b"".join(blobs))
    else:
        _atomic_write(path, b"".join(blobs))
    return len(blobs)


def read_trajectories(path: str | Path) -> Iterator[Trajectory]:
    """Stream the trajectories of a file; SchemaError on any record that is not a Trajectory."""
    with open(path, "rb") as fh:
        unpacker = msgpack.Unpacker(fh, raw=False, strict_map_key=True, max_buffer_size=256 * 1024 * 1024)
        n = 0
        while True:
            try:
                d = unpacker.unpack()
            except msgpack.OutOfData:
                # A truncated final record leaves unread bytes in the buffer.
                if unpacker.tell() != os.fstat(fh.fileno()).st_size:
                    raise MalformedMessage(f"{path}: truncated record after {n} trajectories") from None
                return
            except Exception as exc:  # msgpack raises several unrelated types on garbage
                raise MalformedMessage(f"{path}: record {n} is not msgpack: {exc}") from exc
            obj = from_dict(d)
            if not isinstance(obj, Trajectory):
                raise MalformedMessage(f"{path}: record {n} is a {type(obj).KIND}, not a trajectory")
            n += 1
            yield obj


@dataclass
class TaskSplits:
    train: list = field(default_factory=list)  # list[Task]
    heldout: list = field(default_factory=list)  # list[Task]

    def save(self, path: str | Path) -> None:
        doc = {"train": [asdict(t) for t in self.train], "heldout": [asdict(t) for t in self.heldout]}
        _atomic_write(Path(path), json.dumps(doc, indent=1).encode())

    @classmethod
    def load(cls, path: str | Path) -> "TaskSplits":
        try:
            doc = json.loads(Path(path).read_text())
            return cls(train=[from_fields(Task, d) for d in doc["train"]],
                       heldout=[from_fields(Task, d) for d in doc["heldout"]])
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise MalformedMessage(f"{path}: not a task-splits file: {exc}") from exc
