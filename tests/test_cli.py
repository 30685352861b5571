"""The dreamgym command line: help everywhere, status against a real Redis, config errors named."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from infra import schema
from infra.cli import COMMANDS
from infra.schema import Task
from infra.streams import StreamConsumer, StreamProducer, connect, tasks_stream

CLI = [sys.executable, "-m", "infra.cli"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="200")
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_top_level_help_lists_every_command():
    out = _run("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command):
    out = _run(command, "--help")
    assert out.returncode == 0, out.stderr
    assert f"dreamgym {command}" in out.stdout


def test_status_reports_streams_pending_and_dead_letters(redis_url):
    async def seed() -> None:
        client = connect(redis_url)
        stream = tasks_stream("dreamgym")
        await StreamProducer(client, stream).add([schema.encode(Task(f"t{i}", "x")) for i in range(3)] + [b"junk"])
        consumer = StreamConsumer(client, stream, "workers", "w0", schema.decode)
        await consumer.ensure_group()
        await consumer.read(count=10, block_ms=10)
        await client.aclose()

    asyncio.run(seed())
    out = _run("status", "--redis-url", redis_url, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    tasks = report["streams"][0]
    assert report["reachable"] and tasks["length"] == 4 and tasks["dead_letters"] == 1
    assert tasks["groups"][0]["pending"] == 3
    table = _run("status", "--redis-url", redis_url)
    assert "dreamgym:tasks" in table.stdout


def test_status_never_cuts_a_stream_name_short(redis_url):
    # an experiment's regime names its streams (dreamgym:dreamgym_grpo:tasks); 80 columns must show them whole
    env = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="80")
    out = subprocess.run([*CLI, "status", "--redis-url", redis_url, "--prefix", "dreamgym:dreamgym_s2r_strong_mexp480"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "dreamgym:dreamgym_s2r_strong_mexp480:tasks" in out.stdout, out.stdout
    assert "dreamgym:dreamgym_s2r_strong_mexp480:trajectories" in out.stdout, out.stdout


def test_status_unreachable_exits_nonzero():
    out = _run("status", "--redis-url", "redis://127.0.0.1:1/0")
    assert out.returncode == 1 and "unreachable" in out.stdout


@pytest.mark.parametrize("args", [["tasks"], ["scale", "--workers", "2"],
                                  ["tasks", "infra.redis_url=redis://:secret@127.0.0.1:1/0"]])
def test_commands_on_an_unreachable_redis_print_one_line_and_fail(args, tmp_path):
    """No traceback and no 120 s of retries: one line naming the URL (never its password), exit 3."""
    url = ["infra.redis_url=redis://127.0.0.1:1/0"] if not any("redis_url" in a for a in args) else []
    out = _run(*args, *url, f"infra.run_dir={tmp_path}", timeout=60)
    assert out.returncode == 3, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"dreamgym {args[0]}: cannot reach Redis at redis://") and "127.0.0.1:1" in lines[0]
    assert "secret" not in out.stderr


def test_config_error_names_the_key():
    out = _run("status", "configs/quickstart.yaml", "learner.lr=oops", "--redis-url", "redis://127.0.0.1:1/0")
    assert out.returncode == 2
    assert "learner.lr" in out.stderr and "'oops'" in out.stderr


# ----- conventions: --version, usage errors exit 2 with one error line, -v/-q anywhere -----
DREAMGYM = os.path.join(os.path.dirname(sys.executable), "dreamgym")  # the installed entry point


def _main_then(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run the in-process main in a fresh interpreter, then `code` (which sees `rc`)."""
    prog = f"import logging, sys\nfrom infra.cli import main\nrc = main(sys.argv[1:])\n{code}"
    return subprocess.run([sys.executable, "-c", prog, *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="200"))


def test_version_comes_from_the_package_metadata():
    from importlib.metadata import version
    out = subprocess.run([DREAMGYM, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"dreamgym {version('dreamgym')}"


@pytest.mark.parametrize("args, where", [(["--bogus"], "dreamgym"), (["train", "--bogus"], "dreamgym train"),
                                         (["config", "--describe", "--section", "nope"], "dreamgym config")])
def test_an_unknown_option_prints_the_usage_and_one_error_line(args, where):
    out = _run(*args)
    assert out.returncode == 2 and out.stdout == "", out.stdout[-500:]
    errors = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and errors[0].startswith(f"{where}: error: "), out.stderr
    assert out.stderr.startswith(f"usage: {where} ") and "Traceback" not in out.stderr


@pytest.mark.parametrize("flags, level", [(["-v", "config"], "DEBUG"), (["config", "-v"], "DEBUG"),
                                          (["config", "--verbose", "quickstart"], "DEBUG"),
                                          (["config", "-q"], "WARNING"), (["-q", "config"], "WARNING"),
                                          (["config"], "INFO")])
def test_verbose_and_quiet_go_before_or_after_the_command(flags, level):
    out = _main_then("print('LEVEL', logging.getLevelName(logging.getLogger().level), rc)", *flags)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == f"LEVEL {level} 0"


def test_verbose_and_quiet_together_are_a_usage_error():
    out = _run("config", "-v", "-q")
    assert out.returncode == 2 and "dreamgym config: error:" in out.stderr


def test_resume_without_a_name_is_a_usage_error_found_before_torch_loads():
    out = _main_then("print('HEAVY', sorted({'torch', 'ray', 'transformers'} & set(sys.modules)), rc)",
                     "train", "--resume")
    assert out.stdout.splitlines()[-1] == "HEAVY [] 2", out.stdout + out.stderr[-2000:]
    assert "dreamgym train: error: --resume needs --name" in out.stderr and "usage: dreamgym train" in out.stderr


def test_train_help_imports_neither_torch_nor_ray_and_points_to_every_setting():
    out = _main_then("", "train", "--help")  # argparse exits 0 after the help
    assert out.returncode == 0 and "--resume" in out.stdout and "`dreamgym config --describe`" in out.stdout
    assert "reads like the architecture diagram" in out.stdout  # the driver's docstring, read from its source
    check = subprocess.run([sys.executable, "-c", "import sys\nfrom infra.cli import main\ntry:\n main(['train', "
                            "'--help'])\nexcept SystemExit:\n pass\nprint(sorted({'torch', 'ray', 'transformers'} & "
                            "set(sys.modules)))"], capture_output=True, text=True, timeout=120)
    assert check.stdout.splitlines()[-1] == "[]", check.stdout[-500:] + check.stderr[-2000:]


# ----- `dreamgym config`: the resolved config and every setting, from any directory -----
def test_config_prints_the_resolved_preset_from_another_directory(tmp_path):
    import yaml

    from infra.config import load_config
    out = subprocess.run([DREAMGYM, "config", "quickstart", "learner.lr=3e-5"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    expected = load_config("quickstart", ["learner.lr=3e-5"]).to_dict()
    assert printed["learner"]["lr"] == 3e-5 and printed["actors"] == expected["actors"]
    assert printed["data"]["textworld_games"] == expected["data"]["textworld_games"] != 24  # the preset's, not the default
    missing = subprocess.run([DREAMGYM, "config", "configs/quickstart.yaml.bak"], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
    assert missing.returncode == 2 and "config error" in missing.stderr and "quickstart" in missing.stderr


def test_config_describe_lists_every_setting_with_its_help():
    out = _run("config", "--describe")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    i = lines.index("  learner.lr: float = 1e-05  [a number > 0]")
    assert lines[i + 1].strip() == "AdamW learning rate."
    assert "  actors.num_workers: int = " in out.stdout and "engines:" in lines[lines.index("") + 1]
    assert sum(1 for ln in lines if ln.startswith("  ") and not ln.startswith("      ")) > 150


def test_experiment_finds_a_shipped_experiment_by_name_from_another_directory(tmp_path):
    out = subprocess.run([DREAMGYM, "experiment", "textworld_cpu", "--list"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="200"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:3] == ["base", "to", "run"] and "dreamgym_grpo" in out.stdout


# ----- --checkpoint runs/<name>: the policy the run evaluated, SFT and base included -----
def test_a_run_dir_resolves_to_the_policy_it_evaluated(tmp_path):
    from learner.weights import record_start, resolve_model, version_path
    warm = tmp_path / "data" / "policy_sft" / "abc"  # a warm start in its cache, as learner/policy_sft.py writes it
    warm.mkdir(parents=True)
    (warm / "config.json").write_text("{}")
    sft, base, rl = (tmp_path / "runs" / "exp" / r for r in ("sft", "base", "rl"))
    record_start(sft, str(warm))
    record_start(base, "smollm2")
    record_start(rl, str(warm))
    for v in (1, 2):  # an RL run published versions: its latest is what it evaluated
        version_path(rl, v).mkdir(parents=True)
    assert resolve_model(sft) == str(warm.resolve())
    assert resolve_model(base) == "smollm2"
    assert resolve_model(rl) == str(version_path(rl, 2))
    (warm / "config.json").unlink()
    warm.rmdir()
    with pytest.raises(FileNotFoundError, match="is gone"):
        resolve_model(sft)
    with pytest.raises(FileNotFoundError, match="policy.json"):
        resolve_model(tmp_path / "runs" / "exp")  # a directory that is no run


@pytest.mark.slow
async def test_sft_and_base_runs_resolve_through_eval_checkpoint(tiny_run, tiny_dir, tmp_path):
    """The base and SFT regimes publish no weights (learner.total_updates=0); their run directories still
    name the policy they evaluated, and `dreamgym eval --policy checkpoint --checkpoint <run>` serves it."""
    from infra.config import load_config
    from infra.run.driver import train
    from learner import policy_sft
    from learner.weights import published_versions, resolve_model

    sft_cfg = load_config(None, [*tiny_run, "learner.total_updates=0", "learner.warm_start_steps=1",
                                 "learner.warm_start_batch=2"])
    await train(sft_cfg, "sft")
    base_cfg = load_config(None, [*tiny_run, "learner.total_updates=0", "learner.warm_start_steps=0"])
    await train(base_cfg, "base")
    runs = tmp_path / "runs"
    assert published_versions(runs / "sft") == [] and published_versions(runs / "base") == []
    assert resolve_model(runs / "sft") == str(policy_sft.cache_dir(sft_cfg).resolve())  # the warm start, in its cache
    assert resolve_model(runs / "base") == str(tiny_dir.resolve())
    out = subprocess.run([*CLI, "eval", str(runs / "sft"), "--policy", "checkpoint", "--checkpoint", str(runs / "sft"),
                          "--limit", "1", "--out", str(tmp_path / "eval.json")], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert json.loads((tmp_path / "eval.json").read_text())["episodes"] == 1


def test_train_finds_the_quickstart_by_name_from_another_directory(tmp_path):
    """`dreamgym train quickstart` outside a checkout: the preset loads (the bad override is what fails, exit 2)."""
    out = subprocess.run([DREAMGYM, "train", "quickstart", "learner.lr=oops"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 2, out.stderr[-2000:]
    assert "learner.lr" in out.stderr and "'oops'" in out.stderr and "does not exist" not in out.stderr
    assert not (tmp_path / "runs").exists()
