"""`dreamgym status`: is Redis reachable, how long are the streams, what is pending, what is dead.

Reads only; safe to run against a live training job. Exits 1 when Redis cannot be
reached within the timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from infra.cli import add_config_arguments, config_from_args
from infra.config import redact_url
from infra.streams import connect, stream_status, tasks_stream, trajectories_stream


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--redis-url", default=None, help="Redis URL (default: infra.redis_url from the config)")
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
    url = args.redis_url or cfg.infra.redis_url
    if not url:
        print("no Redis configured (infra.redis_url is empty, so training uses an embedded one); pass --redis-url")
        return 1
    report = asyncio.run(collect_status(url, cfg.infra.stream_prefix, cfg.infra.redis_tls_ca))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        if not report["reachable"]:
            console.print(f"[red]redis {report['redis']} unreachable[/red]: {report['error']}")
            return 1
        table = Table(title=f"redis {report['redis']}")
        for col in ("stream", "length", "group", "consumers", "pending", "lag", "dead letters"):
            table.add_column(col)
        for s in report["streams"]:
            groups = s["groups"] or [{"group": "-", "consumers": "-", "pending": "-", "lag": "-"}]
            for g in groups:
                table.add_row(s["stream"], str(s["length"]), g["group"], str(g["consumers"]), str(g["pending"]),
                              str(g["lag"]), str(s["dead_letters"]))
        console.print(table)
    return 0 if report["reachable"] else 1
