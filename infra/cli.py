"""The `dreamgym` command line.

Owns argument parsing and dispatch only. Each subcommand lives in the module that
owns its concept and exposes `add_arguments(parser)` and `run(args) -> int`; this
file maps names to modules and imports a module only when its command runs, so
`dreamgym --help` stays fast. A command whose module imports torch or Ray declares
its arguments in a light module of its own (ARGUMENTS), so its `--help` and its usage
errors import neither; the long help is the module's docstring, read from its source.
Commands that take a config accept a preset (a shipped name such as `quickstart`, a
YAML file or a run directory) and `section.key=value` overrides
(`dreamgym train quickstart learner.lr=1e-5`); `dreamgym config --describe` lists
every setting.

Conventions: `-v/--verbose` and `-q/--quiet` go before or after the command; a usage
error (an unknown option, arguments that do not fit together: UsageError) prints the
usage and one error line and exits 2, as does a config error; an unreachable service
exits 3.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from rich.console import Console
from rich.logging import RichHandler

from infra.config import ConfigError, UsageError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# name -> (module, one-line help). The module's docstring is the long help.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("infra.run.driver", "Run the whole loop: data, Mexp, GRPO/PPO in DreamGym, held-out real evaluation."),
    "experiment": ("infra.run.experiment", "Run the paper's regimes (base, SFT, real RL, DreamGym, S2R, ablations) and compare them on held-out real tasks."),
    "config": ("infra.config_doc", "Print the resolved config of a preset and overrides (YAML); --describe documents every setting."),
    "status": ("infra.run.status", "Report Redis reachability, stream lengths, pending entries and dead letters."),
    "serve": ("infra.engine.server", "Serve a model with the embedded engine (SGLang's HTTP API on CPU)."),
    "generate": ("infra.engine.generate", "Send one generation request to any SGLang-compatible endpoint."),
    "collect": ("actors.collect", "Collect offline trajectories from real environments (expert, noisy, random)."),
    "eval": ("actors.evaluate", "Evaluate a policy on held-out real tasks: success with 95% CI, steps, invalid rate."),
    "train-mexp": ("learner.mexp_sft", "Fine-tune the experience model on offline data (paper Eq. 5)."),
    "warm-start": ("learner.policy_sft", "Supervised warm start of the policy on expert offline steps (choice form)."),
    "fidelity": ("simulator.fidelity", "Replay held-out real trajectories through Mexp: reward/done accuracy, state agreement."),
    "rllib": ("infra.run.rllib", "Train an RLlib PPO agent in DreamGym's synthetic environment (or a real one): a learned simulator for classical RL."),
    "scale": ("infra.run.scale", "Add or remove rollout workers of a running training job."),
    "tasks": ("simulator.task_pool", "List the curriculum's task pool with statistics and lineage (a live job's, or a finished run's with --run DIR)."),
    "monitor": ("infra.run.monitoring", "Print a run's live Prometheus scrape targets and whether each answers."),
    "dashboards": ("infra.dashboards", "Write the Grafana dashboards and scrape config, or push them to a running Grafana."),
    "report": ("infra.run.report", "Regenerate a finished run's PNG plots and markdown summary (optionally from Prometheus)."),
}

# Commands whose arguments live in a lighter module than the one that runs them. Such a
# module has `add_arguments(parser)` and may have `check(args)` (raises UsageError).
ARGUMENTS: dict[str, str] = {
    "train": "infra.run.train_args",
}

SETTINGS_EPILOG = ("settings: `dreamgym config --describe` lists every one with its type, default and help "
                   "(also docs/configuration.md); `dreamgym config PRESET [overrides]` prints the resolved config.")


def dreamgym_version() -> str:
    try:
        return version("dreamgym")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def setup_logging(verbose: bool = False, quiet: bool = False) -> None:
    # Logs go to stderr so that stdout carries only a command's result (tables, --json).
    handler = RichHandler(console=Console(stderr=True), rich_tracebacks=True, show_path=False)
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(name)s: %(message)s", datefmt="%H:%M:%S", handlers=[handler])
    for noisy in ("httpx", "urllib3", "filelock", "asyncio", "selenium", "transformers", "sentence_transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def add_logging_flags(parser: argparse.ArgumentParser, default: object = None) -> None:
    """-v/-q on the top-level parser and on every command's (so both `dreamgym -v train` and
    `dreamgym train -v` work); a command's own default is SUPPRESS so it never undoes the top-level one."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", action="store_true", default=default, help="debug logging")
    group.add_argument("-q", "--quiet", action="store_true", default=default, help="warnings and errors only")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dreamgym",
        description="DreamGym: train LLM agents with RL on synthesized experience.",
        epilog="Run `dreamgym <command> --help` for a command's options; `dreamgym config --describe` lists every "
               "setting.",
    )
    parser.add_argument("--version", action="version", version=f"dreamgym {dreamgym_version()}")
    add_logging_flags(parser, default=False)
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text.replace("%", "%%"), add_help=False)
    return parser


def module_doc(module_name: str) -> str:
    """A module's docstring read from its source, without importing it (and its torch)."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin:
        return ""
    with open(spec.origin, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def command_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    """The parser of one command and the module that declared its arguments."""
    module_name, help_text = COMMANDS[name]
    declares = importlib.import_module(ARGUMENTS.get(name, module_name))
    p = argparse.ArgumentParser(prog=f"dreamgym {name}", description=(module_doc(module_name) or help_text).strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    declares.add_arguments(p)
    add_logging_flags(p, default=argparse.SUPPRESS)
    if any(a.dest == "overrides" for a in p._actions):  # a command that takes a config
        p.epilog = SETTINGS_EPILOG
    return p, declares


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Parse the command name first; only that command's module is imported.
    top, rest = parser.parse_known_args(argv)
    if not top.command:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")  # usage and one line, exit 2
        parser.print_help()
        return 0
    sub, declares = command_parser(top.command)
    args = sub.parse_intermixed_args(rest)  # overrides may come before or after --options
    verbose, quiet = top.verbose or getattr(args, "verbose", False), top.quiet or getattr(args, "quiet", False)
    if verbose and quiet:
        sub.error("-v/--verbose and -q/--quiet: choose one")
    setup_logging(verbose, quiet)
    try:
        if hasattr(declares, "check"):
            declares.check(args)
        module = importlib.import_module(COMMANDS[top.command][0])
        return int(module.run(args) or 0)
    except UsageError as exc:
        sub.print_usage(sys.stderr)
        print(f"dreamgym {top.command}: error: {exc}", file=sys.stderr)
        return 2
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
