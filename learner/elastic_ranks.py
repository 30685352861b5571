"""The learner's other FSDP ranks as processes of this node, started by torch's elastic launcher.

Owns `ElasticRanks`, the `RankLauncher` (learner/fsdp.py) of a learner without Ray
(`actors.runtime=local`): ranks 1..N-1 are started with
`torch.distributed.elastic.multiprocessing.start_processes`, the layer under torchrun,
as `python -m learner.elastic_ranks` with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus the learner's config in
DREAMGYM_RANK_INIT (JSON). Rank 0 is the learner's process on the same node, so the
rendezvous is at 127.0.0.1 and rank k computes on `cuda:<i+k>` of
`learner.device=cuda:<i>` (or on the CPU with gloo).

Where it departs from torchrun: no elastic agent. torchrun's agent owns every rank and
waits on them as one job (`elastic_launch` returns when the job ends); here rank 0 is
the learner itself, which drives each update, so the launcher only starts the others and
reports how they ended. The agent's other duty, restarting the group after a failure,
is the learner's (learner/learner.py: from the last checkpoint, the update it died in
struck). A rank's uncaught error is recorded by elastic's `@record` in its error file,
which `failures()` quotes. The launcher starts its ranks in their own session; each
watches its parent and exits when the learner's process is gone, so a `kill -9` of the
job leaves no rank behind.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
from torch.distributed.elastic.multiprocessing.errors import record

from infra.config import LearnerConfig
from learner.fsdp import check_ranks, rank_device, serve

log = logging.getLogger(__name__)

INIT_ENV = "DREAMGYM_RANK_INIT"  # the learner's init message (learner/fsdp.Ranks.start), JSON
PARENT_ENV = "DREAMGYM_RANK_PARENT"  # the learner's pid: a rank exits when it is gone
ROOT = Path(__file__).resolve().parents[1]  # on the ranks' PYTHONPATH: `python -m learner.elastic_ranks` from any cwd


class ElasticRanks:
    """Ranks 1..N-1 as local processes (torch.distributed.elastic), rank 0 being this process."""

    host = "127.0.0.1"

    def __init__(self) -> None:
        self._ctx = None
        self._failures: list[str] = []
        self._logs: tempfile.TemporaryDirectory | None = None

    def check(self, cfg: LearnerConfig) -> None:
        check_ranks(cfg, one_node=True)

    def device(self, cfg: LearnerConfig, rank: int) -> str:
        return rank_device(cfg, rank)

    def start(self, init: dict) -> None:
        world, cfg = init["world"], LearnerConfig(**init["cfg"])
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        envs = {i: {"RANK": str(i + 1), "LOCAL_RANK": str(i + 1), "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": init["addr"], "MASTER_PORT": str(init["port"]),
                    "DREAMGYM_RANK_DEVICE": self.device(cfg, i + 1), INIT_ENV: json.dumps(init),
                    PARENT_ENV: str(os.getpid()), "PYTHONPATH": path} for i in range(world - 1)}
        self._logs = tempfile.TemporaryDirectory(prefix="dreamgym-ranks-")  # elastic's error files
        self._failures = []
        self._ctx = start_processes(name="learner-rank", entrypoint=sys.executable,
                                    args={i: ("-m", "learner.elastic_ranks") for i in range(world - 1)}, envs=envs,
                                    logs_specs=DefaultLogsSpecs(log_dir=self._logs.name, redirects=Std.NONE,
                                                                tee=Std.NONE))

    def failures(self) -> list[str]:
        if self._ctx is None or self._failures:
            return self._failures
        result = self._ctx.wait(0)  # elastic's poll: ends the others once one has failed
        if result is not None and result.is_failed():
            self._failures = [f"rank {lr + 1} exited with code {f.exitcode}"
                              + (f": {f.message}" if f.message and f.message != "<NONE>" else "")
                              for lr, f in sorted(result.failures.items())]
        return self._failures

    def pids(self) -> dict[int, int]:
        return {lr + 1: pid for lr, pid in self._ctx.pids().items()} if self._ctx is not None else {}

    def stop(self, grace_s: float) -> None:
        if self._ctx is None:
            return
        try:
            if grace_s > 0:
                self._ctx.wait(grace_s, period=0.1)
            self._ctx.close(timeout=10)
        finally:
            self._ctx = None
            if self._logs is not None:
                self._logs.cleanup()
                self._logs = None


def _exit_with_parent(parent: int) -> None:
    """Rank 0 (the learner) gone, killed or not: this rank has nobody to serve."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


@record
def main() -> None:
    init = json.loads(os.environ[INIT_ENV])
    threading.Thread(target=_exit_with_parent, args=(int(os.environ[PARENT_ENV]),), daemon=True).start()
    serve(init, int(os.environ["RANK"]), os.environ["DREAMGYM_RANK_DEVICE"])


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    try:
        main()
    except BaseException:  # @record wrote the error file; leave without waiting on the broken collectives
        os._exit(1)
    os._exit(0)
