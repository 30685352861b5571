"""The checks a config field may carry: (predicate, what a good value is), as `infra/config.py`'s `_f`
takes them, plus the ones that look outside the config (a plug-in environment's import path, a
weights root against the home directory). Kernel: imports nothing of the project."""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import os
import re
import sys
from typing import Any, Callable
from urllib.parse import urlsplit


POSITIVE = (lambda v: v > 0, "a number > 0")
NON_NEGATIVE = (lambda v: v >= 0, "a number >= 0")
UNIT = (lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
PORT = (lambda v: 0 <= v <= 65535, "a port in [0, 65535]")
NON_EMPTY = (lambda v: bool(v.strip()), "a non-empty string")
ENDPOINTS = (lambda v: all(isinstance(e, str) and urlsplit(e).scheme in ("http", "https") and bool(urlsplit(e).hostname)
                           for e in v),
             "a list of http(s)://host[:port] URLs (no null or empty entries)")
RESOURCES = (lambda v: all(isinstance(k, str) and k and isinstance(n, (int, float)) and not isinstance(n, bool)
                           and math.isfinite(n) and n >= 0 for k, n in v.items()),
             "a mapping of resource names to finite amounts >= 0")


def _narrow_root(v: str) -> bool:
    """Not '/' and not the home directory or one of its ancestors: such a root lets an engine load from
    nearly anywhere, which switches the weights path guard off."""
    if not v:
        return True
    real, home = os.path.realpath(os.path.expanduser(v)), os.path.realpath(os.path.expanduser("~"))
    return real != os.path.sep and os.path.commonpath([real, home]) != real


WEIGHTS_ROOT = (_narrow_root, "empty, or a directory other than '/' that is not the home directory or above it")

DEVICE = (lambda v: isinstance(v, str) and (v in ("cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit())),
          "'cpu', 'cuda' or 'cuda:N'")


def _one_of(*choices: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in choices, "one of " + ", ".join(repr(c) for c in choices))


# Query parameters whose value is a secret (redis-py reads `?password=`; others carry tokens).
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|auth|key", re.IGNORECASE)


def _subset_of(*choices: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: isinstance(v, list) and all(x in choices for x in v), "a list of " + ", ".join(repr(c) for c in choices))


BUILTIN_FAMILIES = ("textworld", "miniwob", "alfworld", "browsergym")
ENV_ENTRY_POINTS = "dreamgym.envs"  # the entry-point group of installed environment plug-ins


def _env_family_ok(v: str) -> bool:
    """A built-in family (or one of its task families), `gym:<id>`, an importable `module:Attr`, or an
    installed `dreamgym.envs` entry point; the import itself is actors/envs/registry.py's (plugin_class)."""
    f = v.strip()
    if f.lower() in BUILTIN_FAMILIES or f.lower().startswith(("miniwob/", "browsergym/", "alfworld/", "tw-", "custom")):
        return True
    if f.startswith("gym:"):
        return len(f) > 4
    if ":" in f:
        module, _, attr = f.partition(":")
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError:
            if os.getcwd() in sys.path:
                return False
            sys.path.insert(0, os.getcwd())  # a checkout's own package (examples/), as `python -m` finds it
            try:
                obj = importlib.import_module(module)
            except ModuleNotFoundError:
                return False
        for part in attr.split("."):
            obj = getattr(obj, part)  # AttributeError: the check fails
        return True
    return any(ep.name == f for ep in importlib.metadata.entry_points(group=ENV_ENTRY_POINTS))


ENV_FAMILY = (_env_family_ok, "one of " + ", ".join(repr(c) for c in BUILTIN_FAMILIES)
              + ", an importable 'package.module:Class', 'gym:<gymnasium id>' or an installed "
              + repr(ENV_ENTRY_POINTS) + " entry point")
