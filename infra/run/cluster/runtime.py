"""The Ray runtime: starting or joining Ray, and where each role's actors go.

Owns `ray.init` and placement. Placement is by custom resource labels, one per role,
so heterogeneous nodes advertise what they are for (`ray start --resources
'{"mexp_gpu": 1}'` on an SGLang node with a big GPU, `{"learner_gpu": 1}` on the
training node, `{"rollout_cpu": 16}` on CPU boxes, `{"buffer_cpu": 1, "scheduler_cpu": 1}`
on the node that holds the replay buffer's store and runs the curriculum). A cluster that
advertises none of the labels (a plain single machine) places by CPU alone; one that
advertises any is a labelled cluster, and there every role the run starts must find its
label: `check_role_labels` fails the run before its first actor, naming the role and the
missing label, instead of a role silently landing on whatever node has room.

Ray 2.60 notes: token auth is on by default and every node must agree
on RAY_AUTH_MODE (we never change it; we pass the driver's value on to workers via
the inherited environment, and refuse a local start if it differs from
`auth_mode` when one is given); a local node must be given explicit memory and
object-store sizes, else each node started on one machine claims all the RAM. With no
address (and no RAY_ADDRESS) we start a fresh local runtime, never a stale one we find.

Code reaches the nodes here too, and only here: joining a cluster, `init_ray` gives the job a
`runtime_env` whose `py_modules` are the driver's own packages (actors, learner, simulator,
infra; `code_runtime_env`), so every actor of the run (rollout workers, the buffer, the
scheduler, the engines) imports the driver's version of DreamGym and a node needs only the
dependencies (`infra.ray_runtime_env: off` when every node has DreamGym installed). Settings
travel with each actor's arguments (the Redis URL with its password, `infra.redis_tls_ca`,
`engines.api_key`, `simulator.qdrant_api_key`); files they name (the CA bundle, the model,
`infra.run_dir`) must exist at the same path on every node.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from infra import metrics
from infra.processes import patient_gcs_start

log = logging.getLogger(__name__)

# role -> the custom resource a node advertises for it
ROLE_RESOURCES: dict[str, dict[str, float]] = {
    "mexp": {"mexp_gpu": 1},
    "policy": {"policy_gpu": 1},
    "learner": {"learner_gpu": 1},
    "rollout": {"rollout_cpu": 1},
    "buffer": {"buffer_cpu": 1},
    "scheduler": {"scheduler_cpu": 1},
}
ROLE_NAMES = {"mexp": "the Mexp engine", "policy": "the policy engine", "learner": "the learner",
              "rollout": "the rollout workers", "buffer": "the replay-buffer actor", "scheduler": "the curriculum scheduler"}

LOCAL_MEMORY_BYTES = 4 * 1024 ** 3
LOCAL_OBJECT_STORE_BYTES = 256 * 1024 ** 2


# DreamGym's own packages: what a node without DreamGym installed needs from the driver
CODE_PACKAGES = ("actors", "learner", "simulator", "infra")
RUNTIME_ENV_MODES = ("auto", "off")


def code_runtime_env(mode: str = "auto", joining: bool = True) -> dict[str, Any] | None:
    """The job's runtime_env: the driver's packages as `py_modules` when joining a cluster ('auto'), else None."""
    if mode not in RUNTIME_ENV_MODES:
        raise ValueError(f"infra.ray_runtime_env={mode!r}; expected one of {', '.join(RUNTIME_ENV_MODES)}")
    if mode == "off" or not joining:
        return None
    dirs = []
    for name in CODE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"cannot ship package {name!r} to the Ray nodes: it is not importable here")
        dirs.append(str(Path(list(spec.submodule_search_locations)[0]).resolve()))
    # Bytecode is rebuilt on each node; Ray hashes the rest, so an unchanged tree uploads once.
    return {"py_modules": dirs, "excludes": ["__pycache__", "*.pyc"]}


def init_ray(address: str = "", num_cpus: int | None = None, memory_bytes: int = LOCAL_MEMORY_BYTES,
             object_store_bytes: int = LOCAL_OBJECT_STORE_BYTES, resources: dict[str, float] | None = None,
             auth_mode: str | None = None, namespace: str = "dreamgym", runtime_env: str = "auto") -> dict:
    """Join `address` (a running cluster) or start a small local runtime; returns the cluster's resources.

    `runtime_env` is `infra.ray_runtime_env`: joining a cluster with 'auto', the job ships the
    driver's packages to every node (`code_runtime_env`). A Ray this process already joined is
    kept as it is, runtime_env included, but only if it is the cluster `address` names and, with
    'auto', carries the code: a connection made by something else (Ray's own auto-init when its API
    is called after `ray.shutdown` joins the newest cluster on this machine with no runtime_env) is
    refused, never silently used in its place."""
    if auth_mode is not None:
        current = os.environ.get("RAY_AUTH_MODE")
        if current is not None and current != auth_mode:
            raise RuntimeError(f"RAY_AUTH_MODE={current!r} but auth_mode={auth_mode!r}: every node must agree")
        os.environ["RAY_AUTH_MODE"] = auth_mode
    address = address or os.environ.get("RAY_ADDRESS", "")
    if ray.is_initialized():
        joined = ray.get_runtime_context().gcs_address
        if address and address != "auto" and "://" not in address and address != joined:
            raise RuntimeError(f"this process is already in the Ray at {joined}, not {address}: "
                               "shut that one down (ray.shutdown) before joining another")
        if address and code_runtime_env(runtime_env) and not ray.get_runtime_context().runtime_env.get("py_modules"):
            raise RuntimeError(f"this process is already in the Ray at {joined} without DreamGym's code as a runtime_env "
                               "(infra.ray_runtime_env=auto): shut it down (ray.shutdown) and let init_ray join")
        return ray.cluster_resources()
    kwargs: dict[str, Any] = {"namespace": namespace, "log_to_driver": False, "include_dashboard": False}
    if address:
        env = code_runtime_env(runtime_env, joining=True)
        if env is not None:
            kwargs["runtime_env"] = env
        ray.init(address=address, **kwargs)
    else:
        # "local" always starts a fresh runtime: without it ray.init() joins whatever cluster
        # /tmp/ray/ray_current_cluster names, e.g. one left behind by a killed `dreamgym train`.
        patient_gcs_start()
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), _memory=memory_bytes, object_store_memory=object_store_bytes,
                 resources=resources or {}, **kwargs)
    res = ray.cluster_resources()
    log.info("ray up: %s", {k: v for k, v in res.items() if not k.startswith("node:")})
    return res


def shutdown_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()


def kill_actor(handle: Any, no_restart: bool = True) -> None:
    """`ray.kill`, unless Ray is already down (the actor went with its job). A cleanup that runs after
    `ray.shutdown` (a cancelled run unwinding late) must not call Ray's API: Ray then inits itself,
    joining the newest cluster on this machine (or starting a local one) with no runtime_env, and
    the old handle is not valid there (ActorHandleNotFoundError)."""
    if ray.is_initialized():
        ray.kill(handle, no_restart=no_restart)


def placement_options(role: str, cluster_resources: dict[str, float] | None = None,
                      override: dict[str, float] | None = None, num_cpus: float = 0.5) -> dict:
    """`.options(...)` for an actor of `role`: its label when the cluster has it (or `override`), and its CPU share."""
    if role not in ROLE_RESOURCES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLE_RESOURCES)}")
    wanted = dict(override) if override else dict(ROLE_RESOURCES[role])
    if cluster_resources is not None and not override:
        wanted = {k: v for k, v in wanted.items() if cluster_resources.get(k, 0) > 0}
    opts: dict[str, Any] = {"num_cpus": num_cpus}
    if wanted:
        opts["resources"] = wanted
    return opts


class MissingRoleLabel(RuntimeError):
    """A labelled cluster lacks the label of a role this run starts."""


def check_role_labels(roles: list[str], cluster_resources: dict[str, float],
                      overrides: dict[str, dict[str, float]] | None = None) -> None:
    """Fail before any actor starts when a role of `roles` cannot be placed by its label.

    A cluster advertising none of the role labels places by CPU alone (nothing to check, except an
    `overrides` label, which is always required). On a labelled cluster every role needs its label
    (or its override, e.g. `actors.worker_resources` for 'rollout') on some node; Ray would otherwise
    leave an actor pending forever (an override) or put it anywhere (a default label). The error
    names every role and label missing, and how a node advertises one."""
    overrides = overrides or {}
    labelled = any(cluster_resources.get(k, 0) > 0 for r in ROLE_RESOURCES.values() for k in r)
    missing = []
    for role in roles:
        wanted = overrides.get(role) or (ROLE_RESOURCES[role] if labelled else {})
        missing += [(role, label) for label in wanted if cluster_resources.get(label, 0) <= 0]
    if missing:
        said = "; ".join(f"role '{role}' ({ROLE_NAMES[role]}) needs label '{label}'" for role, label in missing)
        raise MissingRoleLabel(
            f"no node of this Ray cluster advertises {', '.join(repr(l) for _, l in missing)}: {said}. Give a node "
            f"the label (`ray start --resources '{{\"{missing[0][1]}\": 1}}'`); a cluster with no role label at all "
            "places every role by CPU alone")


def driver_node_id() -> str:
    """The node this (driver) process is attached to."""
    return ray.get_runtime_context().get_node_id()


def on_node(options: dict, node_id: str, soft: bool = False) -> dict:
    """`options` pinned to `node_id` (hard: the actor needs that node's local files; soft: preferred)."""
    return {**options, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)}


def _own_node(_actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def node_of_actor(handle: Any) -> str:
    """The node id an actor runs on (for placement checks)."""
    return ray.get(handle.__ray_call__.remote(_own_node))


class Placements:
    """Where a run's actors ran: each actor is asked its node when it starts; `resolve()` collects the
    answers at the end (by then most actors are gone, but their answers stay with the driver)."""

    def __init__(self) -> None:
        self._asked: list[tuple[str, Any]] = []

    def record(self, role: str, handle: Any) -> None:
        self._asked.append((role, handle.__ray_call__.remote(_own_node)))

    def resolve(self, timeout_s: float = 60.0) -> dict:
        """{"driver": node id, "actors": {role: [node ids]}, "nodes": {node id: its custom resource labels}}."""
        if not self._asked or not ray.is_initialized():
            return {}
        actors: dict[str, list[str]] = {}
        for role, ref in self._asked:
            try:
                actors.setdefault(role, []).append(ray.get(ref, timeout=timeout_s))
            except Exception as exc:  # died before it answered: the run goes on without it, so does this record
                log.warning("placement of a %s actor unknown: %s", role, exc)
        nodes = {n["NodeID"]: sorted(k for k in n.get("Resources", {}) if k not in _BUILTIN
                                     and not k.startswith(("node:", "accelerator_type:")))
                 for n in ray.nodes() if n.get("Alive")}
        return {"driver": driver_node_id(), "actors": actors, "nodes": nodes}


_BUILTIN = {"CPU", "GPU", "TPU", "memory", "object_store_memory"}


_ACTOR_METRICS: dict[str, Any] = {}  # this actor process's /metrics server, started once


def serve_actor_metrics(host: str = "127.0.0.1") -> str:
    """Serve this actor process's own registry on a free port of `host`; returns the host:port
    Prometheus reaches it at (a wildcard bind advertises the node's IP). Idempotent per process."""
    if "address" not in _ACTOR_METRICS:
        server = metrics.serve_metrics(0, host)
        shown = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "") else host
        _ACTOR_METRICS.update(server=server, address=f"{shown}:{server.port}")
    return _ACTOR_METRICS["address"]
