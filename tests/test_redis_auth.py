"""Who may reach the run's Redis: the embedded server's password, the job record, TLS.

A real embedded Redis started with a random `requirepass`, the real `dreamgym status`,
`scale` and `tasks` commands as subprocesses, and a real TLS Redis with a CA made by
openssl for the client-side `infra.redis_tls_ca` (skipped where openssl or a
TLS-capable server binary is missing). The Ray actor and `dreamgym train` tests are
marked slow.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis as syncredis

from infra import schema
from infra.processes import stop_process
from infra.redis_server import EmbeddedRedis, free_port, read_job_record, server_binary, write_job_record
from infra.run.workers import desired_key
from infra.schema import Task
from infra.streams import StreamProducer, connect, tasks_stream

CLI = [sys.executable, "-m", "infra.cli"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="200")
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_embedded_redis_refuses_clients_without_its_password():
    with EmbeddedRedis() as server:
        assert server.password and server.password in server.url and server.password not in server.public_url
        assert syncredis.Redis.from_url(server.url).ping()
        with pytest.raises(syncredis.exceptions.RedisError, match="(?i)auth"):
            syncredis.Redis.from_url(server.public_url).ping()
        # kept in 0600 files only: never on the command line, which every local user can read
        assert stat.S_IMODE(server.password_file.stat().st_mode) == 0o600
        assert stat.S_IMODE((server.data_dir / "redis.conf").stat().st_mode) == 0o600
        assert server.password.encode() not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        password_file = server.password_file
    assert not password_file.exists()  # removed with the server


@pytest.fixture
def job(tmp_path):
    """A running job as `dreamgym train` records it: an embedded Redis, its password in a 0600
    file in the run directory, and <run_root>/latest.json."""
    runs = tmp_path / "runs"
    run_dir = runs / "job1"
    with EmbeddedRedis(password_file=run_dir / "redis.password") as server:
        write_job_record(runs, "dreamgym:job1", run_dir, server)
        yield runs, server


def test_the_job_record_holds_no_secret_but_tools_can_connect(job):
    runs, server = job
    text = (runs / "latest.json").read_text()
    assert server.password not in text
    record = json.loads(text)
    assert record["redis_url"] == server.public_url and record["prefix"] == "dreamgym:job1"
    assert Path(record["redis_password_file"]).read_text().strip() == server.password
    assert read_job_record(runs)["redis_url"] == server.url
    assert read_job_record(runs / "nowhere") == {}


def test_status_scale_and_tasks_reach_the_running_job_through_its_record(job):
    runs, server = job

    async def seed() -> None:
        client = connect(server.url)
        await StreamProducer(client, tasks_stream("dreamgym:job1")).add(
            [schema.encode(Task(f"t{i}", "x")) for i in range(2)] + [b"junk"])
        await client.aclose()

    asyncio.run(seed())
    where = f"infra.run_dir={runs}"
    status = _cli("status", where, "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["reachable"] and report["streams"][0]["stream"] == "dreamgym:job1:tasks"
    assert report["streams"][0]["length"] == 3
    scale = _cli("scale", where, "--workers", "3")
    assert scale.returncode == 0, scale.stderr + scale.stdout
    assert syncredis.Redis.from_url(server.url).get(desired_key("dreamgym:job1")) == b"3"
    tasks = _cli("tasks", where, "--json")
    assert tasks.returncode == 0, tasks.stderr
    assert json.loads(tasks.stdout)["prefix"] == "dreamgym:job1"
    for out in (status, scale, tasks):
        assert server.password not in out.stdout + out.stderr


def test_status_finds_the_regime_an_experiment_runs_now(job, tmp_path):
    """`dreamgym experiment` runs each regime with infra.run_dir=<runs>/<experiment>: a plain
    `dreamgym status` takes the newest record, that regime's, over an older job's in <runs>."""
    runs, server = job
    older = runs / "latest.json"
    os.utime(older, (older.stat().st_mtime - 60,) * 2)
    with EmbeddedRedis(password_file=runs / "exp" / "sft" / "redis.password") as regime:
        write_job_record(runs / "exp", "dreamgym:sft", runs / "exp" / "sft", regime)
        assert read_job_record(runs)["prefix"] == "dreamgym:sft"
        status = _cli("status", f"infra.run_dir={runs}", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["streams"][0]["stream"] == "dreamgym:sft:tasks"
    assert read_job_record(runs / "exp" / "sft") == {}  # a run's own folder holds no record


def test_an_unreadable_password_file_is_a_clear_error(job):
    runs, server = job
    server.password_file.unlink()
    out = _cli("status", f"infra.run_dir={runs}")
    assert out.returncode == 2
    assert "password file" in out.stderr and "cannot be read" in out.stderr and "--redis-url" in out.stderr
    # a tool given its own URL does not need the file (it only takes the job's key prefix)
    scaled = _cli("scale", f"infra.run_dir={runs}", "--workers", "2", "--redis-url", server.url)
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    assert syncredis.Redis.from_url(server.url).get(desired_key("dreamgym:job1")) == b"2"


# ----- TLS: every client honours infra.redis_tls_ca -----
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A Redis serving only TLS, with a password, and the CA that signed its certificate."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=dreamgym-test-ca", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    port, password = free_port(), "tls-secret"
    (d / "redis.conf").write_text(f"requirepass {password}\n")
    proc = subprocess.Popen([server_binary(), str(d / "redis.conf"), "--port", "0", "--tls-port", str(port),
                             "--bind", "127.0.0.1", "--tls-cert-file", str(d / "server.crt"),
                             "--tls-key-file", str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.pem"),
                             "--tls-auth-clients", "no", "--save", "", "--dir", str(d)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"rediss://:{password}@127.0.0.1:{port}/0"
    client = syncredis.Redis.from_url(url, ssl_ca_certs=str(d / "ca.pem"), socket_connect_timeout=0.5)
    for _ in range(100):
        if proc.poll() is not None:
            pytest.skip(f"{server_binary()} cannot serve TLS: {proc.stderr.read().decode()[-300:]}")
        try:
            if client.ping():
                break
        except syncredis.exceptions.RedisError:
            time.sleep(0.05)
    else:
        stop_process(proc, 5)
        pytest.fail("the TLS Redis did not start")
    yield url, str(d / "ca.pem")
    stop_process(proc, 5)


def test_status_and_scale_honour_the_tls_ca(tls_redis):
    url, ca = tls_redis
    ok = _cli("status", "--redis-url", url, "--prefix", "tls", f"infra.redis_tls_ca={ca}", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["reachable"]
    refused = _cli("status", "--redis-url", url, "--prefix", "tls", "--json")  # no CA: the server is not trusted
    assert refused.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in refused.stdout
    assert "tls-secret" not in ok.stdout + refused.stdout + ok.stderr + refused.stderr
    scaled = _cli("scale", "--workers", "4", "--redis-url", url, "--prefix", "tls", f"infra.redis_tls_ca={ca}")
    assert scaled.returncode == 0, scaled.stderr
    assert syncredis.Redis.from_url(url, ssl_ca_certs=ca).get(desired_key("tls")) == b"4"
    refused = _cli("scale", "--workers", "5", "--redis-url", url, "--prefix", "tls")
    assert refused.returncode == 3 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr and "tls-secret" not in refused.stderr
    tasks = _cli("tasks", f"infra.redis_url={url}", f"infra.redis_tls_ca={ca}", "--prefix", "tls", "--json")
    assert tasks.returncode == 0, tasks.stderr


@pytest.mark.ray
@pytest.mark.slow
async def test_ray_worker_and_scheduler_actors_honour_the_tls_ca(tls_redis):
    import functools

    from infra.run.cluster.runtime import init_ray, shutdown_ray
    from infra.run.cluster.scheduler_actor import spawn_scheduler
    from infra.run.cluster.worker_actor import RayWorkerHandle
    from infra.config import ActorsConfig, CurriculumConfig
    from infra.streams import trajectories_stream
    from tests.rollout_fakes import LadderEnv, ScriptedPolicy

    url, ca = tls_redis
    init_ray(num_cpus=2, memory_bytes=1024 ** 3, object_store_bytes=96 * 1024 ** 2)
    client = connect(url, ca)
    try:
        scheduler = spawn_scheduler(url, "tls-run", CurriculumConfig(enabled=False, batch_size=2, max_backlog=4),
                                    [Task(f"s{i}", "climb") for i in range(2)], options={"num_cpus": 0}, limit=2,
                                    redis_tls_ca=ca)
        assert (await scheduler.run.remote())["handed_out"] == 2
        assert await client.xlen(tasks_stream("tls-run")) == 2  # pushed over TLS by the actor
        worker = RayWorkerHandle.spawn("tls-w0", url, "tls-run", ActorsConfig(group_size=2, concurrent_episodes=2,
                                                                               max_steps=4),
                                       ScriptedPolicy, functools.partial(LadderEnv, 2), options={"num_cpus": 0.5},
                                       redis_tls_ca=ca)
        for _ in range(300):
            if await client.xlen(trajectories_stream("tls-run")) >= 4:
                break
            await asyncio.sleep(0.1)
        status = await worker.stop(drain=True)
        assert status["trajectories_pushed"] == 4, status  # two groups of two, over TLS
    finally:
        await client.aclose()
        shutdown_ray()


# ----- `dreamgym train` with its embedded Redis: the secret stays in its file -----
@pytest.mark.slow
async def test_train_keeps_its_redis_password_private_and_bounds_redelivery(tmp_path, caplog, capsys, tiny_dir,
                                                                            tw_data_dir, monkeypatch):
    """One tiny `dreamgym train` on its embedded Redis. While it starts, a thread reads the
    job record like an operator would (`dreamgym status`) and plants two entries for the
    learner: one its consumer "learner-0" already got twice (as if it had crashed on it
    twice) and one with a NaN reward. With infra.max_deliveries=2 the first is dead-lettered
    as MaxDeliveries when the learner resumes its pending entries, the second as
    InvalidField at decode; training goes on. No password in any record, log or output."""
    from infra import metrics
    from infra.config import load_config
    from infra.run.driver import train
    from infra.schema import Step, Trajectory
    from learner.learner import Learner

    runs = tmp_path / "runs"
    cfg = load_config(None, [
        f"infra.run_dir={runs}", f"infra.data_dir={tw_data_dir}", "infra.train_budget_s=600",
        "infra.max_deliveries=2", f"engines.model={tiny_dir}", "engines.max_batch_size=4",
        f"simulator.checkpoint={tiny_dir}",
        "data.textworld_games=2", "data.textworld_heldout=1", "data.textworld_families=[custom]",
        "data.policies=[expert]", "data.episodes_per_task=1", "data.workers=1", "actors.env_kind=real",
        "actors.num_workers=1", "actors.group_size=2", "actors.concurrent_episodes=2", "actors.max_steps=2",
        "learner.groups_per_update=1", "learner.total_updates=1", "curriculum.variants_per_seed=0"])
    assert cfg.infra.redis_url == ""  # embedded
    stream = "dreamgym:auth:trajectories"
    dead_before = {r: metrics.STREAM_DEAD_LETTERS.labels(stream, r)._value.get() for r in ("MaxDeliveries", "InvalidField")}
    seen: dict = {}

    def watch() -> None:
        secret = runs / "auth" / "redis.password"
        for _ in range(1200):
            if secret.exists() and (runs / "latest.json").exists():
                seen["mode"] = stat.S_IMODE(secret.stat().st_mode)
                seen["password"] = secret.read_text().strip()
                seen["status"] = _cli("status", f"infra.run_dir={runs}", "--json")
                r = syncredis.Redis.from_url(read_job_record(runs)["redis_url"])
                try:
                    r.xgroup_create(stream, "learner", id="0", mkstream=True)
                except syncredis.ResponseError as exc:  # the driver may have made the group already
                    assert "BUSYGROUP" in str(exc)
                crashed_on = r.xadd(stream, {b"d": schema.encode(Trajectory("t", "planted", [Step("s", "a")]))})
                r.xreadgroup("learner", "learner-0", {stream: ">"}, count=1)
                r.xclaim(stream, "learner", "learner-0", 0, [crashed_on], retrycount=2, justid=True)
                r.xadd(stream, {b"d": schema.encode(Trajectory("t", "nan", [Step("s", "a", reward=float("nan"))]))})
                seen["planted"] = True
                return
            time.sleep(0.1)

    learner_run = Learner.run

    async def run_once_planted(self, *args, **kwargs):  # the learner "restarts" after the operator planted
        await asyncio.get_running_loop().run_in_executor(None, watcher.join, 120)
        return await learner_run(self, *args, **kwargs)

    monkeypatch.setattr(Learner, "run", run_once_planted)
    watcher = threading.Thread(target=watch)
    caplog.set_level("DEBUG")
    watcher.start()
    summary = await train(cfg, "auth", evaluate=False)
    watcher.join()
    assert summary["updates"] == 1 and seen.get("planted")
    dead = {r: metrics.STREAM_DEAD_LETTERS.labels(stream, r)._value.get() - n for r, n in dead_before.items()}
    assert dead == {"MaxDeliveries": 1, "InvalidField": 1}
    assert "MaxDeliveries: handled 2 times" in caplog.text and "steps[0].reward: got nan" in caplog.text
    password = seen["password"]
    assert seen["mode"] == 0o600 and len(password) >= 24
    status = seen["status"]
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["streams"][1]["stream"] == stream
    captured = capsys.readouterr()
    for text in ((runs / "latest.json").read_text(), (runs / "auth" / "config.yaml").read_text(), caplog.text,
                 captured.out, captured.err, status.stdout, status.stderr):
        assert password not in text
    assert not (runs / "auth" / "redis.password").exists()  # removed with the server at the end
