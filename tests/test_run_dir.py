"""A failed `dreamgym train` leaves no half-made run directory (issue 63), and never removes one it did not make."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "infra.cli"]


def _train(run_dir: Path, name: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([*CLI, "train", "configs/quickstart.yaml", "--name", name, f"infra.run_dir={run_dir}",
                           "infra.redis_url=redis://127.0.0.1:1/0"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)


def test_a_run_that_fails_at_start_leaves_no_run_directory(tmp_path):
    out = _train(tmp_path, "doomed")
    assert out.returncode != 0
    assert "127.0.0.1:1" in out.stderr + out.stdout  # it failed for the reason given, not another
    assert not (tmp_path / "doomed").exists(), sorted(p.name for p in (tmp_path / "doomed").iterdir())


def test_a_directory_the_run_did_not_make_stays(tmp_path):
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("the user's own file")
    out = _train(tmp_path, "mine")
    assert out.returncode != 0
    assert (keep / "notes.txt").read_text() == "the user's own file"
