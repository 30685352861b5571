"""A finished run continued under another name (`dreamgym experiment`'s `continues:`).

Owns turning one run's end state into another run's starting point, so that a regime
whose first part is another regime's whole run starts from that run's last checkpoint
instead of training it again. Sim-to-real is the case: its DreamGym phase is exactly
the `dreamgym_grpo` regime (same settings, same seeds), so `dreamgym_s2r` continues
that run with `--resume` and only its real phase is new. Both rows then share their
DreamGym phase, and the S2R row differs from the DreamGym row by the real phase alone.

What moves: the whole run directory (checkpoints, the replay buffer, the embedded
Redis's append-only files, the run's history and in-flight ledger), except what
describes the source run's end (its summary, report, plots, log) and the files of its
stopped server (pidfile, password). The Redis keys carry the run's name
(`<stream_prefix>:<name>:...`), so each key of the source's prefix is renamed to the new
one: the streams with their consumer groups and entry ids (which the checkpoint
records), the exact transition counters, the task statistics.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import redis

from infra.redis_server import PIDFILE, EmbeddedRedis
from learner import checkpoint

log = logging.getLogger(__name__)

# The source run's own end and its stopped server's files: the continued run writes its own.
LEFT_BEHIND = ("summary.json", "report.md", "plots", "train.log", "monitoring", "redis.password",
               f"redis/{PIDFILE}", "redis/password", "redis/redis.conf")


def fork_run(source: Path, target: Path, source_prefix: str, target_prefix: str) -> Path:
    """Copy the finished run `source` into the new run directory `target`, its Redis keys renamed
    from `source_prefix:` to `target_prefix:`; returns the checkpoint the target resumes from."""
    last = checkpoint.latest(source)
    if last is None:
        raise ValueError(f"{source} has no checkpoint to continue from")
    if target.exists() and any(target.iterdir()):
        raise ValueError(f"{target} is not empty: a continued run starts in a new directory")
    shutil.copytree(source, target, dirs_exist_ok=True,
                    ignore=lambda d, names: [n for n in names
                                             if (Path(d) / n).relative_to(source).as_posix() in LEFT_BEHIND])
    if (target / "redis").is_dir():
        renamed = rename_prefix(target / "redis", source_prefix, target_prefix)
        log.info("continued %s as %s: %d Redis keys renamed", source, target, renamed)
    return checkpoint.latest(target)


def rename_prefix(data_dir: Path, old: str, new: str) -> int:
    """Rename every key under `old:` to `new:` in the append-only Redis data of `data_dir`; the count."""
    if old == new:
        return 0
    pattern = re.sub(r"([*?\[\]\\])", r"\\\1", old) + ":*"
    with EmbeddedRedis(data_dir=data_dir, appendonly=True, password="") as server:
        client = redis.Redis(port=server.port)
        try:
            keys = [k.decode() for k in client.scan_iter(match=pattern, count=1000)]
            for k in keys:
                client.rename(k, new + k[len(old):])
        finally:
            client.close()
    return len(keys)
