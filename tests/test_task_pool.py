"""The task pool in real Redis, its lineage, and the `dreamgym tasks` command."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json

import pytest
from rich.console import Console

from infra import cli
from infra.config import dump, load_config
from infra.redis_server import EmbeddedRedis
from infra.schema import Task
from infra.streams import connect, run_prefix
from infra.task_stats import TaskStatsStore
from simulator.curriculum import CurriculumConfig, CurriculumScheduler
from simulator.task_pool import PoolFull, TaskPool, pool_key, pool_report, render_table


def family() -> list[Task]:
    root = Task(task_id="root", instruction="open the red box", family="tw-simple")
    child = Task(task_id="child", instruction="open the blue box", parent_id="root", generated=True,
                 meta={"depth": 1, "root": "root"})
    grandchild = Task(task_id="grandchild", instruction="open the blue chest", parent_id="child", generated=True,
                      meta={"depth": 2, "root": "root"})
    return [root, child, grandchild]


async def test_pool_persists_across_instances_with_lineage(redis_url):
    client = connect(redis_url)
    pool = TaskPool(client, "p")
    assert await pool.load() == {}
    added = await pool.add(family())
    assert len(added) == 3
    assert await pool.add(family()) == []  # idempotent

    other = TaskPool(connect(redis_url), "p")
    tasks = await other.load()
    assert tasks["grandchild"].parent_id == "child" and tasks["grandchild"].generated
    assert other.lineage("grandchild") == ["grandchild", "child", "root"]
    assert [t.task_id for t in other.seeds()] == ["root"]
    assert {t.task_id for t in other.generated()} == {"child", "grandchild"}
    assert [t.task_id for t in other.children("root")] == ["child"]
    await client.aclose()
    await other.client.aclose()


async def test_pool_refuses_generated_tasks_past_max_pool_and_skips_corrupt_entries(redis_url):
    client = connect(redis_url)
    pool = TaskPool(client, "full", max_pool=2)
    await pool.add(family()[:2])
    with pytest.raises(PoolFull):
        await pool.add(family()[2:])
    assert len(pool) == 2
    await client.hset(pool_key("full"), "garbage", b"\x00not msgpack")
    fresh = TaskPool(client, "full")
    assert set(await fresh.load()) == {"root", "child"}  # the corrupt entry is skipped ...
    assert await client.hexists(pool_key("full"), "garbage")  # ... and left in place, not lost
    await client.aclose()


async def test_dreamgym_tasks_lists_pool_with_stats_and_lineage(redis_url):
    client = connect(redis_url)
    await TaskPool(client, "cli").add(family())
    stats = TaskStatsStore(client, "cli")
    await stats.record_group("child", [1, 0, 1, 0])
    await stats.record_group("root", [0, 0, 0, 0])
    sched = CurriculumScheduler(client, CurriculumConfig(batch_size=2, lam=0.5), "cli", family()[:1])
    for _ in range(4):
        await sched.next_batch()

    report = await pool_report(client, "cli")
    rows = {r["task_id"]: r for r in report["tasks"]}
    assert rows["child"]["v_tau"] == pytest.approx(0.25) and rows["child"]["n"] == 4
    assert rows["grandchild"]["lineage"] == ["grandchild", "child", "root"]
    assert report["counters"]["pushed"] == 8 and 0 < report["generated_share_pushed"] <= 0.5

    buf = io.StringIO()
    Console(file=buf, width=140).print(render_table(report))
    text = buf.getvalue()
    assert "1 seed + 2 generated" in text and "child" in text and "0.250" in text

    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # the real command, in a thread with its own event loop
        rc = await asyncio.to_thread(cli.main, ["tasks", f"infra.redis_url={redis_url}", "--prefix", "cli", "--json"])
    assert rc == 0
    listed = json.loads(out.getvalue())
    assert listed["size"] == 3 and listed["generated"] == 2
    await client.aclose()


async def test_dreamgym_tasks_finds_the_latest_run(redis_url, tmp_path):
    client = connect(redis_url)
    await TaskPool(client, "dreamgym:run1").add(family())
    (tmp_path / "latest.json").write_text(json.dumps({"redis_url": redis_url, "prefix": "dreamgym:run1"}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = await asyncio.to_thread(cli.main, ["tasks", f"infra.run_dir={tmp_path}", "--json"])
    assert rc == 0 and json.loads(out.getvalue())["size"] == 3
    await client.aclose()


def test_dreamgym_tasks_without_redis_url_says_what_to_pass(capsys, tmp_path):
    assert cli.main(["tasks", "infra.redis_url=", f"infra.run_dir={tmp_path}"]) == 2
    assert "infra.redis_url=" in capsys.readouterr().out


async def test_dreamgym_tasks_reads_a_finished_runs_pool_from_a_copy_of_its_aof(tmp_path, capsys):
    run = tmp_path / "exp" / "regime.r2"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump(load_config(None, ["infra.stream_prefix=mine"])))
    prefix = run_prefix("mine", "regime.r2")
    with EmbeddedRedis(data_dir=run / "redis", appendonly=True) as server:  # the run's own server, then stopped
        client = connect(server.url)
        await TaskPool(client, prefix).add(family())
        stats = TaskStatsStore(client, prefix)
        for tid, rewards in (("root", [1, 0, 1, 1]), ("root", [0, 0, 0, 0]), ("child", [1, 0, 0, 0])):
            await stats.record_group(tid, rewards)
        await client.aclose()
    aof = run / "redis" / "appendonlydir"
    before = {f.name: f.read_bytes() for f in aof.iterdir()}

    rc = await asyncio.to_thread(cli.main, ["tasks", "--run", str(run), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prefix"] == prefix and report["size"] == 3
    assert {r["task_id"]: r["n"] for r in report["tasks"]} == {"root": 8, "child": 4, "grandchild": 0}
    assert report["spread"] == {"seed": {"played": 1, "groups": 2, "max_on_one": 2},
                                "generated": {"played": 1, "groups": 1, "max_on_one": 1}}
    assert {f.name: f.read_bytes() for f in aof.iterdir()} == before  # the run's files untouched

    assert await asyncio.to_thread(cli.main, ["tasks", "--run", str(tmp_path / "exp")]) == 2
    assert "no config.yaml" in capsys.readouterr().err  # not a run directory
    (run / "config.yaml").rename(tmp_path / "exp" / "config.yaml")
    assert await asyncio.to_thread(cli.main, ["tasks", "--run", str(tmp_path / "exp")]) == 2
    assert "no Redis append-only files" in capsys.readouterr().err  # a run directory without its Redis
