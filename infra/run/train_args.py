"""The arguments of `dreamgym train`, declared apart from the driver.

infra/run/driver.py imports the whole system (torch, transformers, Ray: seconds); the
command line reads this module instead to parse and to print `dreamgym train --help`,
and imports the driver only when a run starts (infra/cli.py).
"""

from __future__ import annotations

import argparse

from infra.config import UsageError, add_config_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, default="quickstart")
    p.add_argument("--name", default="", help="run name: runs/<name>/ (default: quickstart__<algo>__<seed>__<time>)")
    p.add_argument("--resume", action="store_true", help="continue runs/<name> from its latest checkpoint")
    p.add_argument("--sync", action="store_true", help="synchronous mode: roll out, then train (no overlap)")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out real evaluations")


def check(args: argparse.Namespace) -> None:
    """Arguments that do not fit together: a usage error before anything heavy is imported."""
    if args.resume and not args.name:
        raise UsageError("--resume needs --name of the run to continue")
