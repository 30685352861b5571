"""Prometheus file-based service discovery for one run: which processes serve /metrics now.

Owns `<run_dir>/monitoring/targets.json`, in Prometheus's `file_sd_configs` format
(a JSON list of `{"targets": ["host:port"], "labels": {...}}`), and its copy
`<runs>/_prometheus/<run>.json` beside every other run's: Prometheus accepts a `*` only
in the last path component of a file_sd path, so one scrape config discovers every run
through `runs/_prometheus/*.json` (infra/dashboards/prometheus.yml). The driver is the one
writer: it adds a target when a process starts serving (itself, an embedded engine,
a Ray rollout-worker, buffer or scheduler actor, Ray's own node exporter) and removes
it when the process stops, so elastic workers appear and disappear. Prometheus
re-reads the file on change; `dreamgym monitor RUN_DIR` prints it. Every write is a
whole new file moved into place (rename is atomic), so a reader never sees half a list.

Labels are bounded: `job` (driver, engine, rollout_worker, buffer, scheduler, ray),
`run` and `instance_name` (worker id, engine role); never a task id. A target with a
metrics path other than /metrics carries `__metrics_path__`.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from urllib.parse import urlsplit

TARGETS_FILE = "monitoring/targets.json"
DISCOVERY_DIR = "_prometheus"  # under the runs directory: one file per run, for the file_sd glob


def targets_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / TARGETS_FILE


def discovery_path(run_dir: str | Path) -> Path:
    """`<runs>/_prometheus/<run>.json`: where the shipped scrape config's glob finds a run's targets."""
    run_dir = Path(run_dir)
    return run_dir.parent / DISCOVERY_DIR / f"{run_dir.name}.json"


def address_of(url: str) -> tuple[str, str]:
    """(host:port, metrics path) of an http URL such as an engine's base URL."""
    parts = urlsplit(url)
    return parts.netloc.rpartition("@")[2], (parts.path.rstrip("/") or "") + "/metrics"


class Targets:
    """The run's live scrape targets, written through to `targets.json` on every change (thread-safe)."""

    def __init__(self, run_dir: str | Path, run: str):
        self.path, self.copy, self.run = targets_path(run_dir), discovery_path(run_dir), run
        self._items: dict[tuple[str, str], dict] = {}
        self._lock = threading.Lock()
        self._write()

    def add(self, job: str, name: str, address: str, metrics_path: str = "/metrics") -> None:
        """Record that `job`/`name` serves metrics at `address` (host:port)."""
        labels = {"job": job, "run": self.run, "instance_name": name}
        if metrics_path != "/metrics":
            labels["__metrics_path__"] = metrics_path
        with self._lock:
            self._items[(job, name)] = {"targets": [address], "labels": labels}
            self._write()

    def remove(self, job: str, name: str) -> None:
        with self._lock:
            if self._items.pop((job, name), None) is not None:
                self._write()

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._write()

    def __len__(self) -> int:
        return len(self._items)

    def _write(self) -> None:
        text = json.dumps(sorted(self._items.values(), key=lambda t: (t["labels"]["job"],
                                                                     t["labels"]["instance_name"])), indent=1)
        for path in (self.path, self.copy):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # not matched by the *.json glob
            tmp.write_text(text)
            os.replace(tmp, path)


def read_targets(run_dir: str | Path) -> list[dict]:
    """The targets a run lists now ([] when it wrote none)."""
    p = targets_path(run_dir)
    return json.loads(p.read_text()) if p.exists() else []
