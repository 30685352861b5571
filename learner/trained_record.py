"""Which trajectories entered which update: the learner's append-only record.

Owns `<run_dir>/trained.jsonl`, one line per applied update, `{"version": v, "t": unix
seconds, "ids": [trajectory ids]}`, appended and flushed as soon as the update is applied
(before its checkpoint, so a process killed right after still leaves it). A learner killed
before the checkpoint that covers update v resumes from an older one and applies a version v
again: the later line for a version is the one in the weights, and lines past the final
version come from a segment whose work was lost with it. `lineage(path, final_version)`
rebuilds the final weights' trajectories from that rule, repeats included: the checkpoint's
own lineage (learner/checkpoint.py) is a bounded set, so it cannot show a trajectory trained
into the weights twice. benchmarks/chaos.py counts trained-once and trained-twice from it.

The record costs one short line per update and is never read by the learner itself.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)

TRAINED_FILE = "trained.jsonl"


class TrainedRecord:
    """Appends `(version, trajectory ids)` for each applied update to `<run_dir>/trained.jsonl`."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / TRAINED_FILE

    def append(self, version: int, trajectory_ids: Iterable[str]) -> None:
        line = json.dumps({"version": version, "t": round(time.time(), 3), "ids": list(trajectory_ids)})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:  # one write per line: a kill leaves whole lines, or a torn last one
                f.write(line + "\n")
        except OSError as exc:  # a full disk must not stop training: the record is for audits
            log.warning("could not append to %s: %s", self.path, exc)


def read(path: str | Path) -> list[dict]:
    """Every whole line of a record, in the order written (a torn last line is skipped)."""
    rows = []
    try:
        text = Path(path).read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("version"), int) and isinstance(row.get("ids"), list):
            rows.append(row)
    return rows


def lineage(path: str | Path, final_version: int) -> dict[int, list[str]]:
    """The final weights' updates: version -> the trajectory ids of the last line written for it,
    for versions 1..final_version (a version with no line is missing from the result)."""
    last: dict[int, list[str]] = {}
    for row in read(path):
        if 1 <= row["version"] <= final_version:
            last[row["version"]] = [str(i) for i in row["ids"]]
    return last
