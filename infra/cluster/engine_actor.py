"""Inference engines as Ray actors: an SGLang server on a labelled GPU node, or the embedded engine.

Thin wrappers only. `SGLangEngineActor` runs `infra.sglang_launcher.SGLangLauncher`
(start, wait for /health, restart on death) on the node that advertises the
configured resource label; `EmbeddedEngineActor` runs `start_embedded_engine` on the
actor's own event loop. Both answer `url()`, which is what `EngineClient` needs:
the engines are reached over HTTP, never through Ray calls, so the same client code
works with engines started by hand.
"""

from __future__ import annotations

from typing import Any

import ray

from infra.config import EngineConfig


def _node_host() -> str:
    return ray.util.get_node_ip_address()


@ray.remote(max_restarts=0)
class SGLangEngineActor:
    """One supervised SGLang server on this actor's node (guarded: fails clearly without sglang)."""

    def __init__(self, engine_cfg: dict, model_path: str | None = None, port: int | None = None):
        from infra.sglang_launcher import SGLangLauncher

        self.launcher = SGLangLauncher(EngineConfig(**engine_cfg), model_path, port, host="0.0.0.0",
                                       advertise_host=_node_host())

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

    def __init__(self, engine_cfg: dict, model: str | None = None, host: str = "0.0.0.0"):
        self.cfg = EngineConfig(**engine_cfg)
        self.model = model or self.cfg.model
        self.host = host
        self.handle = None

    async def start(self) -> str:
        from infra.engine_server import start_embedded_engine

        if self.handle is None:
            self.handle = await start_embedded_engine(self.model, self.host, 0, self.cfg.max_batch_size, self.cfg.dtype,
                                                      default_max_new_tokens=self.cfg.max_new_tokens,
                                                      device=self.cfg.device)
        return await self.url()

    async def url(self) -> str:
        port = self.handle.url.rsplit(":", 1)[1]
        host = _node_host() if self.host == "0.0.0.0" else self.host
        return f"http://{host}:{port}"

    async def stop(self) -> None:
        if self.handle is not None:
            await self.handle.stop()
            self.handle = None


def sglang_actor_options(cfg: EngineConfig, cluster_resources: dict[str, float] | None = None) -> dict[str, Any]:
    """Placement for an SGLang actor: the configured node label (when the cluster has it) and tp_size GPUs."""
    opts: dict[str, Any] = {"num_gpus": cfg.sglang_tp_size, "num_cpus": 1}
    label = cfg.sglang_resource
    if label and (cluster_resources is None or cluster_resources.get(label, 0) > 0):
        opts["resources"] = {label: 1}
    return opts


def start_sglang_engine(cfg: EngineConfig, model_path: str | None = None, port: int | None = None,
                        cluster_resources: dict[str, float] | None = None) -> tuple[Any, str]:
    """Place an SGLangEngineActor by label, start its server; returns (actor, url)."""
    from dataclasses import asdict

    actor = SGLangEngineActor.options(**sglang_actor_options(cfg, cluster_resources)).remote(asdict(cfg), model_path, port)
    return actor, ray.get(actor.start.remote())


def start_embedded_engine_actor(cfg: EngineConfig, model: str | None = None, num_cpus: float = 1.0,
                                resources: dict[str, float] | None = None) -> tuple[Any, str]:
    """Start an EmbeddedEngineActor; returns (actor, url)."""
    from dataclasses import asdict

    opts: dict[str, Any] = {"num_cpus": num_cpus}
    if resources:
        opts["resources"] = resources
    actor = EmbeddedEngineActor.options(**opts).remote(asdict(cfg), model)
    return actor, ray.get(actor.start.remote())
