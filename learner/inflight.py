"""The learner's record of the update in flight: retrain once, then dead-letter.

Owns `<run_dir>/learner_inflight.json`, a small file written atomically (temporary
file, fsync, rename) around every update:

- `begin(update, entry_ids)` before the update touches the weights lists the stream
  entries it trains on; `end(...)` clears the list when the update is over, applied,
  skipped or failed in-process;
- a learner that starts and finds a non-empty list (`recover()`) was killed inside that
  update (kill -9, the OOM killer, a segfault in a kernel): each of those entries gets
  one strike. An update that fails in-process (an exception, a non-finite loss) gives
  its entries a strike as well;
- an entry with one strike is retrained once; an entry that gets a second strike goes to
  the dead-letter stream (learner/learner.py), so a message whose handling kills the
  learner costs two attempts, never a crash loop. Strikes are forgotten when the entry
  is acked or dead-lettered.

Entries trained in updates that completed but are not yet covered by a checkpoint are
never listed here: a kill costs them a retrain, not a strike. The granularity is the
update: an innocent entry that shares both failed updates with a poison one is
dead-lettered with it (the dead-letter stream keeps its bytes for replay).
The stream's own bound (`infra.max_deliveries`, infra/streams.py) still caps every
entry's deliveries whatever this file says, e.g. if the run directory is lost.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)

INFLIGHT_FILE = "learner_inflight.json"
STRIKES_TO_DEAD_LETTER = 2  # a first failure earns a retrain, the second a dead letter


def _s(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


class InflightLedger:
    """The in-flight update's entries and each suspect entry's strikes, durable in the run directory."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / INFLIGHT_FILE
        self.update = 0
        self.entries: list[str] = []
        self.strikes: dict[str, int] = {}
        if self.path.exists():
            try:
                d = json.loads(self.path.read_text())
                self.update, self.entries = int(d.get("update", 0)), [str(e) for e in d.get("entries", [])]
                self.strikes = {str(k): int(v) for k, v in d.get("strikes", {}).items()}
            except (OSError, ValueError) as exc:  # a torn file cannot happen (rename), a foreign one can
                log.warning("%s unreadable (%s); starting with no strikes", self.path, exc)

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"update": self.update, "entries": self.entries, "strikes": self.strikes}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def recover(self) -> list[str]:
        """At start: strike the entries of an update a previous process died in; returns them."""
        died_in = self.entries
        if died_in:
            for e in died_in:
                self.strikes[e] = self.strikes.get(e, 0) + 1
            log.warning("the previous learner died inside update %d: its %d entries get a strike (retrained once, "
                        "dead-lettered if it happens again)", self.update, len(died_in))
            self.entries = []
            self._write()
        return died_in

    def strikes_of(self, entry_id: bytes | str) -> int:
        return self.strikes.get(_s(entry_id), 0)

    def begin(self, update: int, entry_ids: Iterable[bytes | str]) -> None:
        self.update, self.entries = update, [_s(e) for e in entry_ids]
        self._write()

    def end(self, failed: bool = False) -> None:
        """The update is over; `failed`: it failed in-process, and its entries get a strike."""
        if failed:
            for e in self.entries:
                self.strikes[e] = self.strikes.get(e, 0) + 1
        self.entries = []
        self._write()

    def forget(self, entry_ids: Iterable[bytes | str]) -> None:
        """Entries acked or dead-lettered: their strikes no longer matter."""
        if not self.strikes:
            return
        n = len(self.strikes)
        for e in entry_ids:
            self.strikes.pop(_s(e), None)
        if len(self.strikes) != n:
            self._write()
