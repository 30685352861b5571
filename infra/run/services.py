"""The services a run stands on, owned by one async context manager.

`async with Services(cfg, name) as svc:` makes the run directory (with the run's
redacted `config.yaml`), starts an embedded Redis unless `infra.redis_url` is set
(appendonly, in `<run_dir>/redis/`: kept for `resume=True`, emptied otherwise),
connects, and records the job in `<run_dir>/latest.json` for `dreamgym scale`,
`status` and `tasks` (the embedded Redis's password stays in a 0600 file in the run
directory that the record names; see infra/redis_server.py). Inside the block the driver opens the rest in the order of the
diagram: `open_buffer` (the replay buffer, seeded with the offline data or reopened
as a resumed run left it), `start_engines` (embedded engines for Mexp and the policy
unless endpoints are configured; clients for both) and `workers` (the rollout-worker
pool: on this event loop, or Ray actors with `actors.runtime=ray`). With `actors.runtime=ray`
the run joins (or starts) Ray once (`ray_resources`) and every role is an actor placed by
its label: the learner on the `learner_gpu` node (`learner_actor`), the embedded or SGLang
engines on `mexp_gpu`/`policy_gpu` nodes, the
curriculum scheduler on `scheduler_cpu` (else beside the driver, `curriculum_actor`), the
buffer actor on `buffer_cpu` (else on the driver's node: it reopens the store the driver
seeded), the workers on `rollout_cpu`; on a labelled cluster a missing label fails the run
before its first actor (`ray_resources`); `placements()` says where each ran. Each registers its
own cleanup when it opens, and leaving the block undoes them in reverse order whatever
happened inside: workers, the Ray fleet (which hands the store back), the replay
buffer (released, so a resumed run in this process reopens it), the engine clients
and embedded engines, the Redis client, the embedded Redis, and the run's monitoring
(infra/run/monitoring.py: with `infra.metrics_port` set, the driver's /metrics and
the file_sd targets of every process that serves one, kept current as each starts
and stops).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import ray

from infra.config import Config, dump, rl_seed
from infra.engine.client import EngineClient
from infra.engine.models import load_model, load_tokenizer
from infra.engine.server import EngineHandle, default_weights_roots, start_embedded_engine
from infra.engine.sglang import SGLangLauncher
from infra.redis_server import EmbeddedRedis, write_job_record
from infra.run.artifacts import embedding_cache, say
from infra.run.cluster.engine_actor import EngineSupervisor, start_role_engine, start_sglang_engine, stop_engine_actor
from infra.run.cluster.learner_actor import LearnerHandle, spawn_learner
from infra.run.cluster.rollout_fleet import RolloutFleet, shares_store
from infra.run.cluster.runtime import (Placements, check_role_labels, driver_node_id, init_ray, kill_actor, on_node,
                                       placement_options, shutdown_ray)
from infra.run.cluster.scheduler_actor import CurriculumHandle, VariantSource, spawn_scheduler
from infra.run.monitoring import Monitoring
from infra.run.workers import Autoscaler, WorkerPool, local_spawner, make_env_factory
from infra.streams import connect, ping, run_prefix
from learner import checkpoint as ckpt
from learner.learner import Learner, stream_learner
from simulator.embedder import Embedder
from simulator.experience_model import ExperienceModel
from simulator.replay_buffer import make_buffer, seed_buffer
from simulator.reply_memo import ReplyMemo

log = logging.getLogger(__name__)


def ray_roles(cfg: Config) -> list[str]:
    """The roles `dreamgym train` starts as Ray actors under `cfg` (`actors.runtime=ray`): the engines it
    launches itself (none for configured endpoints), and with RL the learner, the scheduler, the rollout
    workers and, for a synthetic run on a single-process store, the buffer actor."""
    e, synthetic = cfg.engines, cfg.actors.env_kind == "synthetic"
    roles = [] if e.policy_endpoints else ["policy"]
    if (synthetic or cfg.simulator.fidelity_every > 0) and not e.mexp_endpoints:
        roles.append("mexp")
    if cfg.learner.total_updates > 0:
        roles += ["learner", "scheduler", "rollout"] + (["buffer"] if synthetic and shares_store(cfg) else [])
    return roles


class Services:
    """Redis, the engines, the replay buffer and the worker fleet of one run; `async with` owns their lifetimes."""

    def __init__(self, cfg: Config, name: str, console: Any = None, resume: bool = False):
        self.cfg, self.name, self.console, self.resume = cfg, name, console, resume
        self.run_dir = Path(cfg.infra.run_dir) / name
        self.prefix = run_prefix(cfg.infra.stream_prefix, name)
        self.redis_url = cfg.infra.redis_url
        self.client: Any = None
        self.buffer: Any = None
        self.mexp: EngineClient | None = None
        self.policy: EngineClient | None = None
        self.tokenizer: Any = None
        self.embedded: dict[str, list[EngineHandle]] = {}  # the engines started in this process, by role
        self.fleet: RolloutFleet | None = None
        self.ray: dict[str, float] | None = None  # the cluster's resources, once this run joined Ray
        self.placement = Placements()
        self.monitoring = Monitoring(cfg.infra, self.run_dir, name)
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> "Services":
        await self._stack.__aenter__()
        self._created = not self.run_dir.exists()  # a failed run removes only a directory it made itself
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump(self.cfg))
            self.monitoring.start()
            self._stack.push_async_callback(self.monitoring.aclose)
            redis = None
            if not self.redis_url:
                # Persistent in the run directory: a job killed with -9 and --resume'd finds its
                # streams, pending entries included (learner/learner.py acks after checkpoints).
                data = self.run_dir / "redis"
                if not self.resume:
                    shutil.rmtree(data, ignore_errors=True)  # a new run under an old name starts empty
                redis = self._stack.enter_context(EmbeddedRedis(data_dir=data, appendonly=True,
                                                                password_file=self.run_dir / "redis.password"))
                self.redis_url = redis.url  # with its password: for this process and the Ray actors, never written
            self.client = connect(self.redis_url, self.cfg.infra.redis_tls_ca)
            self._stack.push_async_callback(self.client.aclose)
            await ping(self.client, self.redis_url)  # a wrong infra.redis_url fails now, in one line
            # An embedded Redis has no fixed URL: record it, without the password (a configured one: not at all).
            write_job_record(self.cfg.infra.run_dir, self.prefix, self.run_dir, redis)
            self.monitoring.sample_streams(self.client, self.prefix)
        except BaseException:
            await self._stack.aclose()
            self._remove_half_made()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> bool:
        await self.monitoring.linger()  # every target of the run is still up for the last scrape
        try:
            return await self._stack.__aexit__(*exc)
        finally:
            if exc[0] is not None:
                self._remove_half_made()

    def _remove_half_made(self) -> None:
        """A run that failed before its first checkpoint or summary leaves no run directory behind (its
        config.yaml would make `dreamgym experiment` and `--resume` take it for a run); a directory it did
        not make, or one with something to resume from, stays."""
        if not getattr(self, "_created", False) or not self.run_dir.exists():
            return
        if ckpt.latest(self.run_dir) is not None or (self.run_dir / "summary.json").exists():
            return
        shutil.rmtree(self.run_dir, ignore_errors=True)
        log.warning("removed the half-made run directory %s: the run failed before its first checkpoint", self.run_dir)

    def ray_resources(self) -> dict[str, float]:
        """Ray for this run (`actors.runtime=ray`): joined (`infra.ray_address`, shipping the code as
        `infra.ray_runtime_env` says) or started on first use; shut down on exit if started here. On a
        labelled cluster a role of this run without its label fails here (cluster/runtime.check_role_labels)."""
        if self.ray is None:
            started = not ray.is_initialized()
            resources = init_ray(self.cfg.infra.ray_address, runtime_env=self.cfg.infra.ray_runtime_env)
            if started:
                self._stack.callback(shutdown_ray)
            check_role_labels(ray_roles(self.cfg), resources,
                              {"rollout": self.cfg.actors.worker_resources} if self.cfg.actors.worker_resources else None)
            self.ray = resources
        return self.ray

    def placements(self) -> dict:
        """Where each of this run's Ray actors ran (empty without Ray); see cluster/runtime.Placements."""
        return self.placement.resolve() if self.ray is not None else {}

    def open_buffer(self, offline: list) -> Any:
        """The run's replay buffer: created and seeded with every real offline transition, or
        reopened as it was (a resumed run keeps what it wrote back and is not seeded twice)."""
        t0 = time.perf_counter()
        self.buffer = make_buffer(self.cfg.simulator, self.run_dir / "buffer",
                                  Embedder(cache_path=embedding_cache(self.cfg)))
        self._stack.callback(self.buffer.close)  # idempotent: also fine after the fleet moved the store
        if len(self.buffer):
            say(self.console, f"replay buffer reopened with {len(self.buffer)} transitions "
                              f"({time.perf_counter() - t0:.1f} s)")
        else:
            n = seed_buffer(self.buffer, offline)
            say(self.console, f"replay buffer seeded with {n} real transitions ({time.perf_counter() - t0:.1f} s)")
        return self.buffer

    async def start_engines(self, mexp_model: str | None, policy_model: str) -> None:
        """Clients for Mexp and the policy: on the configured endpoints, or on embedded engines started here.
        No Mexp when `mexp_model` is None (real-environment and evaluation-only runs)."""
        e = self.cfg.engines

        async def endpoints(configured: list, model: str, role: str) -> list[str]:
            if configured:
                return list(configured)
            if e.launch == "sglang":
                return [await self._launch_sglang(role, model)]
            roots = default_weights_roots(model, self.cfg.infra.run_dir, e.weights_root, self.cfg.infra.weights_dir)
            if self.cfg.actors.runtime == "ray":  # an engine actor on the role's labelled node
                local = os.path.abspath(model) if os.path.isdir(model) else model  # the actor's cwd is its node's
                start = functools.partial(start_role_engine, e, role, cluster_resources=self.ray_resources(),
                                          weights_roots=roots)
                actor, url = await asyncio.to_thread(start, model=local)
                keeper = EngineSupervisor(  # replaced if it dies; the policy's with the last published weights
                    lambda port, path, version: start(model=path or local, port=port, weight_version=version),
                    actor, url, run_dir=self.run_dir if role == "policy" else None)
                self._stack.callback(keeper.stop)
                keeper.watch()
                self._stack.push_async_callback(keeper.aclose)
                self.placement.record(f"{role}_engine", actor)
                self.monitoring.add_url("engine", role, url)
                self._stack.callback(self.monitoring.remove, "engine", role)
                return [url]
            # Mexp replicas share one loaded model: on a CPU each decodes on its own core
            replicas = e.mexp_replicas if role == "mexp" else 1
            loaded = await asyncio.to_thread(load_model, model, e.dtype, e.device) if replicas > 1 else None
            urls = []
            for i in range(replicas):
                handle = await start_embedded_engine(model=model, max_batch_size=e.max_batch_size, dtype=e.dtype,
                                                     device=e.device, engine_cfg=e, weights_roots=roots, loaded=loaded)
                self.embedded.setdefault(role, []).append(handle)
                self._stack.push_async_callback(handle.stop)
                name = role if i == 0 else f"{role}-{i}"
                self.monitoring.add_url("engine", name, handle.url)  # its own registry, on its own port
                self._stack.callback(self.monitoring.remove, "engine", name)
                urls.append(handle.url)
            return urls

        if mexp_model is not None:  # runs that never step a synthetic environment need no Mexp
            self.mexp = EngineClient.from_config(e, await endpoints(e.mexp_endpoints, mexp_model, "mexp"), role="mexp")
            self._stack.push_async_callback(self.mexp.close)
        self.policy = EngineClient.from_config(e, await endpoints(e.policy_endpoints, policy_model, "policy"), role="policy")
        self._stack.push_async_callback(self.policy.close)
        self.tokenizer = load_tokenizer(e.model)

    @contextlib.contextmanager
    def engine_threads(self, role: str, threads: int) -> Iterator[None]:
        """The block runs `role`'s embedded CPU engine on `threads` torch threads (-1: every core this process
        may use; 0: leave it), then on engines.threads again: a held-out evaluation, where the policy engine
        computes alone, uses the cores the run's engines otherwise share. No-op for any other engine."""
        batchers = [h.batcher for h in self.embedded.get(role, []) if h.batcher.device.type == "cpu"]
        if not batchers or threads == 0:
            yield
            return
        before = [b.threads for b in batchers]
        for b in batchers:
            b.set_threads(threads if threads > 0 else len(os.sched_getaffinity(0)))
        try:
            yield
        finally:
            for b, n in zip(batchers, before):
                b.set_threads(n)

    async def _launch_sglang(self, role: str, model: str) -> str:
        """SGLang's launch_server for `role` on port engines.sglang_port (+1 for the policy), healthy before
        this returns and supervised (restarted if it dies) until the run ends: an actor on the role's labelled
        node with `actors.runtime=ray`, else a child process of the driver logging to <run_dir>/sglang-<role>.log."""
        e = self.cfg.engines
        port = e.sglang_port + (1 if role == "policy" else 0)
        local = os.path.abspath(model) if os.path.isdir(model) else model
        if self.cfg.actors.runtime == "ray":
            actor, url = await asyncio.to_thread(start_sglang_engine, e, role, local, port, self.ray_resources())
            self._stack.callback(stop_engine_actor, actor)
            self.placement.record(f"{role}_engine", actor)
        else:
            launcher = SGLangLauncher(e, local, port, log_path=str(self.run_dir / f"sglang-{role}.log"))
            url = await asyncio.to_thread(launcher.start)
            self._stack.callback(launcher.stop)
        say(self.console, f"SGLang serves {role} ({model}) at {url}")
        self.monitoring.add_url("engine", role, url)
        self._stack.callback(self.monitoring.remove, "engine", role)
        return url

    def learner(self, policy_model: str) -> Learner:
        """The learner in this process, on the run's trajectory stream, publishing to the policy engines;
        its FSDP ranks (`learner.num_gpus` > 1, learner/fsdp.py) end with the run."""
        learner = stream_learner(self.cfg, self.client, self.prefix, self.run_dir, self.policy, policy_model)
        self._stack.callback(learner.close)
        return learner

    async def learner_actor(self, policy_model: str) -> LearnerHandle:
        """The learner as an actor on a `learner_gpu` node (one GPU with `learner.device` on CUDA: it is rank 0,
        and starts its other `learner.num_gpus` - 1 ranks as actors by the same label,
        infra/run/cluster/learner_ranks.py; the label is its reservation, so it asks for no CPU share), on the
        run's Redis and policy engines."""
        opts = placement_options("learner", self.ray_resources(), num_cpus=0)
        if self.cfg.learner.device.startswith("cuda"):
            opts["num_gpus"] = 1
        actor = spawn_learner(self.cfg, policy_model, self.run_dir, self.redis_url, self.prefix, self.policy.urls, opts)
        self._stack.callback(kill_actor, actor)
        self.placement.record("learner", actor)
        handle = await LearnerHandle.start(actor)
        if self.monitoring.enabled:
            self.monitoring.add("learner", "learner", await actor.serve_metrics.remote(self.monitoring.host))
            self._stack.callback(self.monitoring.remove, "learner", "learner")
        return handle

    def curriculum_actor(self, seeds: list, variants: bool) -> CurriculumHandle:
        """The curriculum scheduler as an actor on the `scheduler_cpu` node, else beside the driver (preferred), on the run's
        Redis (password and `infra.redis_tls_ca` included); Mtask variants from the Mexp engines if `variants`."""
        cfg = self.cfg
        opts = on_node(placement_options("scheduler", self.ray_resources(), num_cpus=0.25), driver_node_id(), soft=True)
        make_variants = VariantSource(cfg, self.mexp.urls) if variants and self.mexp is not None else None
        actor = spawn_scheduler(self.redis_url, self.prefix, cfg.curriculum, seeds, make_variants, seed=rl_seed(cfg.infra),
                                options=opts, stream_maxlen=cfg.infra.stream_maxlen,
                                redis_tls_ca=cfg.infra.redis_tls_ca)
        self._stack.callback(kill_actor, actor)
        self.placement.record("scheduler", actor)
        if self.monitoring.enabled:
            self.monitoring.add("scheduler", "scheduler", ray.get(actor.serve_metrics.remote(self.monitoring.host)))
            self._stack.callback(self.monitoring.remove, "scheduler", "scheduler")
        return CurriculumHandle(actor)

    @contextlib.asynccontextmanager
    async def workers(self, cfg: Config | None = None) -> AsyncIterator[WorkerPool]:
        """`actors.num_workers` rollout workers for the duration of the block (see WorkerPool.running).

        `cfg`: the config this pool's workers follow (a phase of the run: sim-to-real's real phase
        plays real environments); the run's own by default."""
        cfg = cfg or self.cfg
        if cfg.actors.runtime == "ray":  # an embedded store moves into one buffer actor, once per run
            if self.fleet is None:
                self.ray_resources()
                self.fleet = RolloutFleet(self.cfg, self.redis_url, self.prefix, self.mexp.urls if self.mexp else [], self.policy.urls,
                                          self.buffer, self.run_dir / "buffer", embedding_cache(self.cfg))
                self._stack.callback(self.fleet.close)
                if self.fleet.buffer_actor is not None:
                    self.placement.record("buffer", self.fleet.buffer_actor)
                self._monitor_fleet()
            spawn = self._monitored(functools.partial(self.fleet.spawn, cfg=cfg))
        else:
            memo = ReplyMemo(cfg.simulator.reply_memo)  # one for the pool's experience models
            envs = make_env_factory(cfg, lambda: ExperienceModel(self.mexp, self.buffer, cfg.simulator, self.tokenizer,
                                                                 memo))
            spawn = local_spawner(cfg, self.client, self.prefix, self.policy, self.tokenizer, envs, self.buffer)
        pool = WorkerPool(spawn, on_stop=functools.partial(self.monitoring.remove, "rollout_worker"))
        engines = (self.policy.urls if self.policy else []) + (self.mexp.urls if self.mexp else [])
        autoscale = Autoscaler(cfg, self.client, self.prefix, engines) if cfg.actors.autoscale else None
        async with pool.running(self.client, self.prefix, cfg.actors.num_workers, autoscale):
            yield pool

    def _monitor_fleet(self) -> None:
        """The buffer actor's and Ray's own node exporters as scrape targets (monitoring on)."""
        if not self.monitoring.enabled:
            return
        if self.fleet.buffer_actor is not None:
            self.monitoring.add("buffer", "buffer", ray.get(self.fleet.buffer_actor.serve_metrics.remote(
                self.monitoring.host)))
        self.monitoring.add_ray_nodes(ray.nodes())

    def _monitored(self, spawn: Callable[[str], Any]) -> Callable[[str], Awaitable[Any]]:
        """`spawn` for Ray worker actors, each listed as a scrape target once it serves its own /metrics."""
        async def spawn_listed(worker_id: str) -> Any:
            handle = spawn(worker_id)
            self.placement.record("rollout_worker", handle.actor)
            if self.monitoring.enabled:
                self.monitoring.add("rollout_worker", worker_id,
                                    await handle.actor.serve_metrics.remote(self.monitoring.host))
            return handle
        return spawn_listed

    def buffer_size(self) -> int:
        """Transitions in the replay buffer now (in the buffer actor when the fleet holds it)."""
        if self.fleet is not None:
            return self.fleet.buffer_size()
        return len(self.buffer) if self.buffer is not None else 0
