"""The `dreamgym` command line.

Owns argument parsing and dispatch only. Each subcommand lives in the module that
owns its concept and exposes `add_arguments(parser)` and `run(args) -> int`; this
file maps names to modules and imports a module only when its command runs, so
`dreamgym --help` stays fast. Commands that take a config accept a YAML preset and
`section.key=value` overrides (`dreamgym train configs/quickstart.yaml learner.lr=1e-5`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from rich.console import Console
from rich.logging import RichHandler

from infra.config import ConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# name -> (module, one-line help). The module's docstring is the long help.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("infra.run.driver", "Run the whole loop: data, Mexp, GRPO/PPO in DreamGym, held-out real evaluation."),
    "experiment": ("infra.run.experiment", "Run the paper's regimes (base, SFT, real RL, DreamGym, S2R, ablations) and compare them on held-out real tasks."),
    "status": ("infra.run.status", "Report Redis reachability, stream lengths, pending entries and dead letters."),
    "serve": ("infra.engine.server", "Serve a model with the embedded engine (SGLang's HTTP API on CPU)."),
    "generate": ("infra.engine.generate", "Send one generation request to any SGLang-compatible endpoint."),
    "collect": ("actors.collect", "Collect offline trajectories from real environments (expert, noisy, random)."),
    "eval": ("actors.evaluate", "Evaluate a policy on held-out real tasks: success with 95% CI, steps, invalid rate."),
    "train-mexp": ("learner.mexp_sft", "Fine-tune the experience model on offline data (paper Eq. 5)."),
    "warm-start": ("learner.policy_sft", "Supervised warm start of the policy on expert offline steps (choice form)."),
    "fidelity": ("simulator.fidelity", "Replay held-out real trajectories through Mexp: reward/done accuracy, state agreement."),
    "scale": ("infra.run.scale", "Add or remove rollout workers of a running training job."),
    "tasks": ("simulator.task_pool", "List the curriculum's task pool with statistics and lineage (a live job's, or a finished run's with --run DIR)."),
    "monitor": ("infra.run.monitoring", "Print a run's live Prometheus scrape targets and whether each answers."),
    "dashboards": ("infra.dashboards", "Write the Grafana dashboards and scrape config, or push them to a running Grafana."),
    "report": ("infra.run.report", "Regenerate a finished run's PNG plots and markdown summary (optionally from Prometheus)."),
}


def setup_logging(verbose: bool = False) -> None:
    # Logs go to stderr so that stdout carries only a command's result (tables, --json).
    handler = RichHandler(console=Console(stderr=True), rich_tracebacks=True, show_path=False)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(name)s: %(message)s",
                        datefmt="%H:%M:%S", handlers=[handler])
    for noisy in ("httpx", "urllib3", "filelock", "asyncio", "selenium", "transformers", "sentence_transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dreamgym",
        description="DreamGym: train LLM agents with RL on synthesized experience.",
        epilog="Run `dreamgym <command> --help` for a command's options; `dreamgym train --help` lists every setting.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text.replace("%", "%%"), add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Parse the command name first; only that command's module is imported.
    top, rest = parser.parse_known_args(argv)
    if not top.command:
        parser.print_help()
        return 0 if not argv else 2
    module_name, help_text = COMMANDS[top.command]
    module = importlib.import_module(module_name)
    sub = argparse.ArgumentParser(prog=f"dreamgym {top.command}", description=(module.__doc__ or help_text).strip(),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(sub)
    args = sub.parse_intermixed_args(rest)  # overrides may come before or after --options
    setup_logging(top.verbose)
    try:
        return int(module.run(args) or 0)
    except ConfigError as exc:
        print(f"dreamgym {top.command}: config error: {exc}", file=sys.stderr)
        return 2
    except ConnectionError as exc:  # infra.streams.RedisUnreachable and kin: a one-line cause, no traceback
        print(f"dreamgym {top.command}: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"dreamgym {top.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
