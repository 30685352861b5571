"""`dreamgym experiment` across run directories: a regime run without its baseline, and runs finished on
other machines or in other sittings pooled into one table (`--pool`), through the CLI as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.config import dump
from infra.run.experiment import load_experiment, regime_named, selected, unpaired


def test_a_regime_run_without_its_baseline_says_its_row_is_unpaired(tmp_path):
    """`--only rl` where rl compares to an sft that has not run: the runner says the row will carry no
    paired difference and how to get one, before anything runs; once sft has run it says nothing."""
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"infra": {"run_dir": str(tmp_path / "runs"), "data_dir": str(tmp_path / "data")}}))
    spec = tmp_path / "exp.yaml"
    spec.write_text(yaml.safe_dump({"name": "solo", "base": str(base), "compare_to": "sft", "regimes": {
        "sft": {"overrides": ["learner.total_updates=0"]}, "rl": {}}}, sort_keys=False))
    exp = load_experiment(spec)
    assert unpaired(exp, selected(exp, ["rl"])) == {"rl": "sft"}
    assert unpaired(exp, selected(exp, [])) == {}  # the baseline is in the run
    runs = tmp_path / "runs" / "solo"
    (runs / "anchors").mkdir(parents=True)  # the scripted choosers' cache: no game is played here
    for policy in ("random", "expert"):
        (runs / "anchors" / f"{policy}.json").write_text(json.dumps(
            {"success_rate": 0.25, "ci_low": 0.1, "ci_high": 0.4, "episodes": 4, "mean_steps": 3.0}))
    per_task = [{"task_id": f"g{i}", "success": True} for i in range(4)]
    for name in ("rl", "sft"):
        (runs / name).mkdir()
        (runs / name / "summary.json").write_text(json.dumps({"heldout_after": {
            "success_rate": 1.0, "episodes": 4, "successes": 4, "per_task": per_task}}))
        if name == "rl":  # sft has not run yet
            cmd = [sys.executable, "-m", "infra.cli", "experiment", str(spec), "--only", "rl", "--report"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr[-2000:]
            said = " ".join(out.stdout.split())
            assert "rl is compared to sft, which has not run" in said and "add sft to --only" in said
    assert unpaired(exp, selected(exp, ["rl"])) == {}


def test_runs_from_other_machines_pool_into_the_results_and_the_claims(tmp_path):
    """`dreamgym experiment --report --pool DIR` as a user runs it with another machine's run directory copied
    beside this one: that machine's finished runs of the same settings count as runs of their regimes (a
    location setting such as infra.run_dir may differ), a run under other settings does not, the table says
    where each ran, and the claims are judged on the pooled runs."""
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"infra": {"run_dir": str(tmp_path / "runs"), "data_dir": str(tmp_path / "data")}}))
    spec = tmp_path / "exp.yaml"
    spec.write_text(yaml.safe_dump({"name": "pool", "base": str(base), "compare_to": "sft",
                                    "claims": {"sft": "sft", "dreamgym": "rl", "repeats_needed": 2},
                                    "regimes": {"sft": {"overrides": ["learner.total_updates=0"]}, "rl": {}}},
                                   sort_keys=False))
    exp = load_experiment(spec)
    here, other = tmp_path / "runs" / "pool", tmp_path / "copied" / "pool"

    def ran(where: Path, name: str, wins: list[int], **changed: Any) -> None:
        (where / name).mkdir(parents=True)
        per_task = [{"task_id": f"g{i}", "success": bool(x)} for i, x in enumerate(wins)]
        (where / name / "summary.json").write_text(json.dumps({"heldout_after": {
            "success_rate": sum(wins) / len(wins), "episodes": len(wins), "successes": sum(wins),
            "per_task": per_task}}))
        cfg = yaml.safe_load(dump(exp.config(regime_named(exp, name))))
        cfg["infra"]["run_dir"] = "/another/machine/runs/pool"  # where it wrote, not how it ran
        for key, value in changed.items():
            section, k = key.split("__")
            cfg[section][k] = value
        (where / name / "config.yaml").write_text(yaml.safe_dump(cfg))

    ran(here, "sft", [0] * 12 + [1] * 12)
    ran(here, "rl", [1] * 22 + [0] * 2)
    ran(other, "sft", [0] * 11 + [1] * 13)
    ran(other, "rl", [1] * 20 + [0] * 4)
    ran(other, "rl.r2", [0] * 24, learner__lr=0.123)  # another recipe: not one of rl's runs
    (here / "anchors").mkdir()  # the scripted choosers' cache: no game is played here
    for policy in ("random", "expert"):
        (here / "anchors" / f"{policy}.json").write_text(json.dumps(
            {"success_rate": 0.25, "ci_low": 0.1, "ci_high": 0.4, "episodes": 24, "mean_steps": 3.0}))
    cmd = [sys.executable, "-m", "infra.cli", "experiment", str(spec), "--report"]
    alone = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr[-2000:]
    res = json.loads((here / "results.json").read_text())
    assert res["claims"][0]["status"] == "undecided" and res["pooled"] == []  # one run of rl, two needed
    out = subprocess.run([*cmd, "--pool", str(other)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((here / "results.json").read_text())
    rows = {r["regime"]: r for r in res["regimes"]}
    assert rows["rl"]["runs"] == [22 / 24, 20 / 24] and rows["sft"]["runs"] == [12 / 24, 13 / 24]
    assert rows["rl"]["run_sittings"] == ["", str(other)] and res["pooled"] == [str(other)]
    assert rows["rl"]["diff"] == pytest.approx(42 / 48 - 25 / 48)
    assert res["claims"][0]["status"] == "met", res["claims"][0]
    md = (here / "results.md").read_text()
    assert f"| run 1 (seed 0) | {other}: seed 0 |" in md and f"(`--pool`): {other}." in md
    again = subprocess.run([*cmd, "--pool", str(other), str(here)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "repeats a run already counted" in again.stdout + again.stderr
    assert json.loads((here / "results.json").read_text())["regimes"][1]["runs"] == [22 / 24, 20 / 24]  # once each
    missing = subprocess.run([*cmd, "--pool", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "is not a directory" in missing.stdout + missing.stderr
