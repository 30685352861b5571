"""Real environments out of process (actors/envs/env_process.py, issue 63 part 1): a bad game file is
refused with its path when loaded, and a crash (exit, SIGSEGV) or a hang of an environment costs its
episode only, through `dreamgym eval` and `dreamgym collect`, with the rest played and the report written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from actors.dataset import read_trajectories, trajectories_path
from actors.envs.env_process import EnvProcess, EnvTimeout, Isolation
from actors.envs.registry import make_env
from actors.envs.textworld_env import TextWorldEnv, game_file_problem, generate_game, tasks_from_games
from actors.evaluate import EXIT_BAD_TASKS
from infra.config import load_config
from infra.schema import Task
from tests.faulty_env import FAMILY

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "infra.cli"]


@pytest.fixture(scope="module")
def good_game(tmp_path_factory) -> Path:
    # the games directory of tests/test_envs_textworld.py's data dir: made once a session, shared
    return generate_game("custom", 0, tmp_path_factory.getbasetemp() / "tw-data" / "textworld" / "games")


def _game_dir(tmp_path: Path, good: Path) -> dict[str, Path]:
    """A directory with the good game and three bad ones beside it (each bad in one way)."""
    d = tmp_path / "games"
    d.mkdir()
    out = {}
    for name in ("good", "corrupt", "truncated", "nojson"):
        z8 = d / f"{name}.z8"
        shutil.copy(good, z8)
        if name != "nojson":
            shutil.copy(good.with_suffix(".json"), z8.with_suffix(".json"))
        out[name] = z8
    data = bytearray(out["corrupt"].read_bytes())
    data[0] = 0x4A  # TextWorld's interpreter: "Fatal error: Unknown Z-code version", then exit() from C
    out["corrupt"].write_bytes(bytes(data))
    out["truncated"].write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    return out


def test_bad_game_files_are_named_in_one_line(tmp_path, good_game):
    games = _game_dir(tmp_path, good_game)
    assert game_file_problem(games["good"]) is None
    corrupt, truncated, nojson = (game_file_problem(games[k]) for k in ("corrupt", "truncated", "nojson"))
    assert str(games["corrupt"]) in corrupt and "version byte 74" in corrupt
    assert str(games["truncated"]) in truncated and "truncated" in truncated
    assert str(games["nojson"]) in nojson and "nojson.json" in nojson
    assert all("\n" not in p for p in (corrupt, truncated, nojson))
    assert "no such game file" in game_file_problem(tmp_path / "absent.z8")
    tiny = tmp_path / "tiny.z8"
    tiny.write_bytes(b"\x08" * 10)
    assert "shorter than a Z-machine header" in game_file_problem(tiny)


def test_tasks_from_games_reads_the_good_one_in_a_child_and_marks_the_bad(tmp_path, good_game):
    games = _game_dir(tmp_path, good_game)
    tasks = {t.task_id: t for t in tasks_from_games(sorted(games.values()))}
    assert "refused" not in tasks["good"].meta and tasks["good"].instruction and tasks["good"].initial_state
    assert tasks["good"].meta["plan_length"] > 0
    for bad in ("corrupt", "truncated", "nojson"):
        assert str(games[bad]) in tasks[bad].meta["refused"]


def test_isolation_is_the_default_and_the_in_process_path_stays(tmp_path):
    cfg = load_config(None, [])
    iso = Isolation.from_config(cfg.actors)
    assert iso is not None and iso.step_timeout_s == cfg.actors.env_step_timeout_s == 60.0
    assert Isolation.from_config(load_config(None, ["actors.env_isolation=false"]).actors) is None
    assert isinstance(make_env("textworld", isolation=iso, max_steps=3), EnvProcess)
    assert isinstance(make_env("textworld", max_steps=3), TextWorldEnv)  # tests and the synthetic env's callers


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """The process has ended (a zombie awaiting its reaper counts as ended)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_what_an_environment_started_ends_with_its_child(tmp_path):
    """A browser environment's child starts Chromium: a pooled child ended at the run's end, and a child
    killed for a hang, take what they started with them (a full suite used to leave Chromium trees)."""
    iso = Isolation(step_timeout_s=3.0)
    env = EnvProcess(FAMILY, isolation=iso)
    _, info = env.reset_sync(Task(task_id="spawn-1", instruction="finish", family=FAMILY))
    pooled = info["helper_pid"]
    env.close_sync()  # handed to the pool, still alive
    assert not _gone(pooled, 0.5)
    iso.close()  # the run's end
    assert _gone(pooled)

    env = EnvProcess(FAMILY, isolation=iso)
    _, info = env.reset_sync(Task(task_id="spawnhang-1", instruction="finish", family=FAMILY))
    with pytest.raises(EnvTimeout):
        env.step_sync("finish")
    assert _gone(info["helper_pid"])
    env.close_sync()


@pytest.mark.slow
def test_eval_plays_the_good_game_and_names_each_bad_one(tmp_path, good_game):
    games = _game_dir(tmp_path, good_game)
    out = tmp_path / "report.json"
    proc = subprocess.run([*CLI, "eval", "--tasks", str(games["good"].parent), "--out", str(out),
                           f"infra.run_dir={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == EXIT_BAD_TASKS, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Fatal error" not in proc.stdout + proc.stderr
    for bad in ("corrupt", "truncated", "nojson"):
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("refused:") and str(games[bad]) in ln)
        assert {"corrupt": "version byte", "truncated": "truncated", "nojson": "nojson.json"}[bad] in line
    report = json.loads(out.read_text())
    assert report["episodes"] == 1 and report["successes"] == 1 and report["per_task"][0]["task_id"] == "good"
    assert sorted(b["game_file"] for b in report["bad_tasks"]) == sorted(str(games[k]) for k in
                                                                         ("corrupt", "truncated", "nojson"))
    assert {b["reason"] for b in report["bad_tasks"]} == {"refused_at_load"}


@pytest.mark.faults
@pytest.mark.slow
def test_eval_a_crash_a_segfault_and_a_hang_cost_their_episodes_only(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([*CLI, "eval", "--family", FAMILY, "--tasks", "ok-1,exit-1,segv-1,hang-1,ok-2",
                           "--episodes", "3", "--out", str(out), "actors.env_step_timeout_s=2", "data.workers=1",
                           f"infra.run_dir={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == EXIT_BAD_TASKS, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    by_task: dict[str, list] = {}
    for row in report["per_task"]:
        by_task.setdefault(row["task_id"], []).append((row["status"], row["env_error"]))
    assert by_task["ok-1"] == by_task["ok-2"] == [("success", "")] * 3
    # two crashes or hangs each, then the task is refused without a process (actors.env_max_crashes=2)
    assert by_task["exit-1"] == [("env_error", "env_crash")] * 2 + [("env_error", "env_refused")]
    assert by_task["segv-1"] == [("env_error", "env_crash")] * 2 + [("env_error", "env_refused")]
    assert by_task["hang-1"] == [("env_error", "env_timeout")] * 2 + [("env_error", "env_refused")]
    assert report["successes"] == 6 and report["env_errors"] == 9
    assert "bad task: hang-1  (env_timeout, 2 episodes)" in proc.stdout
    assert "killed by SIGSEGV" in proc.stderr


@pytest.mark.faults
@pytest.mark.slow
def test_collect_writes_the_good_tasks_and_names_the_crashing_ones(tmp_path):
    proc = subprocess.run([*CLI, "collect", "--family", FAMILY, "--out", str(tmp_path), "data.env_tasks=4",
                           "data.env_heldout=1", "data.policies=[expert]", "data.episodes_per_task=1",
                           "data.workers=1", "actors.env_step_timeout_s=2"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trajs = read_trajectories(trajectories_path(tmp_path, FAMILY))
    assert sorted(t.task_id for t in trajs) == ["ok-1", "ok-2"] and all(t.success for t in trajs)
    assert "bad task: exit-1  (env_crash)" in proc.stdout and "bad task: hang-1  (env_timeout)" in proc.stdout


@pytest.mark.slow
def test_a_truncated_cached_game_is_made_again_before_collect_or_train_loads_it(tmp_path, good_game):
    """The splits that `collect` and `train` make read games from the cache; a cached file that fails the
    load-time check (a copy cut short) is generated again rather than handed to the interpreter."""
    games = tmp_path / "textworld" / "games"
    games.mkdir(parents=True)
    cached = games / good_game.name
    cached.write_bytes(good_game.read_bytes()[:1000])
    shutil.copy(good_game.with_suffix(".json"), cached.with_suffix(".json"))
    assert "truncated" in game_file_problem(cached)
    assert generate_game("custom", 0, games) == cached
    assert game_file_problem(cached) is None and cached.read_bytes() == good_game.read_bytes()  # tw-make is seeded


@pytest.mark.faults
@pytest.mark.slow
def test_train_collects_its_offline_data_past_a_crashing_and_a_hanging_task(tmp_path, tiny_dir):
    """`dreamgym train`'s offline collection (infra/run/artifacts.py) plays its train tasks out of process:
    the crashing and the hanging one are named, the rest are collected, and the run goes on."""
    proc = subprocess.run([*CLI, "train", "--name", "faulty", "--no-eval", f"infra.run_dir={tmp_path / 'runs'}",
                           f"infra.data_dir={tmp_path / 'data'}", "infra.train_budget_s=5", f"engines.model={tiny_dir}",
                           "engines.max_batch_size=4", f"simulator.checkpoint={tiny_dir}", f"actors.env_family={FAMILY}",
                           "data.env_tasks=4", "data.env_heldout=1", "data.policies=[expert]",
                           "data.episodes_per_task=1", "data.workers=1", "actors.env_kind=real", "actors.num_workers=1",
                           "actors.group_size=2", "actors.max_steps=2", "learner.algo=ppo", "learner.total_updates=1",
                           "curriculum.variants_per_seed=0", "actors.env_step_timeout_s=2"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bad task: exit-1  (env_crash)" in proc.stdout and "bad task: hang-1  (env_timeout)" in proc.stdout
    assert "BrokenProcessPool" not in proc.stdout + proc.stderr
    trajs = read_trajectories(trajectories_path(tmp_path / "data", FAMILY))
    assert sorted(t.task_id for t in trajs) == ["ok-1", "ok-2"]
