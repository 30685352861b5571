"""Offline collection and held-out evaluation: trajectory files and task splits round-tripping
through the schema, and `dreamgym collect` / `dreamgym eval` end to end on tiny real TextWorld games."""

from __future__ import annotations

import json

import pytest

from actors.dataset import TaskSplits, read_trajectories, splits_path, trajectories_path, write_trajectories
from infra.schema import EnvKind, SchemaError, Status, Step, Task, Trajectory, encode


def _traj(i: int) -> Trajectory:
    task = Task(task_id=f"t{i}", instruction="do it", family="custom", game_file="/x.z8", seed=i)
    steps = [Step(state="Goal: g\nActions:\n[1] a", action="[1]", reward=1.0, done=True, next_state="Goal: g\nActions:\n[1] b",
                  reasoning="a: now x", reasoning_source="env-facts")]
    return Trajectory(task_id=f"t{i}", group_id="g", steps=steps, env_kind=EnvKind.REAL, status=Status.SUCCESS,
                      success=True, task=task, timings={"policy_name": "expert"})


def test_trajectory_file_round_trip_and_corruption(tmp_path):
    path = tmp_path / "offline" / "tw" / "trajectories.msgpack"
    assert write_trajectories(path, [_traj(0), _traj(1)]) == 2
    assert write_trajectories(path, [_traj(2)], append=True) == 1
    back = list(read_trajectories(path))
    assert [t.task_id for t in back] == ["t0", "t1", "t2"]
    assert back[0].steps[0].reasoning_source == "env-facts" and back[0].task.family == "custom"
    assert back[1].steps == _traj(1).steps and back[1].status == Status.SUCCESS

    good = path.read_bytes()
    (tmp_path / "trunc.msgpack").write_bytes(good[:-5])
    with pytest.raises(SchemaError):
        list(read_trajectories(tmp_path / "trunc.msgpack"))
    (tmp_path / "task.msgpack").write_bytes(good + encode(Task(task_id="x", instruction="y")))
    with pytest.raises(SchemaError):
        list(read_trajectories(tmp_path / "task.msgpack"))
    (tmp_path / "junk.msgpack").write_bytes(b"\xc1\xc1\xc1")
    with pytest.raises(SchemaError):
        list(read_trajectories(tmp_path / "junk.msgpack"))


def test_task_splits_round_trip(tmp_path):
    splits = TaskSplits(train=[Task("a", "x", family="custom", meta={"fields": [["k", "v"]]})], heldout=[Task("b", "y")])
    splits.save(tmp_path / "splits.json")
    back = TaskSplits.load(tmp_path / "splits.json")
    assert back == splits
    (tmp_path / "bad.json").write_text("{\"train\": 3}")
    with pytest.raises(SchemaError):
        TaskSplits.load(tmp_path / "bad.json")


@pytest.mark.slow
def test_collect_and_eval_commands_end_to_end(tmp_path_factory, tmp_path, capsys):
    from infra.cli import main

    data = tmp_path_factory.getbasetemp() / "tw-data"  # shares the games cache with test_envs_textworld
    overrides = [f"infra.data_dir={data}", f"infra.run_dir={tmp_path}", "data.textworld_games=3",
                 "data.textworld_heldout=2", "data.textworld_families=[custom]",
                 "data.textworld_heldout_families=[tw-cooking-1]", "data.workers=1", "data.max_steps=8"]
    assert main(["collect", *overrides, "--family", "textworld", "--rebuild-splits"]) == 0
    assert "collect: 18/18 episodes" in capsys.readouterr().out  # a line each tenth where no live bar shows
    splits = TaskSplits.load(splits_path(data, "textworld"))
    trajs = list(read_trajectories(trajectories_path(data, "textworld")))
    assert len(trajs) == 3 * 3 * 2  # tasks x policies x episodes_per_task
    assert {t.timings["policy_name"] for t in trajs} == {"expert", "noisy", "random"}
    train_ids = {t.task_id for t in splits.train}
    for t in trajs:
        assert t.env_kind == EnvKind.REAL and t.task_id in train_ids and t.steps
        assert all(s.next_state and s.reasoning and s.reasoning_source == "env-facts" for s in t.steps)
        assert t.steps[-1].done
    assert all(t.success for t in trajs if t.timings["policy_name"] == "expert")

    reports = {}
    for policy in ("expert", "random"):
        out = tmp_path / f"{policy}.json"
        assert main(["eval", *overrides, "--family", "textworld", "--policy", policy, "--out", str(out)]) == 0
        reports[policy] = json.loads(out.read_text())
    assert reports["expert"]["episodes"] == 2 and reports["expert"]["success_rate"] == 1.0
    assert reports["random"]["success_rate"] <= reports["expert"]["success_rate"]
    assert reports["random"]["mean_steps"] > reports["expert"]["mean_steps"]
    assert 0.0 <= reports["expert"]["ci_low"] <= 1.0 <= reports["expert"]["ci_high"] + 1e-9

    # --compare-to pairs a report with an earlier one, task by task; a bad earlier report stops before playing
    out = tmp_path / "random-vs-expert.json"
    assert main(["eval", *overrides, "--family", "textworld", "--policy", "random", "--out", str(out),
                 "--compare-to", str(tmp_path / "expert.json")]) == 0
    c = json.loads(out.read_text())["compared_to"]
    lost = sum(not r["success"] for r in reports["random"]["per_task"])  # the expert won every task
    assert c["tasks"] == 2 and c["won"] == 0 and c["lost"] == lost
    assert c["diff"] == pytest.approx(reports["random"]["success_rate"] - 1.0)
    assert c["ci_low"] <= c["diff"] <= c["ci_high"]
    (tmp_path / "bad.json").write_text("{}")
    assert main(["eval", *overrides, "--family", "textworld", "--policy", "random", "--out", str(tmp_path / "x.json"),
                 "--compare-to", str(tmp_path / "bad.json")]) == 2
    assert not (tmp_path / "x.json").exists()


def test_eval_plays_an_engine_policy_at_the_evaluation_concurrency(tmp_path_factory, tmp_path, monkeypatch):
    """`dreamgym eval --policy endpoint|checkpoint` plays evaluation.concurrency episodes at once, as the
    driver's held-out evaluation does, so the engine batches them (it used to play one at a time)."""
    import asyncio
    import contextlib

    import actors.evaluate as ev
    from infra.cli import main

    in_flight, most, first = 0, 0, True
    both = asyncio.Event()

    async def chooser(task, state, candidates, history):
        nonlocal in_flight, most, first
        in_flight += 1
        most = max(most, in_flight)
        if in_flight == 2:
            both.set()
        if first:  # an engine call: the episode yields while it waits, long enough for a slow env to start
            first = False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(both.wait(), 20)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return candidates[0]

    async def engine_chooser(args, cfg):
        async def cleanup() -> None:
            pass
        return chooser, cleanup

    monkeypatch.setattr(ev, "_engine_chooser", engine_chooser)
    data = tmp_path_factory.getbasetemp() / "tw-data"  # shares the games cache with the test above
    overrides = [f"infra.data_dir={data}", f"infra.run_dir={tmp_path}", "data.textworld_games=3",
                 "data.textworld_heldout=2", "data.textworld_families=[custom]",
                 "data.textworld_heldout_families=[tw-cooking-1]", "data.workers=1", "data.max_steps=8",
                 "evaluation.concurrency=2"]
    out = tmp_path / "endpoint.json"
    assert main(["eval", *overrides, "--family", "textworld", "--policy", "endpoint", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["episodes"] == 2 and report["mean_steps"] > 0
    assert most == 2


async def test_eval_serves_a_checkpoint_as_the_config_says(monkeypatch):
    """`dreamgym eval --policy checkpoint` starts its engine with the config's device, dtype and engine
    settings (it used the defaults: a GPU config evaluated on the CPU in fp32), on
    evaluation.engine_threads torch threads."""
    import argparse
    from types import SimpleNamespace

    import actors.evaluate as ev
    from infra.config import load_config

    seen = {}

    async def fake_engine(**kwargs):
        seen.update(kwargs)

        async def stop() -> None:
            pass
        return SimpleNamespace(url="http://127.0.0.1:9", stop=stop)

    class Client(ev.EngineClient):  # the client sends the key the engine now requires
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen["client_key"] = kw.get("api_key")

    monkeypatch.setattr(ev, "start_embedded_engine", fake_engine)
    monkeypatch.setattr(ev, "EngineClient", Client)
    args = argparse.Namespace(policy="checkpoint", checkpoint="", endpoint="", temperature=0.0)
    for engine_threads, want in ((-1, 0), (0, 1), (3, 3)):
        cfg = load_config(None, ["engines.dtype=bfloat16", "engines.max_batch_size=7", "engines.prefix_cache_mb=64",
                                 "engines.threads=1", "engines.api_key=k3y", f"evaluation.engine_threads={engine_threads}"])
        _chooser, cleanup = await ev._engine_chooser(args, cfg)
        await cleanup()
        assert seen["dtype"] == "bfloat16" and seen["device"] == cfg.engines.device and seen["max_batch_size"] == 7
        assert seen["engine_cfg"].prefix_cache_mb == 64 and seen["engine_cfg"].threads == want
        assert seen["engine_cfg"].api_key == seen["client_key"] == "k3y"
