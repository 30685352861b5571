"""Fault injection (issue 12): nothing lost, nothing poisoned, against real processes.

Two layers, both on a real Redis:

- the learner in this process, on a tiny random-initialised Llama that carries
  SmolLM2's real tokenizer (same prompts, same code path, milliseconds per update):
  the non-finite guard, the retrain-once-then-dead-letter rule for an update that
  raises and for a learner that died inside an update, ack-after-checkpoint;
- `dreamgym train` as a real child process (real TextWorld games, the embedded engine
  serving that tiny model, the real learner): `kill -9` of the whole job inside an
  update, then `--resume`, counted (pushed / trained / redelivered / lost, lost must
  be 0); `kill -9` of its appendonly Redis mid-run, the run goes on; poison
  trajectories added to its stream mid-run are dead-lettered by reason and training
  goes on.

The counting rule for "lost": an entry the learner group has acked must be in the
final checkpoint's dedupe memory (trained into the lineage, or deliberately set aside)
or in the dead-letter stream. Anything else was acked and forgotten: lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch

from actors.policy import build_choice_prompt
from infra import metrics
from infra.config import LearnerConfig
from infra.redis_server import EmbeddedRedis
from infra.schema import Status, Step, Task, Trajectory, decode_as, encode
from infra.streams import (LEARNER_GROUP, StreamConsumer, StreamProducer, connect, dead_letter_stream,
                           trajectories_stream)
from learner import checkpoint as ckpt
from learner.inflight import InflightLedger
from learner.learner import Learner
from learner.policy_model import PolicyModel
from learner.weights import WeightPublisher, published_versions

pytestmark = [pytest.mark.faults]

STATE = "Room: Kitchen. You see a table with a coin.\nActions:\n[1] go north\n[2] take coin\n[3] open door"
CANDS = ["go north", "take coin", "open door"]


def tiny_policy(tiny_dir: Path) -> PolicyModel:
    return PolicyModel(str(tiny_dir), lora_rank=0)


def traj(tok, group_id: str, reward: float, logprob: float = -1.1, choice_ids: list | None = None) -> Trajectory:
    task = Task("t1", "take the coin")
    prompt, labels = build_choice_prompt(tok, task, STATE, CANDS, [])
    labels = choice_ids or labels
    step = Step(state=STATE, action=CANDS[1], reward=reward, done=True, policy_prompt=prompt,
                action_token_ids=[labels[1]], logprobs=[logprob], loss_mask=[1], choice_token_ids=labels)
    return Trajectory(task_id="t1", group_id=group_id, steps=[step], success=reward > 0,
                      status=Status.SUCCESS if reward > 0 else Status.FAILURE, task=task)


def lcfg(**kw) -> LearnerConfig:
    base = dict(lr=1e-3, groups_per_update=1, max_staleness=100, checkpoint_every=1, publish_every=1,
                group_timeout_s=3600.0)
    base.update(kw)
    return LearnerConfig(**base)


async def make_learner(redis_url, run_dir, tiny_dir, prefix="faults", policy=None, **cfg):
    client = connect(redis_url)
    stream = trajectories_stream(prefix)
    consumer = StreamConsumer(client, stream, LEARNER_GROUP, "learner-0", lambda b: decode_as(b, Trajectory),
                              max_deliveries=5, count_on_use=True)  # as learner.stream_learner makes it
    await consumer.ensure_group()
    learner = Learner(lcfg(**cfg), str(tiny_dir), run_dir, consumer, WeightPublisher(run_dir), group_size=2,
                      policy=policy or tiny_policy(tiny_dir), read_block_ms=20)
    return client, StreamProducer(client, stream), learner, stream


async def steps(learner, n=6) -> list:
    return [s for _ in range(n) if (s := await learner.step()) is not None]


def weights(policy) -> dict:
    return {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


async def pending(client, stream) -> int:
    return (await client.xpending(stream, LEARNER_GROUP))["pending"]


async def dead_reasons(client, stream) -> list[str]:
    return [f[b"error"].decode() for _, f in await client.xrange(dead_letter_stream(stream))]


# ---- the learner in this process ------------------------------------------------------------

async def test_non_finite_update_is_undone_retried_once_then_dead_lettered(redis_url, tiny_dir, tmp_path):
    """A group that decodes fine (log-prob -1e4 is a legal p = 0) but makes the PPO ratio overflow:
    the loss is inf. The update is undone (weights and optimizer as before, nothing published),
    counted, retried once, then dead-lettered as NonFiniteLoss; the next good group trains."""
    client, producer, learner, stream = await make_learner(redis_url, tmp_path, tiny_dir)
    tok = learner.policy.tokenizer
    before = weights(learner.policy)
    counted = metrics.LEARNER_NONFINITE_UPDATES.labels("loss")._value.get()
    await producer.add(encode(t) for t in [traj(tok, "bad", 1.0), traj(tok, "bad", 0.0, logprob=-1e4)])
    assert await steps(learner, 4) == []
    assert metrics.LEARNER_NONFINITE_UPDATES.labels("loss")._value.get() == counted + 2  # tried, retried once
    assert same(before, weights(learner.policy)) and not learner.optimizer.state
    assert learner.version == 0 and published_versions(tmp_path) == []
    reasons = await dead_reasons(client, stream)
    assert len(reasons) == 2 and all(r.startswith("NonFiniteLoss: non-finite loss") for r in reasons)
    await producer.add(encode(t) for t in [traj(tok, "good", 1.0), traj(tok, "good", 0.0)])
    done = await steps(learner)
    assert len(done) == 1 and learner.version == 1 and published_versions(tmp_path) == [1]
    assert all(torch.isfinite(p).all() for p in learner.policy.parameters())
    assert await pending(client, stream) == 0  # checkpoint_every=1: acked after its checkpoint
    await client.aclose()


async def test_an_update_that_raises_is_retried_once_then_dead_lettered(redis_url, tiny_dir, tmp_path):
    """Label token ids beyond the vocabulary pass the schema (any uint32) but make the forward pass
    raise: not a crash loop, two attempts and a dead letter with the error, training goes on."""
    client, producer, learner, stream = await make_learner(redis_url, tmp_path, tiny_dir)
    tok = learner.policy.tokenizer
    alien = [10 ** 6, 10 ** 6 + 1, 10 ** 6 + 2]
    await producer.add(encode(t) for t in [traj(tok, "x", 1.0, choice_ids=alien), traj(tok, "x", 0.0, choice_ids=alien),
                                           traj(tok, "ok", 1.0), traj(tok, "ok", 0.0)])
    done = await steps(learner, 6)
    assert len(done) == 1 and learner.version == 1 and learner.failed_updates == {"UpdateFailed": 2}
    reasons = await dead_reasons(client, stream)
    assert len(reasons) == 2 and all(r.startswith("UpdateFailed: IndexError") for r in reasons)
    assert learner.dead_lettered == 2 and await pending(client, stream) == 0
    await client.aclose()


async def test_acks_wait_for_the_checkpoint_and_a_restart_retrains_what_it_did_not_cover(redis_url, tiny_dir,
                                                                                         tmp_path):
    """checkpoint_every=2: entries of update 1 stay pending until the update-2 checkpoint. A learner
    that dies after update 3 (its entries trained, not saved) restarts from the update-2 checkpoint
    and retrains them from the redelivered entries: none lost, none trained twice into the lineage."""
    client, producer, learner, stream = await make_learner(redis_url, tmp_path, tiny_dir, checkpoint_every=2)
    tok = learner.policy.tokenizer
    groups = {g: [traj(tok, g, 1.0), traj(tok, g, 0.0)] for g in "ABC"}
    await producer.add(encode(t) for t in groups["A"])
    assert len(await steps(learner)) == 1 and await pending(client, stream) == 2  # trained, not yet saved
    await producer.add(encode(t) for t in groups["B"])
    assert len(await steps(learner)) == 1 and await pending(client, stream) == 0  # saved at 2, then acked
    await producer.add(encode(t) for t in groups["C"])
    assert len(await steps(learner)) == 1 and await pending(client, stream) == 2  # update 3: not saved
    # ... the process dies here (no finish, no save). A new one resumes from the update-2 checkpoint.
    client2, _, learner2, _ = await make_learner(redis_url, tmp_path, tiny_dir, checkpoint_every=2)
    assert learner2.resume() and learner2.updates == 2
    assert len(await steps(learner2)) == 1 and learner2.version == 3
    assert learner2.redelivered == 2 and learner2.consumed_ids == [t.trajectory_id for t in groups["C"]]
    await learner2.finish()
    state = ckpt.load(ckpt.latest(tmp_path), learner2.policy)
    assert sorted(state.lineage) == sorted(t.trajectory_id for g in "ABC" for t in groups[g])
    assert await pending(client2, stream) == 0
    await client.aclose()
    await client2.aclose()


async def test_a_learner_that_dies_twice_inside_the_same_update_dead_letters_it(redis_url, tiny_dir, tmp_path):
    """The in-flight file is what survives a kill -9: an update listed there when a learner starts
    was never finished. The first time its entries are retrained, the second time dead-lettered
    (LearnerCrash), so a message that kills the process cannot crash-loop the learner."""
    client, producer, learner, stream = await make_learner(redis_url, tmp_path, tiny_dir)
    tok = learner.policy.tokenizer
    await producer.add(encode(t) for t in [traj(tok, "K", 1.0), traj(tok, "K", 0.0)])
    for attempt in range(2):  # twice: a learner takes the batch, writes the in-flight record, and dies
        client_n, _, dying, _ = await make_learner(redis_url, tmp_path, tiny_dir)
        dying.ledger.recover()
        units = None
        while units is None:
            units = await dying.batches.next_batch(dying.version)
        dying.ledger.begin(1, [e for u in units for e in u.entry_ids])  # ... kill -9 inside apply_update
        await client_n.aclose()
        assert InflightLedger(tmp_path).entries  # what the next process finds on disk
    client3, _, survivor, _ = await make_learner(redis_url, tmp_path, tiny_dir)
    await producer.add(encode(t) for t in [traj(tok, "L", 1.0), traj(tok, "L", 0.0)])
    done = await steps(survivor, 6)
    assert len(done) == 1 and survivor.consumed_ids[0] != "" and survivor.dead_lettered == 2
    reasons = await dead_reasons(client, stream)
    assert len(reasons) == 2 and all(r.startswith("LearnerCrash") for r in reasons)
    assert await pending(client, stream) == 0 and InflightLedger(tmp_path).strikes == {}
    await client.aclose()
    await client3.aclose()


async def test_stale_trajectories_bring_a_restarted_engine_up_to_the_published_weights(redis_url, tiny_dir, tmp_path):
    """Issue 63's soak: a policy engine killed right after a resume came back (its supervisor restarted it on
    the same port) serving the model it was started with, version 0. Every episode then came from version 0,
    too stale to train, so no update and no publish followed: 280 s without an update. The learner now pushes
    the last published weights to an engine behind them when stale trajectories arrive."""
    from infra.engine.client import EngineClient
    from infra.engine.server import start_embedded_engine

    engine = await start_embedded_engine(str(tiny_dir), max_batch_size=2)
    port = int(engine.url.rsplit(":", 1)[1])
    engines = EngineClient([engine.url], role="policy", timeout_s=60, health_interval_s=0.2)
    client, producer, learner, stream = await make_learner(redis_url, tmp_path, tiny_dir, max_staleness=0)
    learner.publisher = WeightPublisher(tmp_path, engines, keep=1)
    tok = learner.policy.tokenizer
    try:
        await producer.add(encode(t) for t in [traj(tok, "A", 1.0), traj(tok, "A", 0.0)])
        assert len(await steps(learner, 4)) == 1 and engine.batcher.weight_version == 1
        await engine.stop()  # killed and started again on its port between two requests of the learner's client
        engine = await start_embedded_engine(str(tiny_dir), port=port, max_batch_size=2)
        assert engine.batcher.weight_version == 0 and engines.servers[0].healthy
        stale = [traj(tok, "B", 1.0), traj(tok, "B", 0.0)]  # from version 0, learner at 1, max_staleness 0
        await producer.add(encode(t) for t in stale)
        assert await steps(learner, 4) == []
        assert learner.batches.set_aside.get("stale") == 2
        assert engine.batcher.weight_version == 1  # brought up to the published version, by the learner
    finally:
        await engines.close()
        await engine.stop()
        await client.aclose()


# ---- `dreamgym train` as a real process ------------------------------------------------------

def train_overrides(tmp: Path, data_dir: Path, model_dir: Path, total: int, *extra: str) -> list[str]:
    """A tiny real run: two TextWorld games, one worker, PPO (every trajectory trains: the counts
    are exact), micro-batches of one prompt and two epochs so an update lasts long enough to be
    killed inside, the reclaim idle time short so a resumed job takes its tasks back quickly."""
    return [f"infra.run_dir={tmp / 'runs'}", f"infra.data_dir={data_dir}", "infra.reclaim_idle_ms=1500",
            "infra.train_budget_s=120", f"engines.model={model_dir}", "engines.max_batch_size=8",
            "data.textworld_games=2", "data.textworld_heldout=1", "data.textworld_families=[custom]",
            "data.policies=[expert]", "data.episodes_per_task=1", "data.workers=1", "data.max_steps=4",
            "actors.env_kind=real", "actors.num_workers=1", "actors.group_size=2", "actors.concurrent_episodes=4",
            "actors.max_steps=3", "learner.algo=ppo", "learner.groups_per_update=2", "learner.micro_batch=1",
            "learner.epochs_per_batch=2", "learner.max_staleness=1000", "learner.checkpoint_every=2",
            "learner.keep_weights=1", f"learner.total_updates={total}", "curriculum.variants_per_seed=0",
            "evaluation.before=false", *extra]


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_orphans():
    """A failed test must not leave its `dreamgym train` job (and the job's Redis) running."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_train(overrides: list[str], name: str, log: Path, resume: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "infra.cli", "train", "--no-eval", "--name", name, *(["--resume"] if resume else []),
           *overrides]
    proc = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    STARTED.append(proc)
    return proc


def wait_update(run_dir: Path, update: int, proc: subprocess.Popen, timeout_s: float = 120) -> bool:
    """Until the in-flight record shows update `update` (or a later one) begun; True if it is still in flight."""
    path = run_dir / "learner_inflight.json"
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, f"train exited early with {proc.returncode}"
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            d = {}
        if d.get("update", 0) >= update:
            return bool(d.get("entries"))
        time.sleep(0.003)
    raise AssertionError(f"update {update} never began")


def finish(proc: subprocess.Popen, log: Path, timeout_s: float = 900) -> None:
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("train did not finish:\n" + log.read_text()[-3000:])
    assert rc == 0, log.read_text()[-3000:]


def account(url: str, prefix: str, run_dir: Path) -> dict:
    """pushed / acked / pending / trained / dead / lost over the run's trajectory stream and final checkpoint.

    The learner's acks trim the stream (infra.streams.trim_acked), so the entries it acked early
    are gone by now. Redis still counts them: XINFO STREAM's entries-added (every entry ever added,
    which trimming leaves alone) minus the stream's length is how many were trimmed. Every trimmed
    entry was acked by the learner group (trim_acked takes nothing pending or undelivered), so each
    must be accounted for, as by the rule above, by the dead-letter stream (its source id, whose copy
    there also tells a poison message) or by a trajectory id in the checkpoint's dedupe memory that
    no entry still in the stream or in the dead-letter stream carries. Those ids can only have come
    from trimmed entries, so `trimmed - dead - ids` is at least the number of trimmed entries lost
    (a duplicate add whose copy was trimmed also counts: the count errs toward failing)."""
    import redis as sync_redis

    from learner.batching import entry_key

    def tid_of(raw: bytes | None) -> str | None:
        try:
            return decode_as(raw, Trajectory).trajectory_id
        except Exception:  # a poison message: its fate is the dead-letter stream
            return None

    r = sync_redis.Redis.from_url(url)
    stream = trajectories_stream(prefix)
    tid = {eid.decode(): tid_of(fields.get(b"d")) for eid, fields in r.xrange(stream)}
    added = int(r.xinfo_stream(stream)["entries-added"])
    group = next(g for g in r.xinfo_groups(stream) if g["name"] == LEARNER_GROUP.encode())
    last = group["last-delivered-id"].decode()
    pend = {p["message_id"].decode() for p in r.xpending_range(stream, LEARNER_GROUP, "-", "+", 100_000)}
    dead, dead_tid = {}, {}
    for _, f in r.xrange(dead_letter_stream(stream)):
        source = f[b"source_id"].decode()
        dead[source], dead_tid[source] = f[b"error"].decode().split(":")[0], tid_of(f.get(b"d"))
    state = torch.load(ckpt.latest(run_dir) / ckpt.STATE_FILE, map_location="cpu", weights_only=False)["train_state"]
    seen, lineage = set(state["consumed_ids"]), state["lineage"]
    delivered = [e for e in tid if entry_key(e) <= entry_key(last)]
    acked = [e for e in delivered if e not in pend]
    lost = [e for e in acked if e not in dead and tid[e] not in seen]
    trimmed = added - len(tid)
    trimmed_dead = [e for e in dead if e not in tid]
    trimmed_ids = seen - set(tid.values()) - set(dead_tid.values())
    trimmed_unaccounted = trimmed - len(trimmed_dead) - len(trimmed_ids)
    poison = sum(t is None for t in tid.values()) + sum(dead_tid[e] is None for e in trimmed_dead)
    by_reason: dict[str, int] = {}
    for reason in dead.values():
        by_reason[reason] = by_reason.get(reason, 0) + 1
    r.close()
    return {"pushed": added - poison, "poison": poison, "acked": len(acked) + trimmed, "trimmed": trimmed,
            "pending": len(pend), "undelivered": len(tid) - len(delivered),
            "trained": len(lineage), "set_aside": len(seen) - len(set(lineage)), "dead_letters": by_reason,
            "lost": len(lost) + max(0, trimmed_unaccounted), "trimmed_unaccounted": trimmed_unaccounted,
            "updates": state["updates"]}


def report(name: str, figures: dict) -> None:
    print(f"\nFAULTS {name}: {json.dumps(figures)}")
    out = os.environ.get("DREAMGYM_FAULTS_REPORT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"test": name, **figures}) + "\n")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Games and offline data, built once for the module (DREAMGYM_FAULTS_DATA: reuse a directory)."""
    reuse = os.environ.get("DREAMGYM_FAULTS_DATA")
    return Path(reuse) if reuse else tmp_path_factory.mktemp("faults-data")


@pytest.mark.slow
def test_kill_9_of_the_whole_train_job_inside_an_update_then_resume_loses_nothing(tmp_path, data_dir, tiny_dir):
    """checkpoint_every=2; the whole process group (driver, engine, workers, learner and its embedded
    Redis) is killed with SIGKILL while update 4 is in flight, so update 3 is trained and acked in the
    old design but not saved. `--resume` must retrain what the update-2 checkpoint does not cover."""
    name, run_dir, log = "killed", tmp_path / "runs" / "killed", tmp_path / "train.log"
    proc = start_train(train_overrides(tmp_path, data_dir, tiny_dir, 6), name, log)
    inside = wait_update(run_dir, 4, proc, timeout_s=900)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    died_in = InflightLedger(run_dir)
    saved_at_kill = ckpt.latest(run_dir).name  # step_000002 unless the kill came late (a starved machine)
    resumed = start_train(train_overrides(tmp_path, data_dir, tiny_dir, 6), name, log, resume=True)
    finish(resumed, log)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["updates"] == 6
    with EmbeddedRedis(data_dir=run_dir / "redis", appendonly=True) as server:  # the run's own, reopened
        figures = account(server.url, f"dreamgym:{name}", run_dir)
    figures.update(killed_inside_update=inside, inflight_entries_at_kill=len(died_in.entries),
                   checkpoint_at_kill=saved_at_kill,
                   redelivered=summary["trajectories_redelivered"], updates=summary["updates"])
    report("kill -9 train + resume", figures)
    assert figures["lost"] == 0 and figures["updates"] == 6
    if saved_at_kill == "step_000002":  # update 3 was trained and not saved: it must come back
        assert summary["trajectories_redelivered"] >= 4
    assert figures["trained"] == 6 * 4  # PPO, 2 groups x 2 per update, each trained once into the lineage
    # the summary counts both segments: trajectories trained, and the update history up to the checkpoint
    assert summary["trajectories_trained"] == 6 * 4
    assert [r["version"] for r in summary["history"]] == list(range(1, 7))
    # train_seconds is rounded to 0.1 s in the summary; the history keeps full precision
    assert summary["train_seconds"] >= round(summary["history"][-1]["t"], 1)
    assert summary["history"][-1]["t"] > summary["history"][1]["t"]


@pytest.mark.slow
def test_kill_9_of_an_appendonly_redis_mid_run_the_run_goes_on(tmp_path, data_dir, tiny_dir):
    """The job's Redis (configured, appendonly) is killed with SIGKILL in the middle of update 2 and
    comes back 2 s later on the same port and directory: every client retries with backoff and the
    run reaches its budget with nothing lost."""
    name, run_dir, log = "redis-killed", tmp_path / "runs" / "redis-killed", tmp_path / "train.log"
    server = EmbeddedRedis(data_dir=tmp_path / "redis", appendonly=True).start()
    try:
        proc = start_train(train_overrides(tmp_path, data_dir, tiny_dir, 5, f"infra.redis_url={server.url}"),
                           name, log)
        wait_update(run_dir, 2, proc, timeout_s=400)
        server.proc.kill()
        server.proc.wait()
        time.sleep(2.0)
        server.start()
        finish(proc, log)
        summary = json.loads((run_dir / "summary.json").read_text())
        figures = account(server.url, f"dreamgym:{name}", run_dir)
        report("kill -9 redis mid-run", {**figures, "updates": summary["updates"]})
        assert summary["updates"] == 5 and figures["lost"] == 0 and figures["trained"] == 5 * 4
    finally:
        server.stop()


@pytest.mark.slow
def test_poison_trajectories_mid_run_are_dead_lettered_by_reason_and_training_goes_on(tmp_path, data_dir, tiny_dir):
    """Hostile entries added to a live run's trajectory stream (a NaN reward, log-probs of the wrong
    type, a 1 MiB+ state, bytes that are not msgpack): each lands in the dead-letter stream with its
    reason, `dreamgym status` counts them, and the run still trains to its budget losing nothing."""
    from tests.test_schema import _poisoned

    name, run_dir, log = "poisoned", tmp_path / "runs" / "poisoned", tmp_path / "train.log"
    poison = [_poisoned("step", "reward", float("nan")), _poisoned("step", "logprobs", ["x"]),
              _poisoned("step", "state", "x" * ((1 << 20) + 1)), b"\xc1 not msgpack"]
    with EmbeddedRedis() as server:
        proc = start_train(train_overrides(tmp_path, data_dir, tiny_dir, 4, f"infra.redis_url={server.url}"),
                           name, log)
        wait_update(run_dir, 1, proc, timeout_s=400)
        r = connect(server.url)

        async def inject() -> None:
            await StreamProducer(r, trajectories_stream(f"dreamgym:{name}")).add(poison)
            await r.aclose()

        asyncio.run(inject())
        finish(proc, log)
        summary = json.loads((run_dir / "summary.json").read_text())
        figures = account(server.url, f"dreamgym:{name}", run_dir)
        status = subprocess.run([sys.executable, "-m", "infra.cli", "status", "--json", "--redis-url", server.url,
                                 "--prefix", f"dreamgym:{name}"], capture_output=True, text=True, timeout=60)
    report("poison mid-run", {**figures, "updates": summary["updates"]})
    assert figures["poison"] == 4 and figures["dead_letters"] == {"InvalidField": 3, "MalformedMessage": 1}
    assert summary["updates"] == 4 and figures["lost"] == 0
    trajs = next(s for s in json.loads(status.stdout)["streams"] if s["stream"].endswith(":trajectories"))
    assert trajs["dead_letters"] == 4
