"""Elastic rollout workers as real Ray actors on real Redis: kills and scaling lose nothing."""

from __future__ import annotations

import asyncio
import functools

import pytest

from infra.config import ActorsConfig, CurriculumConfig
from infra.schema import Task, Trajectory, decode_as, encode
from infra.run.workers import WorkerPool, autoscale_target, desired_key
from infra.streams import WORKERS_GROUP, StreamProducer, connect, tasks_stream, trajectories_stream
from simulator.curriculum import CurriculumScheduler
from tests.rollout_fakes import LadderEnv, ScriptedPolicy, slow_scripted_policy

pytestmark = [pytest.mark.ray, pytest.mark.slow]
PREFIX = "el"
G = 2


@pytest.fixture(scope="module")
def ray_local():
    from infra.run.cluster.runtime import init_ray, shutdown_ray

    init_ray(num_cpus=4, memory_bytes=2 * 1024 ** 3, object_store_bytes=128 * 1024 ** 2)
    yield
    shutdown_ray()


def spawn(redis_url, delay_s, wid):
    from infra.run.cluster.worker_actor import RayWorkerHandle

    cfg = ActorsConfig(group_size=G, concurrent_episodes=G, max_steps=4)
    return RayWorkerHandle.spawn(wid, redis_url, PREFIX, cfg, ScriptedPolicy, functools.partial(LadderEnv, 3, delay_s),
                                 options={"num_cpus": 0.5}, reclaim_idle_ms=500)


async def trajectories(client) -> list[Trajectory]:
    return [decode_as(f[b"d"], Trajectory) for _, f in await client.xrange(trajectories_stream(PREFIX))]


async def wait_groups(client, n, timeout_s=60):
    for _ in range(int(timeout_s / 0.2)):
        info = await client.xinfo_groups(tasks_stream(PREFIX))
        if len(await trajectories(client)) >= n * G and info and info[0]["pending"] == 0 and info[0]["lag"] == 0:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"fewer than {n} groups finished in {timeout_s}s")


async def test_killed_worker_task_is_reclaimed_nothing_lost(redis_url, ray_local):
    client = connect(redis_url)
    await StreamProducer(client, tasks_stream(PREFIX)).add(
        [encode(Task(task_id=f"k{i}", instruction="climb")) for i in range(2)])
    doomed = spawn(redis_url, 0.3, "doomed")
    for _ in range(200):
        if (await doomed.status()).get("inflight"):
            break
        await asyncio.sleep(0.05)
    doomed.kill()  # mid-episode: its task stays pending under its consumer name
    pending = await client.xpending(tasks_stream(PREFIX), WORKERS_GROUP)
    assert pending["pending"] >= 1
    rescuer = spawn(redis_url, 0.0, "rescuer")
    await wait_groups(client, 2)
    trajs = await trajectories(client)
    assert len(trajs) == 2 * G
    assert sorted(t.task_id for t in trajs) == sorted(["k0", "k1"] * G)
    assert {t.worker_id for t in trajs} == {"rescuer"}
    await rescuer.stop()
    await client.aclose()


async def test_scale_up_then_down_mid_run_counts_add_up(redis_url, ray_local):
    client = connect(redis_url)
    n_tasks = 12
    sampler = CurriculumScheduler(client, CurriculumConfig(enabled=False, batch_size=2, max_backlog=4), PREFIX,
                                  [Task(task_id=f"s{i}", instruction="climb") for i in range(6)], limit=n_tasks)
    pool = WorkerPool(lambda wid: spawn(redis_url, 0.2, wid), drain_timeout_s=30)
    stop = asyncio.Event()
    await pool.scale_to(1)
    watcher = asyncio.create_task(pool.watch(client, PREFIX, stop, poll_s=0.2))
    feeder = asyncio.create_task(sampler.run(stop))
    await asyncio.sleep(1.0)
    await client.set(desired_key(PREFIX), 3)  # what `dreamgym scale --workers 3` does
    for _ in range(100):
        if len(pool) == 3:
            break
        await asyncio.sleep(0.1)
    assert len(pool) == 3
    for _ in range(300):  # scale down only once the added workers have done work (Ray start-up is slow under load)
        if sum(1 for st in await pool.statuses() if st["trajectories_pushed"]) >= 2:
            break
        await asyncio.sleep(0.1)
    await client.set(desired_key(PREFIX), 1)
    for _ in range(300):
        if len(pool.retired) == 2:
            break
        await asyncio.sleep(0.1)
    assert len(pool) == 1 and len(pool.retired) == 2
    await feeder
    await wait_groups(client, n_tasks)
    stop.set()
    await watcher
    statuses = await pool.statuses()
    await pool.stop_all(drain=True)
    trajs = await trajectories(client)
    assert sampler.pushed == n_tasks and len(trajs) == n_tasks * G
    assert len({t.group_id for t in trajs}) == n_tasks  # no group ran twice
    per_worker = [s["trajectories_pushed"] for s in pool.retired]
    assert sum(per_worker) == len(trajs) and len([p for p in per_worker if p]) >= 2
    assert statuses and statuses[0]["worker_id"] == "w0"
    await client.aclose()


def test_autoscale_rule():
    def n(*a, **kw):
        return autoscale_target(*a, **kw)[0]

    assert n(2, backlog=10, queue_depth=3, slots_per_worker=2, engine_capacity=16) == 3  # work waits, engines have room
    assert n(8, backlog=100, queue_depth=3, slots_per_worker=2, engine_capacity=16, hi=8) == 8  # capped
    assert n(2, backlog=10, queue_depth=16, slots_per_worker=2, engine_capacity=16) == 2  # engines full: hold
    assert n(3, backlog=0, queue_depth=20, slots_per_worker=2, engine_capacity=16) == 2
    assert n(1, backlog=0, queue_depth=20, slots_per_worker=2, engine_capacity=16) == 1  # never below lo
    assert n(3, backlog=0, queue_depth=0, slots_per_worker=2, engine_capacity=16) == 2  # idle workers: one fewer
    assert n(3, backlog=4, queue_depth=0, slots_per_worker=2, engine_capacity=16) == 2  # two workers take all 4
    assert n(3, backlog=5, queue_depth=0, slots_per_worker=2, engine_capacity=16) == 3  # they would not: hold
    up, why = autoscale_target(1, backlog=7, queue_depth=2, slots_per_worker=1, engine_capacity=8)
    assert up == 2 and why.startswith("autoscale up: 7 task(s) waiting for 1 worker(s)") and "queue 2/8" in why
    assert autoscale_target(2, 0, 0, 1, 8)[1].startswith("autoscale down:")
    assert autoscale_target(12, 50, 0, 1, 8, hi=8) == (8, "autoscale within [1, 8]: 50 task(s) waiting for 12 "
                                                        "worker(s) x 1 slot(s), engine queue 0/8")  # after a scale


def test_scale_command_sets_the_target_the_pool_watches(redis_url):
    import argparse

    import redis as sync_redis

    from infra.run import scale

    p = argparse.ArgumentParser()
    scale.add_arguments(p)
    args = p.parse_args(["--workers", "5", "--redis-url", redis_url, "--prefix", "job"])
    assert scale.run(args) == 0
    assert int(sync_redis.Redis.from_url(redis_url).get(desired_key("job"))) == 5
    assert scale.run(p.parse_args(["--workers", "-1", "--redis-url", redis_url])) == 2


async def test_autoscaler_reads_the_task_backlog_and_the_engines_queue(redis_url):
    from aiohttp import web

    from infra.config import Config
    from infra.run.workers import DOWN_PATIENCE, Autoscaler

    depth = {"v": 0}

    async def metrics_page(_request):  # an engine's /metrics, SGLang's names
        return web.Response(text=f"sglang:num_queue_reqs {depth['v']}\nsglang:num_running_reqs 1\n")

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics_page)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    client = connect(redis_url)
    cfg = Config()
    cfg.actors.group_size, cfg.actors.concurrent_episodes, cfg.actors.autoscale_max_workers = 2, 2, 3
    cfg.engines.max_batch_size = 4
    rule = Autoscaler(cfg, client, PREFIX, [url, "http://127.0.0.1:9"])  # the second engine never answers
    try:
        assert (await rule(1))[0] == 1  # no backlog, idle engines: keep (lo is 1)
        await StreamProducer(client, tasks_stream(PREFIX)).add(
            [encode(Task(task_id=f"a{i}", instruction="climb")) for i in range(5)])
        assert (await rule(2))[0] == 3 and (await rule(3))[0] == 3  # backlog 5 > 2 workers x 1 slot; capped at 3
        depth["v"] = 3  # 3 waiting + 1 running = the engine's 4 slots: full
        target, why = await rule(2)
        assert target == 2 and "engine queue 4/4" in why  # work waits, but more workers would only queue
        depth["v"] = 0
        await client.delete(tasks_stream(PREFIX))
        assert [(await rule(3))[0] for _ in range(DOWN_PATIENCE)] == [3] * (DOWN_PATIENCE - 1) + [2]  # patient shrink
    finally:
        await rule.aclose()
        await client.aclose()
        await runner.cleanup()


def test_queue_depth_from_either_engine_s_metrics():
    from infra.engine.load import parse_queue_depth

    assert parse_queue_depth("# TYPE engine_queue_depth gauge\nengine_queue_depth 5.0\n") == 5.0
    assert parse_queue_depth('sglang:num_queue_reqs{model_name="m"} 2\nsglang:num_running_reqs{model_name="m"} 7\n') == 9
    assert parse_queue_depth("engine_requests_total 3\n") is None


async def test_status_of_a_starting_worker_has_every_counter(redis_url, ray_local):
    from infra.run.cluster.worker_actor import RayWorkerHandle

    cfg = ActorsConfig(group_size=G, concurrent_episodes=G, max_steps=4)
    handle = RayWorkerHandle.spawn("slow-start", redis_url, "el-start", cfg, slow_scripted_policy,
                                   functools.partial(LadderEnv, 3),
                                   options={"num_cpus": 0.5})
    starting = await handle.status()
    assert starting["starting"] and starting["trajectories_pushed"] == 0 and starting["groups_done"] == 0
    running = {}
    for _ in range(100):
        running = await handle.status()
        if not running.get("starting"):
            break
        await asyncio.sleep(0.1)
    assert set(starting) - {"starting"} == set(running)  # one status shape, starting or running
    await handle.stop()


async def test_a_killed_worker_is_started_again_under_its_id_and_takes_its_task_back(redis_url, ray_local):
    """kill -9 of a worker actor inside a pool (what benchmarks/chaos.py does): the pool's watch sees its run
    call fail, starts the worker again under the same id at the next poll, and that consumer reads its own
    pending task back at once; every task is played, and stopping the pool at the end raises nothing."""
    client = connect(redis_url)
    await StreamProducer(client, tasks_stream(PREFIX)).add(
        [encode(Task(task_id=f"r{i}", instruction="climb")) for i in range(3)])
    pool = WorkerPool(lambda wid: spawn(redis_url, 0.3, wid), drain_timeout_s=30)
    stop = asyncio.Event()
    await pool.scale_to(1)
    doomed = pool.workers[0]
    for _ in range(300):
        if (await doomed.status()).get("inflight"):
            break
        await asyncio.sleep(0.05)
    watcher = asyncio.create_task(pool.watch(client, PREFIX, stop, poll_s=0.2))
    doomed.kill()  # mid-episode: its task stays pending under consumer w0
    for _ in range(300):
        if pool.workers[0] is not doomed:
            break
        await asyncio.sleep(0.1)
    assert pool.workers[0] is not doomed and pool.workers[0].worker_id == "w0" and len(pool) == 1
    assert any("replaced w0" in e["reason"] for e in pool.history)
    await wait_groups(client, 3)
    trajs = await trajectories(client)
    assert sorted({t.task_id for t in trajs}) == ["r0", "r1", "r2"]
    stop.set()
    await watcher
    await pool.stop_all(drain=False)  # the dead handle is gone from the pool: nothing raises
    assert len(pool) == 0
    await client.aclose()


async def test_stopping_a_pool_whose_worker_died_raises_nothing(redis_url, ray_local):
    """A worker killed while no watch runs (the end of a phase): stop_all records it as gone."""
    pool = WorkerPool(lambda wid: spawn(redis_url, 0.0, wid), drain_timeout_s=30)
    await pool.scale_to(1)
    await pool.workers[0].status()  # started
    pool.workers[0].kill()
    for _ in range(100):
        if pool.workers[0].exited():
            break
        await asyncio.sleep(0.1)
    await pool.stop_all(drain=False)
    assert pool.history[-1]["stopped"][0]["how"] == "gone"
