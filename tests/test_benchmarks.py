"""The cheapest benchmarks run to the end against the current code and print their closing ratio.

A smoke check, not a measurement: tiny sizes, a shared CPU, figures ignored. It catches a
benchmark left behind by a refactor (an import or a metric renamed), which nothing else runs.
The RL-phase benchmark runs here on the tiny random model for 10 s. The costlier ones (engine,
learner, soak, retrieval, curriculum) are run by hand with the smoke sizes their docstrings give.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow]


def run_benchmark(script: str, *args: str, timeout: float = 120) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_stream_throughput_runs_and_prints_its_ratio():
    out = run_benchmark("stream_throughput.py", "--n", "200")
    assert "ours / raw XADD ratio:" in out.splitlines()[-1]
    assert "load " in out


@pytest.mark.ray
def test_async_vs_sync_runs_and_prints_its_ratio():
    out = run_benchmark("async_vs_sync.py", "--workers", "2", "--updates", "2", "--groups", "2", "--group-size", "2",
                        "--update-s", "0.05")
    assert "async/sync throughput ratio:" in out.splitlines()[-1]
    assert "load " in out


def test_rl_throughput_runs_and_prints_each_engines_counters(tiny_run, tiny_dir):
    """The RL-phase benchmark end to end on the tiny model (as Mexp and policy, so no SFT): its table
    and, under the setting, each embedded engine's counters read from that engine's /metrics."""
    out = run_benchmark("rl_throughput.py", "--settings", "new", "--seconds", "10", "--mexp", str(tiny_dir), "--set",
                        *tiny_run, "actors.env_kind=synthetic", "learner.algo=ppo", timeout=300)
    engines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and " engine: " in line}
    assert set(engines) == {"mexp", "policy"}, out
    mexp = engines["mexp"].split()
    assert int(mexp[2]) > 0 and int(mexp[4]) > 0, engines["mexp"]  # requests served, tokens generated
    assert "mean forward batch" in engines["mexp"] and "load(1m) at end" in out
    assert any(line.startswith("  set aside by the learner: ") for line in out.splitlines()), out
