"""`dreamgym config`: the resolved config, and every setting documented from its source.

Owns the rendering of the config dataclasses (infra/config.py) for people: the
resolved YAML of a preset with its overrides, `--describe` (every setting with its
type, default, help and check, by section) and `--markdown`, which is
docs/configuration.md. That file is generated, never written by hand: after adding
or changing a setting, run

    dreamgym config --markdown > docs/configuration.md

(tests/test_config.py fails while the committed file differs from this output).
Nothing here decides a value: loading and validation stay in infra/config.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import typing
from typing import Any

import yaml

from infra import presets
from infra.config import SECTIONS, Config, add_config_arguments, config_from_args, dump

DOC_PATH = "docs/configuration.md"
REGENERATE = f"dreamgym config --markdown > {DOC_PATH}"


@dataclasses.dataclass
class Setting:
    key: str  # section.name
    type: str
    default: Any
    doc: str
    check: str  # the human description of the field's check, "" when only its type is checked


def settings(section: str) -> list[Setting]:
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        typ = hints[f.name]
        check = f.metadata.get("check")
        out.append(Setting(f"{section}.{f.name}", getattr(typ, "__name__", str(typ)), default,
                           f.metadata.get("doc", ""), check[1] if check else ""))
    return out


def summary(section: str) -> str:
    return (SECTIONS[section].__doc__ or "").strip().splitlines()[0]


def describe(cfg: Config | None = None, only: str = "") -> str:
    """Every setting by section: `key: type = default  [check]`, then its help, indented.
    With `cfg`, a value that differs from the default is shown beside it (`now: ...`)."""
    now_values = yaml.safe_load(dump(cfg)) if cfg is not None else {}  # secrets redacted as in dump
    lines: list[str] = []
    for section in SECTIONS:
        if only and section != only:
            continue
        lines.append(f"{section}: {summary(section)}")
        for s in settings(section):
            head = f"  {s.key}: {s.type} = {s.default!r}"
            now = now_values.get(section, {}).get(s.key.split(".", 1)[1], s.default)
            if now != s.default:
                head += f"  (now: {now!r})"
            if s.check:
                head += f"  [{s.check}]"
            lines.append(head)
            lines.extend(textwrap.wrap(s.doc, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6)
                         or [" " * 6])
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _cell(text: str, code: bool = False) -> str:
    """Text for one table cell: pipes escaped, and outside code `<...>` (an HTML tag to a renderer) too."""
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if code else text.replace("<", "&lt;")


def markdown() -> str:
    """docs/configuration.md: a table of settings per section, in the dataclasses' order."""
    count = sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    lines = [
        "# Configuration",
        "",
        f"<!-- Generated from infra/config.py by `{REGENERATE}`; do not edit by hand. -->",
        "",
        f"Every one of DreamGym's {count} settings, with its type, default, check and help, generated from",
        "the config dataclasses in `infra/config.py` (the same text as `dreamgym config --describe`).",
        "",
        "A command that takes a config reads a preset, then `section.key=value` overrides:",
        "",
        "```bash",
        "dreamgym config quickstart learner.lr=1e-5     # print the resolved config (YAML)",
        "dreamgym train quickstart learner.lr=1e-5      # run with it",
        "```",
        "",
        "A preset is a YAML file with any of the sections below, a run directory (the `config.yaml` it",
        "ran with), or the name of a shipped preset, found from any directory: "
        + ", ".join(f"`{n}`" for n in presets.names()) + ".",
        "Values are checked when the config loads; an error names the key, the value and what was expected.",
        "",
        "Sections: " + ", ".join(f"[`{s}`](#{s})" for s in SECTIONS) + ".",
        "",
    ]
    for section in SECTIONS:
        lines += [f"## {section}", "", summary(section), "",
                  "| setting | type | default | check | help |", "|---|---|---|---|---|"]
        for s in settings(section):
            lines.append(f"| `{s.key}` | {s.type} | `{_cell(repr(s.default), code=True)}` | {_cell(s.check) or '-'} | "
                         f"{_cell(s.doc)} |")
        lines.append("")
    return "\n".join(lines)


# --- the `dreamgym config` command ----------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--describe", action="store_true",
                   help="every setting with its type, default, check and help, by section (with a preset: "
                        "values that differ from the default are shown beside it)")
    p.add_argument("--section", default="", choices=["", *SECTIONS], metavar="SECTION",
                   help="--describe only this section: " + ", ".join(SECTIONS))
    p.add_argument("--markdown", action="store_true", help=f"the settings as markdown: `{REGENERATE}`")
    p.add_argument("--presets", action="store_true", help="list the shipped presets, found by name from anywhere")


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        print(markdown(), end="")
        return 0
    if args.presets:
        for kind, command in (("train", "train, config, eval, collect, ..."), ("experiment", "experiment")):
            print(f"{command}:")
            for name in presets.names(kind):
                print(f"  {name:<24} {presets.resolve(name, kind)}")
        return 0
    cfg = config_from_args(args)
    if args.describe:
        print(describe(cfg if args.config or args.overrides else None, args.section), end="")
    else:
        print(dump(cfg), end="")
    return 0
