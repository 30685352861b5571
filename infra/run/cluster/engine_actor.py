"""Inference engines as Ray actors: an SGLang server on a labelled GPU node, or the embedded engine.

Thin wrappers, and `EngineSupervisor`, which starts a dead embedded engine actor again on its port. `SGLangEngineActor` runs `infra.engine.sglang.SGLangLauncher`
(start, wait for /health, restart on death) on the node that advertises its role's
label (`dreamgym train` with `engines.launch: sglang` and `actors.runtime: ray`); `EmbeddedEngineActor` runs `start_embedded_engine` on the
actor's own event loop. Both answer `url()`, which is what `EngineClient` needs:
the engines are reached over HTTP, never through Ray calls, so the same client code
works with engines started by hand. Both bind `engines.host` (loopback unless set,
e.g. to 0.0.0.0 when workers on other nodes must reach them) and require
`engines.api_key` when it is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import ray

from infra.config import EngineConfig
from infra.engine.server import start_embedded_engine
from infra.engine.sglang import SGLangLauncher
from infra.run.cluster.runtime import placement_options
from learner.weights import latest_published

log = logging.getLogger(__name__)


def _advertised(bound: str) -> str:
    """The address clients use: the node's IP when bound to every interface, else the bound one."""
    return ray.util.get_node_ip_address() if bound in ("0.0.0.0", "::") else bound


@ray.remote(max_restarts=0)
class SGLangEngineActor:
    """One supervised SGLang server on this actor's node (guarded: fails clearly without sglang)."""

    def __init__(self, engine_cfg: dict, model_path: str | None = None, port: int | None = None):
        cfg = EngineConfig(**engine_cfg)
        self.launcher = SGLangLauncher(cfg, model_path, port, host=cfg.host, advertise_host=_advertised(cfg.host))

    def start(self) -> str:
        return self.launcher.start(supervise=True)

    def url(self) -> str:
        return self.launcher.url

    def restarts(self) -> int:
        return self.launcher.supervisor.restarts

    def stop(self) -> None:
        self.launcher.stop()


@ray.remote(max_restarts=0)
class EmbeddedEngineActor:
    """The embedded engine (transformers, continuous batching) served from inside an async actor."""

    def __init__(self, engine_cfg: dict, model: str | None = None, host: str | None = None,
                 weights_roots: list[str] | None = None, port: int = 0, weight_version: int = 0):
        self.cfg = EngineConfig(**engine_cfg)
        self.model, self.weight_version = model or self.cfg.model, weight_version
        self.host = host or self.cfg.host
        self.weights_roots = weights_roots
        self.port = port  # 0: a free one; a replacement binds its predecessor's, so clients keep their URL
        self.handle = None

    async def start(self) -> str:
        if self.handle is None:
            self.handle = await start_embedded_engine(self.model, self.host, self.port, self.cfg.max_batch_size,
                                                      self.cfg.dtype,
                                                      default_max_new_tokens=self.cfg.max_new_tokens,
                                                      device=self.cfg.device, engine_cfg=self.cfg,
                                                      weights_roots=self.weights_roots,
                                                      weight_version=self.weight_version)
        return await self.url()

    async def url(self) -> str:
        port = self.handle.url.rsplit(":", 1)[1]
        return f"http://{_advertised(self.host)}:{port}"

    async def stop(self) -> None:
        if self.handle is not None:
            await self.handle.stop()
            self.handle = None


def sglang_actor_options(cfg: EngineConfig, role: str, cluster_resources: dict[str, float] | None = None) -> dict[str, Any]:
    """Placement for the SGLang server of `role`: the role's node label (`mexp_gpu`, `policy_gpu`) when
    the cluster has it, and `engines.sglang_tp_size` GPUs."""
    return {**placement_options(role, cluster_resources, num_cpus=1), "num_gpus": cfg.sglang_tp_size}


def start_sglang_engine(cfg: EngineConfig, role: str, model_path: str | None = None, port: int | None = None,
                        cluster_resources: dict[str, float] | None = None) -> tuple[Any, str]:
    """Place the SGLangEngineActor of `role` by label, start its server (supervised); returns (actor, url)."""
    opts = sglang_actor_options(cfg, role, cluster_resources)
    actor = SGLangEngineActor.options(**opts).remote(asdict(cfg), model_path, port)
    return actor, ray.get(actor.start.remote())


def start_role_engine(cfg: EngineConfig, role: str, model: str, cluster_resources: dict[str, float],
                      weights_roots: list[str] | None = None, port: int = 0, weight_version: int = 0
                      ) -> tuple[Any, str]:
    """`dreamgym train`'s embedded engine for `role` ('mexp' or 'policy') as an actor on the node with
    that role's label (`mexp_gpu`, `policy_gpu`) when the cluster has one; one GPU when `engines.device`
    is CUDA (Ray hides the GPUs from an actor that asks for none). `weight_version`: what it reports
    serving `model` (a replacement serving published weights). Returns (actor, url)."""
    opts = placement_options(role, cluster_resources, num_cpus=0.5)
    if cfg.device.startswith("cuda"):
        opts["num_gpus"] = 1
    actor = EmbeddedEngineActor.options(**opts).remote(asdict(cfg), model, None, weights_roots, port, weight_version)
    try:
        return actor, ray.get(actor.start.remote())
    except BaseException:  # an actor that could not serve would hold its CPUs (and GPU) for nothing
        ray.kill(actor)
        raise


class EngineSupervisor:
    """The driver's keeper of one embedded engine actor: every `poll_s` it asks the actor for its URL,
    and when the actor's process is gone (kill -9, OOM) it starts a replacement on the same port with
    `start(port, model, weight_version)` (start_role_engine's other arguments bound; model None: the one
    the engine was started with), so every EngineClient keeps its URL: they mark the server dead on the
    failed requests and take it back when its /health answers. Given the run directory (`run_dir`, the
    policy's engine), the replacement serves the last weights published there, so its first episodes are
    not too stale to train (issue 63's soak: a replacement serving version 0 when the learner was at
    1,850 made every episode stale, and no update followed); the learner also pushes the published
    weights to any engine behind them when stale trajectories arrive (learner/learner.py).
    `run()` until `aclose()`; `stop()` stops the current actor."""

    def __init__(self, start: Callable[[int, str | None, int], tuple[Any, str]], actor: Any, url: str,
                 poll_s: float = 2.0, run_dir: str | Path | None = None):
        self.start, self.actor, self.url, self.poll_s = start, actor, url, poll_s
        self.run_dir = run_dir
        self.restarts = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def watch(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self.actor.url.remote(), 30)
            except ray.exceptions.RayActorError:
                port = int(self.url.rsplit(":", 1)[1])
                log.warning("the engine actor at %s died; starting a replacement on port %d", self.url, port)
                try:
                    self.actor, _ = await asyncio.to_thread(self._replacement, port)
                    self.restarts += 1
                except Exception:  # the port is still held, or the node is full: try again at the next poll
                    log.exception("replacing the engine actor at %s failed", self.url)
            except asyncio.TimeoutError:  # busy (a long generation on a loaded node): alive
                pass
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.poll_s)

    def _replacement(self, port: int) -> tuple[Any, str]:
        latest = latest_published(self.run_dir) if self.run_dir is not None else None
        if latest is None:
            return self.start(port, None, 0)
        path, version = latest
        log.warning("the replacement on port %d serves the published weights v%d (%s)", port, version, path)
        try:
            return self.start(port, str(path.resolve()), version)
        except Exception:  # pruned while it loaded (learner.keep_weights): the learner's catch-up brings them
            log.exception("the replacement could not load v%d; it serves the model it was started with", version)
            return self.start(port, None, 0)

    async def aclose(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    def stop(self) -> None:
        stop_engine_actor(self.actor)


def stop_engine_actor(actor: Any, timeout_s: float = 30.0) -> None:
    """Stop the server, then the actor (a dead one is simply gone, and so is every actor of a job whose Ray is down)."""
    if not ray.is_initialized():
        return
    try:
        ray.get(actor.stop.remote(), timeout=timeout_s)
    except Exception as exc:  # already dead or hung: killing it is all that is left
        log.warning("stopping an engine actor: %s", exc)
    ray.kill(actor)


def start_embedded_engine_actor(cfg: EngineConfig, model: str | None = None, num_cpus: float = 1.0,
                                resources: dict[str, float] | None = None,
                                weights_roots: list[str] | None = None) -> tuple[Any, str]:
    """Start an EmbeddedEngineActor bound to `cfg.host`; returns (actor, url)."""
    opts: dict[str, Any] = {"num_cpus": num_cpus}
    if resources:
        opts["resources"] = resources
    actor = EmbeddedEngineActor.options(**opts).remote(asdict(cfg), model, None, weights_roots)
    return actor, ray.get(actor.start.remote())
