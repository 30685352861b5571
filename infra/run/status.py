"""`dreamgym status`: is Redis reachable, how long are the streams, what is pending, what is dead.

Reads only; safe to run against a live training job. Exits 1 when Redis cannot be
reached within the timeout. With no --redis-url and no infra.redis_url it reports on
the latest `dreamgym train` job (its embedded Redis, password from the job's 0600 file).
"""

from __future__ import annotations

import argparse
import asyncio
import json

from rich.console import Console
from rich.table import Table

from infra.config import add_config_arguments, config_from_args, redact_url
from infra.redis_server import read_job_record
from infra.stream_backlog import stream_status
from infra.streams import connect, tasks_stream, trajectories_stream


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--redis-url", default=None, help="Redis URL (default: infra.redis_url, else the latest job's)")
    p.add_argument("--prefix", default=None, help="key prefix (default: the latest job's, else infra.stream_prefix)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


async def collect_status(url: str, prefix: str, tls_ca: str = "") -> dict:
    client = connect(url, tls_ca)
    try:
        await asyncio.wait_for(client.ping(), 5)
        streams = [await stream_status(client, s) for s in (tasks_stream(prefix), trajectories_stream(prefix))]
        return {"redis": redact_url(url), "reachable": True, "streams": streams}
    except Exception as exc:  # any failure to reach is reported, not raised
        return {"redis": redact_url(url), "reachable": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        await client.aclose()


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    job = {} if args.redis_url else read_job_record(cfg.infra.run_dir, with_password=not cfg.infra.redis_url)
    if cfg.infra.redis_url and job.get("redis_url"):  # that job ran on an embedded Redis, not this one
        job = {}
    url = args.redis_url or cfg.infra.redis_url or job.get("redis_url", "")
    prefix = args.prefix or job.get("prefix") or cfg.infra.stream_prefix
    if not url:
        print("no Redis configured (infra.redis_url is empty, and no running job is recorded in "
              f"{cfg.infra.run_dir}/latest.json or {cfg.infra.run_dir}/*/latest.json); pass --redis-url")
        return 1
    report = asyncio.run(collect_status(url, prefix, cfg.infra.redis_tls_ca))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        console = Console()
        if not report["reachable"]:
            console.print(f"[red]redis {report['redis']} unreachable[/red]: {report['error']}")
            return 1
        table = Table(title=f"redis {report['redis']}")
        # A stream's name is its run (an experiment's regime: dreamgym:dreamgym_grpo:tasks): never cut short
        table.add_column("stream", no_wrap=True, min_width=max(len(s["stream"]) for s in report["streams"]))
        for col in ("length", "group", "consumers", "pending", "lag", "dead letters"):
            table.add_column(col)
        for s in report["streams"]:
            groups = s["groups"] or [{"group": "-", "consumers": "-", "pending": "-", "lag": "-"}]
            for g in groups:
                table.add_row(s["stream"], str(s["length"]), g["group"], str(g["consumers"]), str(g["pending"]),
                              str(g["lag"]), str(s["dead_letters"]))
        console.print(table)
    return 0 if report["reachable"] else 1
