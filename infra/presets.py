"""The shipped presets: `configs/` found by name from any directory.

Owns how a config argument names a YAML file. `configs/` sits at the top of the
repository and is installed as the package `configs` beside `infra` (package data in
pyproject.toml), so the presets are the sibling directory of this package in a
checkout, an editable install and a wheel alike; no current directory is assumed.

A spec resolves, first match wins:
1. a path that exists (relative to the current directory, or absolute): itself, so a
   user's own file always wins over a shipped one of the same name;
2. a bare name (`quickstart`, `quickstart.yaml`): the shipped preset of that name, for
   a train config `configs/<name>.yaml` then `configs/experiments/base/<name>.yaml`,
   for an experiment file `configs/experiments/<name>.yaml`;
3. a path under `configs/` that is not in the current directory
   (`configs/experiments/base/textworld_cpu.yaml`, as experiment files name their
   base): the shipped file at that path.
Anything else is returned as given, and the caller reports it missing with `names()`.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "configs"
# Where a bare name is looked up, per kind of file, in order.
SEARCH = {"train": ("", "experiments/base"), "experiment": ("experiments",)}


def names(kind: str = "train") -> list[str]:
    """The shipped presets of a kind, by the name that finds them."""
    found: list[str] = []
    for sub in SEARCH[kind]:
        found.extend(p.stem for p in sorted((ROOT / sub).glob("*.yaml")) if p.stem not in found)
    return found


def resolve(spec: str | Path, kind: str = "train") -> Path:
    """The file `spec` names (see the module docstring); `spec` itself when nothing matches."""
    p = Path(spec)
    if p.exists():
        return p
    if len(p.parts) == 1 and p.suffix in ("", ".yaml", ".yml"):
        for sub in SEARCH[kind]:
            shipped = ROOT / sub / (p.stem + ".yaml")
            if shipped.is_file():
                return shipped
    elif not p.is_absolute() and len(p.parts) > 1 and p.parts[0] == "configs":
        shipped = ROOT.joinpath(*p.parts[1:])
        if shipped.exists():
            return shipped
    return p
