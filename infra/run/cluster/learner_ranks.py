"""The learner's other FSDP ranks as Ray actors on the `learner_gpu` nodes (a `RankLauncher`).

With `actors.runtime=ray` the learner is an actor on a `learner_gpu` node
(infra/run/cluster/learner_actor.py) and rank 0 of its `learner.num_gpus` ranks; `RayRanks`
starts ranks 1..N-1 as `LearnerRank` actors placed by the same label, one GPU each with
`learner.device` on CUDA, on whichever labelled nodes have room, so a learner may span
nodes. Each runs learner/fsdp.serve: all join torch's TCP rendezvous at rank 0's node
address on a free port (as Ray Train's TorchConfig does), NCCL on GPUs and gloo on CPUs,
and take their orders over the process group (learner/fsdp.py).

Why plain actors and not Ray Train's `TorchTrainer`: `fit()` runs one train function to
its end on a worker group it owns, its controller restarting the whole group on failure,
and reports through `ray.train.report`. Our learner is the loop that drives the ranks: it
reads each batch from Redis, decides when to publish and checkpoint, and undoes a
non-finite update, one order at a time. Inside `fit()` that loop would need a second
channel from the learner into the train function, and rank 0 would be a Ray Train worker
instead of the learner's process; the worker group under `fit()` is internal API
(`ray.train._internal.worker_group`, `ray.train.v2._internal`) that changes between
releases. What Ray Train's torch backend does for a group is small, and done here the
same way: place N workers by resources, pick rank 0's node address and a free port, and
`init_process_group` on every worker. Restarting after a failure is the learner's
(learner/learner.py: from the last checkpoint, with the delivery rules of a learner crash).

A rank that fails exits its actor's process (`os._exit`), so the collectives break at
once and rank 0 fails (its traceback is in that actor's log); `failures()` names the rank
and Ray's error. Ranks that cannot be placed (no node with the label and a free GPU) keep
rank 0 waiting in the rendezvous until learner/fsdp.TIMEOUT, then the learner stops.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

from infra.config import LearnerConfig
from infra.run.cluster.runtime import kill_actor, placement_options
from learner.fsdp import check_ranks, serve

log = logging.getLogger(__name__)


@ray.remote
class LearnerRank:
    """One FSDP rank k > 0 of the learner."""

    def pid(self) -> int:
        return os.getpid()

    def serve(self, init: dict, rank: int, device: str) -> None:
        try:
            serve(init, rank, device)
        except BaseException:  # leave the group at once: rank 0 fails now instead of at the collective's timeout
            log.exception("FSDP rank %d failed", rank)
            os._exit(1)


def rank_options(cfg: LearnerConfig, cluster_resources: dict[str, float] | None = None) -> dict:
    """A rank actor's `.options`: the `learner_gpu` label when the cluster has it, and one GPU on CUDA."""
    opts = placement_options("learner", cluster_resources if cluster_resources is not None else ray.cluster_resources(),
                             num_cpus=0)
    if cfg.device.startswith("cuda"):
        opts["num_gpus"] = 1
    return opts


class RayRanks:
    """Ranks 1..N-1 as `LearnerRank` actors, rank 0 being this process (the learner actor)."""

    def __init__(self, options: dict[str, Any]):
        self.options = options
        self.host = ray.util.get_node_ip_address()  # this node's: where the others meet rank 0
        self._actors: list[Any] = []
        self._pids: list[Any] = []
        self._serving: dict[int, Any] = {}

    def check(self, cfg: LearnerConfig) -> None:
        check_ranks(cfg, one_node=False)  # each rank is given its own GPU by Ray

    def device(self, cfg: LearnerConfig, rank: int) -> str:
        return "cuda:0" if cfg.device.startswith("cuda") else "cpu"  # Ray sets each actor's CUDA_VISIBLE_DEVICES

    def start(self, init: dict) -> None:
        cfg = LearnerConfig(**init["cfg"])
        self._actors = [LearnerRank.options(**self.options).remote() for _ in range(init["world"] - 1)]
        self._pids = [a.pid.remote() for a in self._actors]  # an actor runs its calls in order: before serve
        self._serving = {rank: a.serve.remote(init, rank, self.device(cfg, rank))
                         for rank, a in enumerate(self._actors, start=1)}

    def failures(self) -> list[str]:
        out = []
        for rank, ref in self._serving.items():
            done, _ = ray.wait([ref], timeout=0)
            if done:
                try:
                    ray.get(ref)
                except Exception as exc:  # the actor died (its own exit, a kill, its node lost)
                    out.append(f"rank {rank} exited: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        return out

    def pids(self) -> dict[int, int]:
        return dict(enumerate(ray.get(self._pids), start=1))

    def stop(self, grace_s: float) -> None:
        if grace_s > 0 and self._serving:
            ray.wait(list(self._serving.values()), num_returns=len(self._serving), timeout=grace_s)
        for actor in self._actors:
            kill_actor(actor)
        self._actors, self._pids, self._serving = [], [], {}
