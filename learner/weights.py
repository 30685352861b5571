"""Publishing versioned policy weights to the policy engines.

Owns the weights directory of a run: version N lives in `<run_dir>/weights/v<N>`
(written atomically: a temporary directory renamed into place), the engines are told
with `EngineClient.update_weights_from_disk(path, N)`, and only the last `keep`
versions stay on disk (an engine may still be loading the previous one). With a
shared `root` (`infra.weights_dir`) the versions live in `<root>/<run name>/` and
`<run_dir>/weights` is a link to it, so every path below works the same; the
engines are given the resolved path. Versions are safetensors in `dtype`
(`learner.publish_dtype`: the engines' precision by default).
`resolve_model` turns a run directory into the policy it evaluated, so any run's
policy can be evaluated or served (`dreamgym eval --checkpoint runs/<name>`): its
latest published version, or, for a run that published none (the base and SFT
regimes, `learner.total_updates=0`), the policy it started from, which
`record_start` names in `<run_dir>/policy.json` (the warm start sits in a cache under
`infra.data_dir`, the base model is a name).
With a `sync` (`learner.weight_sync=distributed`, learner/weight_sync.py) versions travel
over a process group instead and nothing is written per version; the last one is saved
here when training ends (`keep_final`), so `resolve_model` still finds the run's policy;
until then `weights/synced.json` names the version the engines serve, and `resolve_model`
refuses such a run (ended before its final save) rather than fall back to its start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Protocol

from infra import metrics

log = logging.getLogger(__name__)
_VERSION_DIR = re.compile(r"^v(\d+)$")
START_POLICY = "policy.json"  # in a run directory: {"start": the model the run started from}
SYNCED = "synced.json"  # in a run's weights/: {"version": N} sent over a process group, not written here


class WeightSink(Protocol):
    """What a publisher needs from the engines: SGLang's `/update_weights_from_disk` call (EngineClient)."""

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None: ...

    async def catch_up(self) -> list[str]: ...


def weights_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "weights"


def version_path(run_dir: str | Path, version: int) -> Path:
    return weights_dir(run_dir) / f"v{version}"


def published_versions(run_dir: str | Path) -> list[int]:
    d = weights_dir(run_dir)
    if not d.exists():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if p.is_dir() and (m := _VERSION_DIR.match(p.name)))


def latest_published(run_dir: str | Path) -> tuple[Path, int] | None:
    """The last weights published under run_dir (their directory, their version); None before the first."""
    versions = published_versions(run_dir)
    return (version_path(run_dir, versions[-1]), versions[-1]) if versions else None


def resolve_model(path: str | Path) -> str:
    """A model directory an engine can serve, from any of: a model name ('smollm2'), a Hugging Face
    directory, a run directory (its latest published version, else the policy it started from and so
    evaluated: its policy.json) or a run's `weights/` directory."""
    p = Path(path)
    if not p.exists():
        if "/" in str(path) or p.suffix:
            raise FileNotFoundError(f"{path}: no such model or run directory")
        return str(path)  # a model name the loader knows
    if (p / "config.json").exists():
        return str(p)
    run_dir = p.parent if p.name == "weights" else p
    versions = published_versions(run_dir)
    if versions:
        return str(version_path(run_dir, versions[-1]))
    if (weights_dir(run_dir) / SYNCED).is_file():
        synced = json.loads((weights_dir(run_dir) / SYNCED).read_text())["version"]
        raise FileNotFoundError(f"{path}: sent weights up to v{synced} over a process group (learner.weight_sync="
                                f"distributed) and ended before saving the last one; its checkpoints hold them")
    if (run_dir / START_POLICY).is_file():  # no update published: the run evaluated the policy it started from
        start = str(json.loads((run_dir / START_POLICY).read_text())["start"])
        if "/" in start and not Path(start).exists():
            raise FileNotFoundError(f"{path}: published no weights, and the policy it started from and evaluated, "
                                    f"{start}, is gone (a cache under infra.data_dir?)")
        if Path(start).resolve() == run_dir.resolve():
            raise FileNotFoundError(f"{path}: its {START_POLICY} names the run itself")
        return resolve_model(start)
    raise FileNotFoundError(f"{path}: neither a model directory (no config.json) nor a run with published "
                            f"weights (no {weights_dir(run_dir)}/v<N>) or a {START_POLICY}")


def record_start(run_dir: str | Path, model: str) -> Path:
    """Name in `<run_dir>/policy.json` the policy a run starts from (a model name, or a directory made
    absolute), so `resolve_model(run_dir)` finds it when the run publishes no weights."""
    ref = str(Path(model).resolve()) if Path(model).exists() else model
    out = Path(run_dir) / START_POLICY
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"start": ref}) + "\n")
    return out


def link_shared_dir(run_dir: Path, root: Path) -> Path:
    """Make `<run_dir>/weights` a link to `<root>/<run name>` (created); returns the shared directory.
    A run directory that already holds its own weights (not a link) is an error, not overwritten."""
    shared = (root / run_dir.name).resolve()
    shared.mkdir(parents=True, exist_ok=True)
    link = weights_dir(run_dir)
    if link.is_symlink():
        if link.resolve() == shared:
            return shared
        link.unlink()
    elif link.exists():
        raise FileExistsError(f"{link} holds this run's earlier weights; move them to {shared} or leave "
                              "infra.weights_dir empty")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(shared, target_is_directory=True)
    return shared


class WeightPublisher:
    """Saves a PolicyModel as version N and points the engines at it."""

    def __init__(self, run_dir: str | Path, client: WeightSink | None = None, keep: int = 2, *,
                 dtype: str = "float32", root: str | Path = "", sync: Any = None):
        self.run_dir, self.client, self.keep, self.dtype = Path(run_dir), client, max(1, keep), dtype
        self.sync = sync  # a DistributedSync: versions go over its process group, not through this directory
        self.last_published: int | None = None
        if root:
            link_shared_dir(self.run_dir, Path(root))

    async def publish(self, policy: Any, version: int) -> Path:
        if self.sync is not None:
            await self.sync.send(policy, version)
            marker = weights_dir(self.run_dir) / SYNCED
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"version": version}) + "\n")
            self.last_published = version
            metrics.LEARNER_WEIGHT_VERSION.set(version)
            log.info("published weights v%d over the weight-update group", version)
            return version_path(self.run_dir, version)  # not written: keep_final writes the last one
        path = version_path(self.run_dir, version)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Serialising 0.5 GB blocks; keep the event loop (stream heartbeats) responsive.
        await asyncio.to_thread(policy.save_hf, path, dtype=self.dtype)
        if self.client is not None:
            await self.client.update_weights_from_disk(str(path.resolve()), version)
        self.last_published = version
        metrics.LEARNER_WEIGHT_VERSION.set(version)
        self._prune()
        log.info("published weights v%d at %s", version, path)
        return path

    async def catch_up(self) -> list[str]:
        """Bring every engine that serves an older version than the last published one up to it (an engine
        restarted by its supervisor serves the model it was started with); the URLs pushed to. Nothing to
        do over a weight-update group (its engines cannot fall behind that way) or before a first publish."""
        if self.sync is not None or self.client is None or self.last_published is None:
            return []
        return await self.client.catch_up()

    async def keep_final(self, policy: Any, version: int) -> None:
        """End of training with a `sync`: write the last version here (the engines already serve it)."""
        if self.sync is None or version in published_versions(self.run_dir):
            return
        path = version_path(self.run_dir, version)
        path.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(policy.save_hf, path, dtype=self.dtype)
        self._prune()

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()

    def _prune(self) -> None:
        for v in published_versions(self.run_dir)[:-self.keep]:
            shutil.rmtree(version_path(self.run_dir, v), ignore_errors=True)
