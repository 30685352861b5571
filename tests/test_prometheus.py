"""A real Prometheus scrapes a tiny `dreamgym train` run, and every dashboard panel's PromQL returns data.

Debian's `prometheus` (installed by `bash infra/setup.sh --prometheus`, which `--browser`
implies) is started on a free port with a temporary config whose only scrape job
discovers targets from `<runs>/_prometheus/*.json` (file_sd), as the shipped
infra/dashboards/prometheus.yml does. The run is the CLI itself, in a
subprocess, on real TextWorld games with the embedded engines serving the tiny random
Llama of conftest (as policy and Mexp) and the real learner, with `infra.metrics_port` set
and the live fidelity probe on. While it runs, Prometheus must see the driver and both
embedded engines up; afterwards every panel of every dashboard (infra/dashboards.py) is
run as a range query over the run's window through Prometheus's HTTP API and must
return at least one series with samples. A junk entry on the trajectory stream makes
the dead-letter panel show a real reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis

from infra.dashboards import DASHBOARDS, panels
from infra.run import prometheus
from infra.streams import DATA_FIELD, trajectories_stream

pytestmark = [pytest.mark.slow, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prometheus_server(tmp_path):
    """(url, runs dir) of a private Prometheus that discovers every run under the runs dir, scraping each second."""
    if PROMETHEUS is None:
        pytest.skip("the prometheus binary is not on PATH: `bash infra/setup.sh --prometheus` installs Debian's")
    runs = tmp_path / "runs"
    (runs / "_prometheus").mkdir(parents=True)  # Prometheus watches the directory from its start
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: dreamgym\n"
                   f"    file_sd_configs:\n      - files: ['{runs}/_prometheus/*.json']\n"
                   "        refresh_interval: 1s\n")
    port = _free_port()
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"prometheus did not start: {(tmp_path / 'prometheus.log').read_text()}")
                time.sleep(0.3)
        yield url, runs
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _train_cmd(runs: Path, data: Path, redis_url: str, metrics_port: int, name: str, model: Path) -> list[str]:
    # --sync: roll out, then train, so the learner's update is not starved of the two cores by the engines.
    return [sys.executable, "-m", "infra.cli", "train", "--name", name, "--sync",
            f"infra.run_dir={runs}", f"infra.data_dir={data}", f"infra.redis_url={redis_url}",
            f"infra.metrics_port={metrics_port}", "infra.metrics_linger_s=4", "infra.train_budget_s=600",
            f"engines.model={model}", "engines.max_batch_size=4", f"simulator.checkpoint={model}",
            "simulator.fidelity_every=1", "simulator.fidelity_probe_steps=1", "simulator.max_new_tokens=48",
            "simulator.parse_retries=0",
            "data.textworld_games=2", "data.textworld_heldout=1", "data.textworld_families=[custom]",
            "data.policies=[expert]", "data.episodes_per_task=1", "data.workers=1",
            "actors.env_kind=real", "actors.num_workers=1", "actors.group_size=2", "actors.concurrent_episodes=2",
            "actors.max_steps=2", "learner.groups_per_update=1", "learner.checkpoint_every=100",
            "learner.keep_weights=1", "learner.total_updates=2", "curriculum.variants_per_seed=0",
            "learner.algo=ppo",  # GRPO would skip the all-fail groups of an untrained policy and never update
            "evaluation.before=false", "evaluation.max_steps=2"]


def test_every_dashboard_panel_returns_data_from_a_scraped_run(prometheus_server, redis_url, tmp_path, tiny_dir,
                                                              tw_data_dir):
    url, runs = prometheus_server
    name = "scraped"
    # An undecodable trajectory: the learner dead-letters it, so the dead-letter panel has a reason to show.
    redis.Redis.from_url(redis_url).xadd(trajectories_stream(f"dreamgym:{name}"), {DATA_FIELD: b"not msgpack"})
    metrics_port = _free_port()
    start = time.time()
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_train_cmd(runs, tw_data_dir, redis_url, metrics_port, name, tiny_dir), cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}, stdout=out,
                                stderr=subprocess.STDOUT)
        seen_up: set[str] = set()
        try:
            while proc.poll() is None and time.time() - start < 550:  # scraped while it runs
                seen_up |= {t["labels"]["job"] + "/" + t["labels"]["instance_name"]
                            for t in prometheus.targets(url) if t["health"] == "up"}
                time.sleep(1)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, log.read_text()[-4000:]
    end = time.time()
    assert {"driver/driver", "engine/policy", "engine/mexp"} <= seen_up, seen_up

    empty = []
    for concern, title, expr, _unit in panels():
        result = prometheus.query_range(url, expr, start, end, step=1)
        if not any(s["values"] for s in result):
            empty.append(f"{concern}: {title}: {expr}")
    assert not empty, "panels with no data:\n" + "\n".join(empty)

    # Values that only a working pipeline produces, not just series that exist. Read from the raw samples
    # (`*_over_time` at the end of the window): on a loaded machine a scrape of the driver's event loop can
    # time out, which marks the target's series stale at once, so a lone good scrape between two failed
    # ones can fall between a range query's steps.
    window = f"[{int(end - start) + 30}s]"

    def raw(fn: str, metric: str) -> list[dict]:
        return prometheus.query(url, f"{fn}_over_time({metric}{window})", at=end)

    assert max(float(s["value"][1]) for s in raw("max", "learner_weight_version")) == 2
    assert max(float(s["value"][1]) for s in raw("max", "simulator_fidelity_probes_total")) >= 1
    assert {s["metric"]["reason"] for s in raw("count", "stream_dead_letters_total")}
    assert {s["metric"]["env_kind"] for s in raw("count", "learner_reward_mean")} == {"real"}
    assert {s["metric"]["instance_name"] for s in raw("count", "engine_queue_depth")} == {"mexp", "policy"}
    assert {s["metric"]["job"] for s in raw("count", "learner_loss")} == {"driver"}  # engines export only their own

    # The run's report, redrawn from Prometheus's range queries.
    report = subprocess.run([sys.executable, "-m", "infra.cli", "report", str(runs / name), "--prometheus", url],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                            timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    pngs = {p.name for p in (runs / name / "plots" / "prometheus").glob("*.png")}
    assert pngs == {"overview.png", *(f"{c}.png" for c in DASHBOARDS)}
    assert "plots/prometheus/overview.png" in (runs / name / "report.md").read_text()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) is not on PATH")
def test_shipped_scrape_config_is_valid():
    res = subprocess.run(["promtool", "check", "config", str(ROOT / "infra" / "dashboards" / "prometheus.yml")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
