"""The FSDP2 learner (learner/fsdp.py, `learner.num_gpus`): two ranks are one process.

Two gloo ranks on this CPU, the tiny random Llama and the batch of tests/test_update.py:
the gradients after one sharded accumulation (each rank on its share of the
micro-batches, a zero-weighted stand-in where it has fewer) equal the single-process
ones, in score mode too, where micro-batches call the model different numbers of times;
a whole update with two mini-batches leaves the weights and the AdamW state of the
single-process update, gathered in the single-process checkpoint format, and the guard
undoes it on both ranks; `dreamgym train` with `learner.num_gpus=2` trains, publishes,
checkpoints and resumes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import signal
import socket
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_update import gradients, scored, tiny, units  # noqa: F401  (tiny is a fixture)

from infra.config import ConfigError, LearnerConfig, load_config
from infra.engine.models import load_tokenizer
from learner import checkpoint as ckpt
from learner.elastic_ranks import ElasticRanks
from learner.fsdp import RankFailure, Ranks, RanksGuard, check_ranks, shard
from learner.guard import NonFiniteUpdate, WeightGuard
from learner.policy_model import PolicyModel
from learner.precision import Precision
from learner.update import (Unit, accumulate_gradients, apply_update, chunks_of, fixed_inputs, new_optimizer,
                            rows_of)
from learner.weights import published_versions

# (algo, aggregate, kl_coef, score mode)
CASES = [("grpo", "sequence", 0.0, False), ("grpo", "token", 0.1, False), ("ppo", "token", 0.0, False),
         ("grpo", "sequence", 0.0, True)]


def _cfg(algo: str, aggregate: str = "sequence", kl: float = 0.0, **kw) -> LearnerConfig:
    return LearnerConfig(algo=algo, aggregate=aggregate, kl_coef=kl, staleness_mode="importance", micro_batch=3, **kw)


def _batch(tok, algo: str, score: bool) -> list[Unit]:
    return scored(tok, units(tok, algo)) if score else units(tok, algo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model_dir(tiny, tmp_path_factory):
    """The `tiny` model saved, so that every rank loads the same weights."""
    model, tok = tiny
    out = tmp_path_factory.mktemp("tiny-fsdp")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _accumulate_on_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """One rank of test (a): for each case, a sharded policy's gradients after one accumulation."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tok = load_tokenizer(model_dir)
    got = []
    for algo, aggregate, kl, score in CASES:
        cfg = _cfg(algo, aggregate, kl)
        policy = PolicyModel(model_dir, value_head=algo == "ppo")
        if policy.value_head is not None:  # as test_update.gradients: a non-zero head
            torch.manual_seed(1)
            torch.nn.init.normal_(policy.value_head.weight, std=0.1)
        if kl > 0:
            policy.snapshot_reference()
        share = shard(policy, world, "cpu")
        policy.train()
        rows = rows_of(_batch(tok, algo, score))
        chunks = chunks_of(rows, cfg.micro_batch)
        accumulate_gradients(policy, cfg, rows, chunks, fixed_inputs(policy, cfg, rows, chunks, share), share)
        grads = {n: p.grad.full_tensor() for n, p in policy.named_parameters() if p.grad is not None}
        got.append(grads)
    if rank == 0:
        torch.save(got, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_accumulate_the_single_process_gradients(tiny, tiny_model_dir, tmp_path):
    model, tok = tiny
    out = tmp_path / "grads.pt"
    mp.spawn(_accumulate_on_rank, args=(2, _free_port(), str(tiny_model_dir), str(out)), nprocs=2)
    got = torch.load(out)
    for (algo, aggregate, kl, score), grads in zip(CASES, got):
        want = gradients(model, tok, _cfg(algo, aggregate, kl), _batch(tok, algo, score))
        assert grads.keys() == want.keys() and len(want) > 10
        for name, g in want.items():
            torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-5, msg=f"{algo} {aggregate} {kl} {score} {name}")
    assert len(chunks_of(rows_of(units(tok, "grpo")), 3)) % 2 == 1  # unequal shares: rank 1 ran a stand-in


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_two_rank_update_is_the_single_process_update(tiny, tiny_model_dir, tmp_path, algo):
    """Two mini-batches, two AdamW steps: the gathered weights and optimizer state are the single
    process's, in its checkpoint format (so a checkpoint resumes with either); the guard undoes an
    update on both ranks; a single-process checkpoint loads into the ranks. A batch with alien token ids
    fails before any rank starts, a NaN loss is undone on both; a rank that dies makes the next update a
    RankFailure."""
    model, tok = tiny
    batch = units(tok, algo)
    cfg = _cfg(algo, minibatches=2, lr=1e-2, num_gpus=2)

    ref = PolicyModel(model=copy.deepcopy(model), tokenizer=tok, value_head=algo == "ppo")
    ref_opt = new_optimizer(ref, cfg)
    initial = ckpt.trainable_state_dict(ref)
    apply_update(ref, ref_opt, cfg, batch, version=0)
    want_model, want_opt = ckpt.trainable_state_dict(ref), ref_opt.state_dict()
    after = ckpt.save(tmp_path, ref, ref_opt, ckpt.TrainState(1, 1))

    policy = PolicyModel.for_learner(cfg, str(tiny_model_dir), Precision())
    ranks = Ranks.start(cfg, str(tiny_model_dir), policy, ElasticRanks())
    try:
        opt = new_optimizer(policy, cfg)
        guard = RanksGuard(ranks, WeightGuard(policy.trainable_parameters(), opt))
        guard.snapshot()
        stats = ranks.update(policy, opt, cfg, batch, 0)
        got_model, got_opt = ranks.state(opt)
        guard.restore()
        undone, undone_opt = ranks.state(opt)
        assert ranks.load(after, opt).updates == 1  # the single-process checkpoint, read by both ranks
        loaded_model, loaded_opt = ranks.state(opt)
        if algo == "grpo":
            # Label ids beyond the vocabulary (the schema lets them through): refused before any rank starts.
            alien = [Unit([dataclasses.replace(t, steps=[dataclasses.replace(s, choice_token_ids=[10 ** 6] * 4)
                                                         for s in t.steps]) for t in u.trajs],
                          u.advantages, u.corrected) for u in batch]
            with pytest.raises(IndexError, match="vocabulary"):
                ranks.update(policy, opt, cfg, alien, 1)
            # A NaN loss: every rank raises NonFiniteUpdate, the guard undoes it on both.
            guard.snapshot()
            nan = [Unit(u.trajs, [math.nan] * len(u.trajs), u.corrected) for u in batch]
            with pytest.raises(NonFiniteUpdate, match="loss"):
                ranks.update(policy, opt, cfg, nan, 1)
            guard.restore()
            assert all(torch.equal(w, loaded_model[n]) for n, w in ranks.state(opt)[0].items())
            os.kill(ranks.launcher.pids()[1], signal.SIGKILL)  # a rank gone: the ranks are out of step
            with pytest.raises(RankFailure, match="rank 1 exited with code -9"):
                ranks.update(policy, opt, cfg, batch, 1)
    finally:
        ranks.close()
    assert stats.trajectories == 6 and stats.tokens > 0
    assert got_model.keys() == want_model.keys() == undone.keys() and len(want_model) > 10
    for name, w in want_model.items():
        torch.testing.assert_close(got_model[name], w, rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(undone[name], initial[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(loaded_model[name], w, rtol=0, atol=0, msg=name)
    moved = max(float((w - initial[n]).abs().max()) for n, w in want_model.items())
    assert moved > 1e-3  # the update really moved the weights
    assert not undone_opt["state"]  # the guard also undid AdamW's first steps
    for got in (got_opt, loaded_opt):
        assert got["state"].keys() == want_opt["state"].keys()
        assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want_opt["param_groups"]]
        for i, st in want_opt["state"].items():
            assert int(got["state"][i]["step"]) == int(st["step"]) == 2
            torch.testing.assert_close(got["state"][i]["exp_avg"], st["exp_avg"], rtol=0, atol=1e-6)
            torch.testing.assert_close(got["state"][i]["exp_avg_sq"], st["exp_avg_sq"], rtol=0, atol=1e-6)


def test_num_gpus_is_checked_before_anything_starts():
    check_ranks(LearnerConfig(num_gpus=2))  # on the CPU: gloo ranks
    with pytest.raises(ConfigError, match="learner.lora_rank=0"):
        check_ranks(LearnerConfig(num_gpus=2, lora_rank=8))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="learner.device=cuda"):
            check_ranks(LearnerConfig(num_gpus=2, device="cuda"))
    with pytest.raises(ConfigError, match="learner.num_gpus"):
        load_config(None, ["learner.num_gpus=0"])


@pytest.mark.slow
async def test_train_with_two_learner_ranks_updates_publishes_and_resumes(tiny_run, tmp_path, caplog):
    """`dreamgym train learner.num_gpus=2` on the CPU: rank 0 in the driver, rank 1 a child; then --resume."""
    from infra.run.driver import train

    caplog.set_level(logging.INFO, logger="learner.fsdp")

    def cfg(total):
        return load_config(None, [*tiny_run, "learner.num_gpus=2", "learner.checkpoint_every=1",
                                  "learner.keep_weights=1", f"learner.total_updates={total}"])

    first = await train(cfg(1), "two-ranks", evaluate=False)
    assert first["updates"] == 1 and first["weight_version"] == 1
    assert "learner: 2 FSDP ranks on cpu, cpu" in caplog.messages
    run = tmp_path / "runs" / "two-ranks"
    assert published_versions(run) == [1]
    assert ckpt.read(ckpt.latest(run))["train_state"]["updates"] == 1
    assert not dist.is_initialized()  # the run's end stopped the ranks and left the group

    second = await train(cfg(2), "two-ranks", resume=True, evaluate=False)
    assert second["updates"] == 2 and second["weight_version"] == 2
    assert second["phases"][0]["updates"] == 1 and [r["version"] for r in second["history"]] == [1, 2]
    assert published_versions(run) == [2]


def _rank_pids() -> list[int]:
    """This process's elastic learner ranks (learner/elastic_ranks.py children)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "learner.elastic_ranks" in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:  # gone meanwhile (the run's other children come and go)
            pass
    return out


@pytest.mark.slow
async def test_a_rank_killed_mid_update_the_run_goes_on_from_its_checkpoint_with_nothing_lost(tiny_run, tmp_path,
                                                                                             redis_url):
    """`dreamgym train learner.num_gpus=2` (PPO, every trajectory trains: exact counts); rank 1 is killed
    with SIGKILL while update 3 is in flight, the update-2 checkpoint saved. The learner strikes update 3's
    entries, starts its ranks again from that checkpoint, retrains update 3 from its redelivered entries and
    finishes its 4 updates: nothing lost (tests/test_faults.account), every trajectory trained once."""
    from test_faults import account

    from infra.run.driver import train

    name, run_dir = "rank-killed", tmp_path / "runs" / "rank-killed"
    cfg = load_config(None, [*tiny_run, "learner.num_gpus=2", "learner.algo=ppo", "learner.groups_per_update=2",
                             "learner.micro_batch=1", "learner.epochs_per_batch=2", "learner.max_staleness=1000",
                             "learner.checkpoint_every=2", "learner.keep_weights=1", "learner.total_updates=4",
                             "infra.reclaim_idle_ms=1500"])
    killed: dict = {}

    def kill_inside_update_3() -> None:
        path, end = run_dir / "learner_inflight.json", time.monotonic() + 600
        while time.monotonic() < end:
            try:
                d = json.loads(path.read_text())
            except (OSError, ValueError):
                d = {}
            pids = _rank_pids()
            if d.get("update", 0) >= 3 and pids:
                os.kill(pids[0], signal.SIGKILL)
                killed.update(update=d["update"], inside=bool(d.get("entries")), pid=pids[0])
                return
            time.sleep(0.003)

    killer = threading.Thread(target=kill_inside_update_3, daemon=True)
    killer.start()
    summary = await train(cfg, name, evaluate=False)
    killer.join(5)
    print(f"\nRANK KILL {json.dumps({**killed, **{k: summary[k] for k in ('updates', 'updates_undone', 'trajectories_redelivered')}})}")
    assert killed.get("update") == 3, killed
    assert summary["updates"] == 4 and summary["weight_version"] == 4
    assert summary["updates_undone"] == {"RankFailure": 1}
    assert [r["version"] for r in summary["history"]][-2:] == [3, 4]
    figures = account(redis_url, f"dreamgym:{name}", run_dir)
    print(f"RANK KILL account {json.dumps(figures)}")
    assert figures["lost"] == 0 and figures["updates"] == 4
    assert figures["trained"] == 4 * 4  # PPO, 2 groups x 2 per update, each trained once into the lineage
    assert summary["trajectories_trained"] == 4 * 4
    assert killed["pid"] not in _rank_pids() and len(_rank_pids()) == 0  # the new rank 1 ended with the run
    assert not dist.is_initialized()


@pytest.mark.ray
@pytest.mark.slow
def test_ranks_as_ray_actors_make_the_single_process_update(tiny, tiny_model_dir):
    """The Ray launcher (infra/run/cluster/learner_ranks.py, what a learner actor uses): rank 1 is a Ray
    actor, rank 0 this process; one GRPO update gives the single-process weights, and a rank whose actor
    process is killed makes the next call a RankFailure naming it."""
    from infra.run.cluster.learner_ranks import RayRanks, rank_options
    from infra.run.cluster.runtime import init_ray, shutdown_ray

    model, tok = tiny
    batch = units(tok, "grpo")
    cfg = _cfg("grpo", minibatches=2, lr=1e-2, num_gpus=2)
    ref = PolicyModel(model=copy.deepcopy(model), tokenizer=tok)
    apply_update(ref, new_optimizer(ref, cfg), cfg, batch, version=0)
    want = ckpt.trainable_state_dict(ref)

    init_ray(num_cpus=2, memory_bytes=2 * 1024 ** 3, object_store_bytes=128 * 1024 ** 2)
    try:
        launcher = RayRanks(rank_options(cfg))
        policy = PolicyModel.for_learner(cfg, str(tiny_model_dir), Precision())
        ranks = Ranks.start(cfg, str(tiny_model_dir), policy, launcher)
        try:
            opt = new_optimizer(policy, cfg)
            assert ranks.update(policy, opt, cfg, batch, 0).trajectories == 6
            got, _ = ranks.state(opt)
            os.kill(launcher.pids()[1], signal.SIGKILL)
            with pytest.raises(RankFailure, match="rank 1 exited"):
                ranks.update(policy, opt, cfg, batch, 1)
        finally:
            ranks.close()
    finally:
        shutdown_ray()
    assert got.keys() == want.keys() and len(want) > 10
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=1e-5, msg=name)
