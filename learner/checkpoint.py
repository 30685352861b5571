"""Resumable learner checkpoints.

Owns `<run_dir>/checkpoints/step_<NNNNNN>/state.pt`: the trainable weights (the LoRA
adapter and value head only, under LoRA), the optimizer, the Python / NumPy / torch
RNG states, the weight version and update count, the stream position (last acked
entry id and recently consumed trajectory ids, for dedupe after a restart; the ids
trained into these weights, the lineage) and an
`extra` dict any component may fill (the curriculum's state, say). Writes are
atomic: a temporary directory renamed into place, so a crash mid-save leaves the
previous checkpoint as `latest`. Only the last `keep` checkpoints stay.

torch.save/torch.load are used on local files the learner itself wrote; nothing
here crosses a process boundary (that is msgpack's job, infra/schema.py). With FSDP
ranks (learner/fsdp.py) rank 0 writes the gathered full state in this same format, and
every rank reads the file back on resume, so a checkpoint resumes with any `learner.num_gpus`.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint is missing or unreadable."""


@dataclass
class TrainState:
    """Everything besides tensors that a resumed learner needs."""

    weight_version: int = 0
    updates: int = 0
    last_entry_id: str = ""
    consumed_ids: list = field(default_factory=list)  # the dedupe memory: trained or set aside
    extra: dict = field(default_factory=dict)
    lineage: list = field(default_factory=list)  # trajectory ids trained into these weights (last 50k)
    trained: int = 0  # trajectories trained into these weights, over every segment of the run


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    d = checkpoints_dir(run_dir)
    if not d.exists():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).exists()]
    return [p for _, p in sorted(found)]


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only parameters that train (plus any value head): small under LoRA."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k in names}


def save(run_dir: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
         state: TrainState, keep: int = 2, tensors: tuple[dict, dict | None] | None = None) -> Path:
    """Write checkpoint `step_<updates>` atomically and prune old ones; returns its directory.
    `tensors`: (trainable weights, optimizer state dict) already gathered, instead of `model`'s and
    `optimizer`'s (the FSDP ranks' full state, learner/fsdp.py)."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.updates:06d}"
    tmp = root / f".{final.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    payload = {
        "model": tensors[0] if tensors is not None else trainable_state_dict(model),
        "optimizer": tensors[1] if tensors is not None else optimizer.state_dict() if optimizer is not None else None,
        "rng": rng_state(),
        "train_state": {"weight_version": state.weight_version, "updates": state.updates,
                        "last_entry_id": state.last_entry_id, "consumed_ids": list(state.consumed_ids),
                        "extra": state.extra, "lineage": list(state.lineage),
                        "trained": state.trained},
    }
    torch.save(payload, tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read(path: str | Path) -> dict[str, Any]:
    """The saved payload of a checkpoint directory (tensors on the CPU); CheckpointError if unreadable."""
    f = Path(path) / STATE_FILE
    if not f.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        return torch.load(f, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises many types for a truncated/corrupt file
        raise CheckpointError(f"cannot read {f}: {exc}") from exc


def train_state(payload: dict[str, Any]) -> TrainState:
    ts = payload["train_state"]
    lineage = list(ts.get("lineage", []))
    return TrainState(ts["weight_version"], ts["updates"], ts.get("last_entry_id", ""),
                      list(ts.get("consumed_ids", [])), dict(ts.get("extra", {})), lineage,
                      ts.get("trained", len(lineage)))  # older checkpoints: the (bounded) lineage


def load(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         restore_rng: bool = True) -> TrainState:
    """Restore model (and optimizer, RNG) from a checkpoint directory; returns its TrainState."""
    payload = read(path)
    missing, unexpected = model.load_state_dict(payload["model"], strict=False)
    if unexpected:
        raise CheckpointError(f"checkpoint {path} has parameters this model lacks: {unexpected[:5]}")
    if optimizer is not None and payload.get("optimizer") is not None:
        optimizer.load_state_dict(payload["optimizer"])
    if restore_rng:
        set_rng_state(payload["rng"])
    return train_state(payload)
