"""`dreamgym scale`: resize the rollout-worker pool of a running job.

Owns the command only. It sets the job's worker target in Redis; the job's
`WorkerPool` (infra/run/workers.py) follows it within a second. The job is found from
`--redis-url`/`--prefix`, else `infra.redis_url`, else the record `dreamgym train`
leaves in `<run_dir>/latest.json` (an embedded Redis has no fixed URL, and its password
sits in a 0600 file the record names; infra/redis_server.py reads it). The client
honours `infra.redis_tls_ca`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from redis.exceptions import RedisError

from infra.config import add_config_arguments, config_from_args, redact_url
from infra.redis_server import read_job_record
from infra.run.workers import alive_key, desired_key
from infra.streams import RedisUnreachable, connect, ping


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--workers", type=int, required=True, help="desired number of rollout workers")
    p.add_argument("--redis-url", default=None, help="the job's Redis (default: infra.redis_url, else the running job's)")
    p.add_argument("--prefix", default=None, help="the job's key prefix (default: the running job's, else infra.stream_prefix)")


async def _scale(url: str, prefix: str, n: int, tls_ca: str = "") -> tuple[int | None, int]:
    client = connect(url, tls_ca)
    try:
        await ping(client, url)
        before = await client.get(alive_key(prefix))
        await client.set(desired_key(prefix), n)
        return (int(before) if before is not None else None), n
    finally:
        await client.aclose()


def run(args: argparse.Namespace) -> int:
    if args.workers < 0:
        print("dreamgym scale: --workers must be >= 0")
        return 2
    cfg = config_from_args(args)
    job = read_job_record(cfg.infra.run_dir, with_password=not (args.redis_url or cfg.infra.redis_url))
    url = args.redis_url or cfg.infra.redis_url or job.get("redis_url", "")
    prefix = args.prefix or job.get("prefix") or cfg.infra.stream_prefix
    if not url:
        print("dreamgym scale: no Redis URL (give --redis-url or infra.redis_url; no running job recorded)")
        return 2
    try:
        before, after = asyncio.run(_scale(url, prefix, args.workers, cfg.infra.redis_tls_ca))
    except RedisUnreachable as exc:  # the same one line as every command (infra/cli.py)
        print(f"dreamgym scale: {exc}", file=sys.stderr)
        return 3
    except (RedisError, OSError) as exc:
        print(f"dreamgym scale: cannot reach Redis at {redact_url(url)}: {type(exc).__name__}: {exc}")
        return 1
    print(f"rollout workers: {before if before is not None else '?'} -> {after} requested")
    return 0
