"""The experiment machinery of issue 14: real rollouts' tasks, sim-to-real's phase switch,
content-keyed caches, `dreamgym eval --tasks`, and `dreamgym experiment` end to end.

Real parts throughout: a real Redis, real TextWorld games made with tw-make, the embedded engine
serving SmolLM2, `dreamgym` commands run as a user runs them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import yaml

from actors import dataset
from actors.dataset import offline_settings, splits_path, splits_settings, stamp_matches, write_stamp
from actors.envs.registry import load_or_make_splits, tasks_from_spec
from actors.envs.textworld_env import game_file_problem
from infra.config import ConfigError, load_config, settings_key
from infra.run.artifacts import cached_model
from infra.run.experiment import (base_name, identical_repeats, load_experiment, markdown, regime_named, results, row,
                                  selected)
from infra.schema import Task
from learner import mexp_sft, policy_sft
from learner.weights import resolve_model, version_path
from simulator.curriculum import CurriculumScheduler

def tiny(model) -> list[str]:
    """A small real run: two TextWorld games, the tiny random Llama as policy and Mexp."""
    return [f"engines.model={model}", f"simulator.checkpoint={model}", *TINY]


TINY = ["engines.max_batch_size=4", "data.textworld_games=2",
        "data.textworld_heldout=2", "data.textworld_families=[custom]", "data.policies=[expert]",
        "data.episodes_per_task=1", "data.workers=1", "data.max_steps=4", "actors.num_workers=1",
        "actors.group_size=2", "actors.concurrent_episodes=2", "actors.max_steps=3", "learner.groups_per_update=1",
        "learner.checkpoint_every=100", "learner.keep_weights=1", "curriculum.variants_per_seed=0"]


async def test_real_rollouts_never_get_tasks_without_a_real_counterpart(redis_url):
    client = aioredis.from_url(redis_url)
    cfg = load_config(None, ["curriculum.batch_size=4", "curriculum.lam=1.0"]).curriculum
    seeds = [Task(f"s{i}", "do", game_file=f"/g{i}.z8") for i in range(3)]
    try:
        sched = CurriculumScheduler(client, cfg, "rr", seeds)
        await sched.start()
        await sched.pool.add([Task("v-1", "a variant", generated=True, parent_id="s0")])
        mixed = [t for _ in range(6) for t in await sched.next_batch()]
        assert any(t.generated for t in mixed)  # DreamGym plays variants...
        sched.real_only = True
        real = [t for _ in range(6) for t in await sched.next_batch()]
        assert real and all(t.game_file and not t.generated for t in real)  # ...real workers never do
    finally:
        await client.aclose()


async def test_real_rollouts_play_a_plug_in_environments_tasks_that_name_no_file(redis_url):
    """A user's own environment makes its tasks without a game file; they are real all the same (with
    a game-file test, `dreamgym train actors.env_kind=real` on a plug-in waited for groups forever)."""
    client = aioredis.from_url(redis_url)
    cfg = load_config(None, ["curriculum.batch_size=2"]).curriculum
    try:
        for enabled in (True, False):
            sched = CurriculumScheduler(client, dataclasses.replace(cfg, enabled=enabled), f"plug{enabled}",
                                        [Task(f"k{i}", "open the door", family="examples.keydoor:KeyDoorEnv")
                                         for i in range(3)])
            await sched.start()
            sched.real_only = True
            got = [t for _ in range(3) for t in await sched.next_batch()]
            assert got and {t.task_id for t in got} <= {"k0", "k1", "k2"}
    finally:
        await client.aclose()


def test_cache_keys_follow_the_settings_that_shape_each_artifact(tmp_path):
    base = load_config(None, [f"infra.data_dir={tmp_path}"])
    same_sft = dataclasses.replace(base, simulator=dataclasses.replace(base.simulator, temperature=0.1, max_steps=9))
    no_reasoning = dataclasses.replace(base, simulator=dataclasses.replace(base.simulator, reasoning=False))
    more_data = dataclasses.replace(base, data=dataclasses.replace(base.data, episodes_per_task=5))
    assert mexp_sft.cache_dir(same_sft) == mexp_sft.cache_dir(base)  # inference-only settings share a Mexp
    assert mexp_sft.cache_dir(no_reasoning) != mexp_sft.cache_dir(base)  # the no-reasoning ablation trains its own
    assert mexp_sft.cache_dir(more_data) != mexp_sft.cache_dir(base)  # other offline data, other Mexp
    assert policy_sft.cache_dir(no_reasoning) == policy_sft.cache_dir(base)  # the policy never sees Mexp settings
    warm = dataclasses.replace(base, learner=dataclasses.replace(base.learner, warm_start_steps=7))
    assert policy_sft.cache_dir(warm) != policy_sft.cache_dir(base)
    assert mexp_sft.cache_dir(base).parent == tmp_path / "mexp"

    built = []

    def build(path: Path) -> str:
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
        built.append(path)
        return ""

    for c in (base, same_sft, no_reasoning):  # a key change builds a new Mexp; the same key reuses it
        cached_model(mexp_sft.cache_dir(c), "Mexp", build)
    assert built == [mexp_sft.cache_dir(base), mexp_sft.cache_dir(no_reasoning)]


@pytest.mark.slow
def test_splits_whose_game_files_are_gone_or_damaged_are_made_again(tmp_path, caplog):
    """Splits hold absolute game paths: a data directory moved after they were made (a chaos soak given its
    old data under a new path) named games that no longer existed, and every episode failed at reset. Read
    from the moved directory they are made again there, with the same tasks; a damaged game likewise."""
    import shutil

    cfg = load_config(None, ["data.textworld_games=1", "data.textworld_heldout=1", "data.textworld_families=[custom]"])
    first = load_or_make_splits("textworld", cfg.data, tmp_path / "old")
    shutil.move(tmp_path / "old", tmp_path / "new")
    with caplog.at_level("WARNING"):
        moved = load_or_make_splits("textworld", cfg.data, tmp_path / "new")
    assert "game files are gone" in caplog.text and str(tmp_path / "old") in caplog.text
    assert [t.task_id for t in moved.train] == [t.task_id for t in first.train]
    files = [t.game_file for t in [*moved.train, *moved.heldout]]
    assert all(f.startswith(str(tmp_path / "new")) and os.path.isfile(f) for f in files), files
    with open(moved.train[0].game_file, "r+b") as f:  # a damaged game: its header's version byte zeroed
        f.write(b"\x00")
    caplog.clear()
    with caplog.at_level("WARNING"):
        again = load_or_make_splits("textworld", cfg.data, tmp_path / "new")
    assert "not a Z-machine game" in caplog.text
    assert game_file_problem(again.train[0].game_file) is None


@pytest.mark.slow
def test_splits_made_from_a_relative_data_dir_are_read_from_any_directory(tmp_path, monkeypatch, caplog):
    """infra.data_dir is relative by default: splits made from it held game paths relative to the directory
    they were made in, so `dreamgym eval` run from elsewhere found every game "gone" and rewrote splits.json."""
    cfg = load_config(None, ["data.textworld_games=1", "data.textworld_heldout=1", "data.textworld_families=[custom]"])
    monkeypatch.chdir(tmp_path)
    first = load_or_make_splits("textworld", cfg.data, "data")
    files = [t.game_file for t in [*first.train, *first.heldout]]
    assert all(os.path.isabs(f) and os.path.isfile(f) for f in files), files
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with caplog.at_level("WARNING"):
        again = load_or_make_splits("textworld", cfg.data, tmp_path / "data")
    assert "making the splits again" not in caplog.text
    assert [t.game_file for t in [*again.train, *again.heldout]] == files


@pytest.mark.slow
def test_splits_and_offline_stamps_rebuild_on_other_settings(tmp_path, monkeypatch):
    cfg = load_config(None, ["data.textworld_games=1", "data.textworld_heldout=1", "data.textworld_families=[custom]"])
    first = load_or_make_splits("textworld", cfg.data, tmp_path)
    assert [t.task_id for t in first.train] == ["custom-s0"]
    again = load_or_make_splits("textworld", cfg.data, tmp_path)
    assert [t.task_id for t in again.heldout] == [t.task_id for t in first.heldout]
    more = dataclasses.replace(cfg.data, textworld_games=2)
    assert len(load_or_make_splits("textworld", more, tmp_path).train) == 2  # not the cached 1-game split
    assert stamp_matches(splits_path(tmp_path, "textworld"), splits_settings("textworld", more, 0))
    assert {k for k in splits_settings("textworld", more, 0) if k.startswith("textworld_")} == \
        {k for k in dataclasses.asdict(more) if k.startswith("textworld_")}
    # An environment that renders states differently invalidates the splits (their initial states)
    # and, through the splits' key, the offline trajectories.
    offline_before = offline_settings("textworld", more, 0)
    monkeypatch.setitem(dataset._STATE_FORMAT, "textworld", dataset._STATE_FORMAT["textworld"] + 1)
    assert not stamp_matches(splits_path(tmp_path, "textworld"), splits_settings("textworld", more, 0))
    assert offline_settings("textworld", more, 0) != offline_before
    monkeypatch.undo()
    f = tmp_path / "offline.msgpack"
    f.write_bytes(b"")
    write_stamp(f, offline_settings("textworld", more, 0))
    assert stamp_matches(f, offline_settings("textworld", more, 0))
    assert not stamp_matches(f, offline_settings("textworld", dataclasses.replace(more, noise_eps=0.5), 0))
    assert settings_key({"a": 1, "b": [1, 2]}) == settings_key({"b": [1, 2], "a": 1})


def test_any_runs_published_weights_resolve_to_a_model_directory(tmp_path):
    run = tmp_path / "runs" / "r1"
    for v in (3, 12):
        version_path(run, v).mkdir(parents=True)
        (version_path(run, v) / "config.json").write_text("{}")
    assert resolve_model(run) == str(version_path(run, 12))  # the latest, numerically
    assert resolve_model(run / "weights") == str(version_path(run, 12))
    assert resolve_model(version_path(run, 3)) == str(version_path(run, 3))
    assert resolve_model("smollm2") == "smollm2"
    with pytest.raises(FileNotFoundError):
        resolve_model(tmp_path / "runs")  # no weights there
    with pytest.raises(FileNotFoundError):
        resolve_model(tmp_path / "nope" / "model")


@pytest.mark.slow
def test_eval_takes_a_directory_of_generated_games(tmp_path):
    from actors.envs.textworld_env import generate_game

    games = tmp_path / "mygames"
    for seed in (7, 8):
        generate_game("custom", seed, games)
    tasks = tasks_from_spec("textworld", str(games))
    assert sorted(t.task_id for t in tasks) == ["custom-s7", "custom-s8"] and all(t.instruction for t in tasks)
    assert [t.task_id for t in tasks_from_spec("textworld", str(games / "*s7.z8"))] == ["custom-s7"]
    with pytest.raises(ValueError):
        tasks_from_spec("textworld", str(tmp_path))
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "infra.cli", "eval", "--family", "textworld", "--policy", "expert",
                           "--tasks", str(games), "--out", str(out), f"infra.run_dir={tmp_path / 'runs'}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["episodes"] == 2 and report["success_rate"] == 1.0  # the expert solves both
    assert {r["task_id"] for r in report["per_task"]} == {"custom-s7", "custom-s8"}
    # each task records the expert's plan length from its start, and each evaluated row carries it with the
    # task's family (the results table's slices): the expert, following its plan, takes exactly that many steps
    plans = {t.task_id: t.meta["plan_length"] for t in tasks}
    assert all(n >= 1 for n in plans.values())
    assert {r["task_id"]: (r["family"], r["plan_length"]) for r in report["per_task"]} == \
        {t: ("textworld", n) for t, n in plans.items()}
    assert all(r["steps"] == r["plan_length"] for r in report["per_task"])


@pytest.mark.slow
async def test_sim_to_real_switches_phase_and_counts_real_transitions_exactly(redis_url, tmp_path, tiny_dir,
                                                                                monkeypatch):
    from infra.run.driver import train
    from tests.phase_guard import first_group_ends

    cfg = load_config(None, [f"infra.run_dir={tmp_path / 'runs'}", f"infra.data_dir={tmp_path / 'data'}",
                             f"infra.redis_url={redis_url}", "infra.train_budget_s=60", *tiny(tiny_dir),
                             "learner.total_updates=1", "learner.s2r_real_transitions=7", "learner.s2r_max_updates=3",
                             "simulator.write_back=false", "simulator.temperature=0"])
    # the random Mexp's output is rejected, so the DreamGym phase cannot reach its update: it ends at its
    # first pushed group instead of running out its 60 s guard (tests/phase_guard.py)
    ended = first_group_ends(monkeypatch, cfg, "s2r")
    try:
        summary = await train(cfg, "s2r")
    finally:
        await ended.aclose()
    kinds = [(p["phase"], p["env_kind"]) for p in summary["phases"]]
    assert kinds == [("DreamGym", "synthetic"), ("sim-to-real: real env", "real")]
    assert ended.fired and summary["phases"][0]["trajectories_pushed"] >= cfg.actors.group_size
    real = summary["phases"][1]
    assert real["real_transitions"] == 7 and real["transition_budget_spent"]  # exactly the budget
    assert summary["transitions"]["online_real"] == 7 and summary["phases"][0]["real_transitions"] == 0
    # the share of the real phase's transitions that reached an update (issue 64): counted, never above the budget
    assert summary["s2r_real_transitions"] == 7 and summary["s2r_real_transitions_trained"] == \
        real["real_transitions_trained"] <= 7
    assert summary["s2r_trained_share"] == round(real["real_transitions_trained"] / 7, 4)
    assert summary["transitions"]["offline_real"] > 0
    # greedy Mexp: the rejected replies' retries (and the group's repeats) come from the reply memo
    assert summary["phases"][0]["mexp_steps"]["memo_hits"] > 0 and "mexp_steps" not in real
    assert "the reply memo answered" in (tmp_path / "runs" / "s2r" / "report.md").read_text()
    # the synthetic phase alone was evaluated on the held-out games before the real phase began, and the
    # experiment's row pairs it with the final evaluation (what the real phase added)
    between = summary["phases"][0]["heldout_after"]
    assert between["episodes"] == summary["heldout_after"]["episodes"] == 2 and "heldout_after" not in real
    assert {t["task_id"] for t in between["per_task"]} == {t["task_id"] for t in summary["heldout_after"]["per_task"]}
    (b,) = row("s2r", "", [summary], None, "")["between_phases"]
    assert b["after"] == "DreamGym" and b["gain_after"]["tasks"] == 2
    assert b["gain_after"]["diff"] == pytest.approx(summary["heldout_after"]["success_rate"] - between["success_rate"])
    assert "| after DreamGym |" in (tmp_path / "runs" / "s2r" / "report.md").read_text()


@pytest.mark.slow
def test_experiment_runner_writes_complete_results(tmp_path, tiny_dir):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"infra": {"run_dir": str(tmp_path / "runs"), "data_dir": str(tmp_path / "data"),
                                              "train_budget_s": 1200}}))
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "tiny", "about": "two regimes on two held-out games", "base": str(base),
        "overrides": [*tiny(tiny_dir), "evaluation.training_tasks=true"],
        "compare_to": "base",
        "regimes": {"base": {"about": "the untrained policy", "overrides": ["learner.total_updates=0"]},
                    "real_grpo": {"about": "GRPO in the real games, 6 real transitions",
                                  "overrides": ["actors.env_kind=real", "actors.real_transitions=6",
                                                "learner.total_updates=2"]}}}))
    exp = load_experiment(spec)
    assert [r.name for r in exp.regimes] == ["base", "real_grpo"]
    cmd = [sys.executable, "-m", "infra.cli", "experiment", str(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "runs" / "tiny"
    res = json.loads((out / "results.json").read_text())
    rows = {r["regime"]: r for r in res["regimes"]}
    assert set(rows) == {"base", "real_grpo"} and res["missing"] == []
    assert rows["base"]["real_transitions"] == 0 and rows["real_grpo"]["real_transitions"] == 6
    assert rows["base"]["episodes"] == rows["real_grpo"]["episodes"] == 2
    assert rows["real_grpo"]["vs"] == "base" and rows["real_grpo"]["diff_tasks"] == 2
    # the held-out slices from what the runs recorded: both held-out games are unseen seeds of the one trained family
    trained = json.loads((out / "real_grpo" / "summary.json").read_text())["training_tasks"]
    assert trained["families"] == ["custom"] and trained["tasks"] == 2 and trained["plan_length_max"] >= 1
    assert rows["real_grpo"]["slices"]["seen"]["tasks"] == 2 and rows["real_grpo"]["slices"]["unseen"] == {"tasks": 0}
    assert "diff" in rows["real_grpo"]["slices"]["seen"] and "## Held-out success by slice" in \
        (out / "results.md").read_text()
    # evaluation.training_tasks: each run also played its two training games, paired with the baseline's in the slices
    run = json.loads((out / "real_grpo" / "summary.json").read_text())
    assert run["train_after"]["episodes"] == 2 and rows["real_grpo"]["slices"]["training"]["diff_tasks"] == 2
    assert {t["task_id"] for t in run["train_after"]["per_task"]}.isdisjoint(t["task_id"] for t in run["heldout_after"]["per_task"])
    assert "its training tasks % (not held out)" in (out / "results.md").read_text()
    assert "| after, on its training tasks |" in (out / "real_grpo" / "report.md").read_text()
    assert rows["real_grpo"]["mexp_answered"] is None  # no DreamGym phase: no share of Mexp-answered steps
    assert (out / "results.md").read_text().count("|") > 10 and (out / "success_vs_real.png").stat().st_size > 1000
    anchors = res["anchors"]  # the scripted floor and ceiling on the same held-out games
    assert anchors["expert"]["success_rate"] == 1.0 and anchors["random"]["episodes"] == 2
    assert "Scripted choosers on the same held-out games: random" in (out / "results.md").read_text()
    walls = [rows[r]["wall_seconds"] for r in ("base", "real_grpo")]  # the table's time: its regimes' own, summed
    assert res["table_seconds"] == pytest.approx(sum(walls)) and res["table_regimes_run"] == 2
    assert "Wall time: the table's 2 regimes took 0 h" in proc.stdout and "Wall time" in (out / "results.md").read_text()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # resumable: nothing to redo
    assert again.returncode == 0 and again.stdout.count("finished earlier, skipped") == 2
    # a regime stopped after a learner checkpoint (here: its summary lost) continues from it, and still
    # reports the real transitions its earlier segment used (the run's Redis counter)
    (out / "real_grpo" / "summary.json").unlink()
    resumed = subprocess.run([*cmd, "--only", "real_grpo"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "real_grpo: resuming from" in resumed.stdout and not list(out.glob("real_grpo.old-*"))
    assert "learner.learner: resumed from" in (out / "real_grpo" / "train.log").read_text()
    rows = {r["regime"]: r for r in json.loads((out / "results.json").read_text())["regimes"]}
    assert rows["real_grpo"]["real_transitions"] == 6
    # an evaluation-only change evaluates the finished run's weights again, in place, and trains nothing
    doc = yaml.safe_load(spec.read_text())
    doc["regimes"]["real_grpo"]["overrides"].append("evaluation.training_tasks=false")
    spec.write_text(yaml.safe_dump(doc))
    trained = json.loads((out / "real_grpo" / "summary.json").read_text())
    again = subprocess.run([*cmd, "--only", "real_grpo"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "evaluating its weights again, not retraining" in " ".join(again.stdout.split())
    evaluated = json.loads((out / "real_grpo" / "summary.json").read_text())
    assert not list(out.glob("real_grpo.old-*")) and evaluated["train_after"] is None
    assert evaluated["updates"] == trained["updates"] and evaluated["history"] == trained["history"]
    assert evaluated["heldout_after"]["per_task"] == trained["heldout_after"]["per_task"]  # greedy: the same weights
    # a regime that `continues` another starts from its finished run (sim-to-real after dreamgym_grpo):
    # the run is copied under the new name, its Redis keys renamed, and resumed past the source's updates
    doc["regimes"]["real_more"] = {"continues": "real_grpo", "overrides": [*doc["regimes"]["real_grpo"]["overrides"],
                                                                            "learner.s2r_real_transitions=3"]}
    spec.write_text(yaml.safe_dump(doc))
    more = subprocess.run([*cmd, "--only", "real_more"], capture_output=True, text=True, timeout=600)
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    source = json.loads((out / "real_grpo" / "summary.json").read_text())
    assert f"real_more: continuing real_grpo's finished run ({source['updates']} updates)" in " ".join(more.stdout.split())
    log = (out / "real_more" / "train.log").read_text()
    assert "learner.learner: resumed from" in log and "real transitions already spent (resumed)" in " ".join(log.split())
    summary = json.loads((out / "real_more" / "summary.json").read_text())
    assert summary["phases"][0]["earlier_segment"] and "done in an earlier segment" in \
        (out / "real_more" / "report.md").read_text()  # the source's phase, not a phase that did nothing
    # the source's exact counters came along under the new name: its 6 real transitions (so its spent budget
    # ended the resumed phase at once), its pushed trajectories, its updates
    assert summary["transitions"]["online_real"] == 6 and summary["updates"] == source["updates"]
    rows = {r["regime"]: r for r in json.loads((out / "results.json").read_text())["regimes"]}
    # its history holds the source's clock at its last update (none where the source made no update) ...
    carried = source["history"][-1]["wall"] if source["history"] else 0.0
    assert summary["total_seconds"] > carried and summary["history"][:len(source["history"])] == source["history"]
    assert rows["real_more"]["wall_seconds"] == pytest.approx(summary["total_seconds"] - carried)  # ... not its own
    assert summary["trajectories_pushed"] == source["trajectories_pushed"] > 0


def test_a_regime_compares_to_its_own_baseline_where_it_names_one(tmp_path):
    spec = tmp_path / "exp.yaml"
    spec.write_text(yaml.safe_dump({"compare_to": "sft", "regimes": {
        "sft": {}, "sft_strong": {}, "rl": {}, "rl_strong": {"compare_to": "sft_strong"}}}))
    exp = load_experiment(spec)

    def summary(wins: list[int]) -> dict:
        per_task = [{"task_id": f"g{i}", "success": bool(w)} for i, w in enumerate(wins)]
        return {"heldout_after": {"success_rate": sum(wins) / len(wins), "episodes": len(wins),
                                  "successes": sum(wins), "per_task": per_task}}

    res = results(exp, {"sft": [summary([0, 0, 0, 1])], "sft_strong": [summary([1, 1, 0, 1])],
                        "rl": [summary([1, 0, 0, 1])], "rl_strong": [summary([1, 1, 1, 1])]})
    rows = {r["regime"]: r for r in res["regimes"]}
    assert "vs" not in rows["sft"]
    assert rows["rl"]["vs"] == "sft" and rows["rl"]["diff"] == pytest.approx(0.25)
    assert rows["rl_strong"]["vs"] == "sft_strong" and rows["rl_strong"]["diff"] == pytest.approx(0.25)
    assert rows["sft_strong"]["vs"] == "sft" and rows["sft_strong"]["diff"] == pytest.approx(0.5)
    md = markdown(res)  # the column names sft; a row with another baseline says which
    assert "Δ vs sft (pts)" in md and "] vs sft_strong |" in md and md.count(" vs sft_strong") == 1


def test_repeats_run_under_their_own_names_and_pool_into_one_row(tmp_path):
    """`dreamgym experiment --repeats K` as a user runs it: the repeats of a finished regime are skipped by
    name (<regime>.r2), --list counts them, and the results take the mean of a regime's runs with an
    interval over runs and tasks that two disagreeing runs widen."""
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"infra": {"run_dir": str(tmp_path / "runs"), "data_dir": str(tmp_path / "data")}}))
    spec = tmp_path / "exp.yaml"
    spec.write_text(yaml.safe_dump({"name": "rep", "base": str(base), "compare_to": "sft", "regimes": {
        "sft": {"overrides": ["learner.total_updates=0"]}, "rl": {},
        "s2r": {"continues": "rl", "overrides": ["learner.s2r_real_transitions=9"]}}},
        sort_keys=False))
    exp = load_experiment(spec)
    s2r2 = regime_named(exp, "s2r.r2")  # a continuing regime's repeat continues its source's repeat
    assert (s2r2.name, s2r2.continues, base_name(s2r2.name)) == ("s2r.r2", "rl.r2", "s2r")
    assert exp.config(s2r2).infra.run_seed == 1 and exp.config(regime_named(exp, "s2r")).infra.run_seed == 0
    assert exp.config(s2r2).learner.s2r_real_transitions == 9  # the regime's own overrides stay
    wins = {"sft": [0] * 12 + [1] * 12, "rl": [1] * 22 + [0] * 2, "rl.r2": [0] * 10 + [1] * 14}
    for name, w in wins.items():
        (tmp_path / "runs" / "rep" / name).mkdir(parents=True)
        per_task = [{"task_id": f"g{i}", "success": bool(x)} for i, x in enumerate(w)]
        (tmp_path / "runs" / "rep" / name / "summary.json").write_text(json.dumps({"heldout_after": {
            "success_rate": sum(w) / len(w), "episodes": len(w), "successes": sum(w), "per_task": per_task}}))
    (tmp_path / "runs" / "rep" / "anchors").mkdir()  # the scripted choosers' cache: no game is played here
    for policy in ("random", "expert"):
        (tmp_path / "runs" / "rep" / "anchors" / f"{policy}.json").write_text(json.dumps(
            {"success_rate": 0.25, "ci_low": 0.1, "ci_high": 0.4, "episodes": 24, "mean_steps": 3.0}))
    cmd = [sys.executable, "-m", "infra.cli", "experiment", str(spec)]
    listed = subprocess.run([*cmd, "--list"], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert [line.split()[:3] for line in listed.stdout.splitlines()] == [["sft", "done"], ["rl", "done", "×2"],
                                                                         ["s2r", "to", "run"]]
    ran = subprocess.run([*cmd, "--only", "sft,rl", "--repeats", "2"], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "rl: finished earlier, skipped (2/3)" in ran.stdout and "rl.r2: finished earlier, skipped (3/3)" in ran.stdout
    # SFT alone (no update, greedy evaluation) would repeat itself exactly: it runs once, and says so
    assert "sft: finished earlier, skipped (1/3)" in ran.stdout and "sft.r2" not in ran.stdout
    assert "sft: no RL update and greedy evaluation" in " ".join(ran.stdout.split())
    rows = {r["regime"]: r for r in json.loads((tmp_path / "runs" / "rep" / "results.json").read_text())["regimes"]}
    assert set(rows) == {"sft", "rl"} and rows["rl"]["runs"] == [22 / 24, 14 / 24]
    assert rows["rl"]["success_rate"] == pytest.approx(36 / 48) and rows["rl"]["diff"] == pytest.approx(36 / 48 - 0.5)
    alone = row("rl", "", [json.loads((tmp_path / "runs" / "rep" / "rl" / "summary.json").read_text())],
                None, "")  # the first run alone: a Wilson interval, narrower than the two runs' pooled one
    assert rows["rl"]["ci_high"] - rows["rl"]["ci_low"] > alone["ci_high"] - alone["ci_low"]
    assert "75.0 [" in (tmp_path / "runs" / "rep" / "results.md").read_text()
    assert "; 2 runs: 91.7, 58.3 |" in (tmp_path / "runs" / "rep" / "results.md").read_text()
    # run by run, paired by run seed: rl 22/24 and 14/24 against sft's 12/24
    assert rows["rl"]["run_seeds"] == [0, 1] and rows["rl"]["run_diffs"] == pytest.approx([10 / 24, 2 / 24])
    assert "| rl | 91.7 (+41.7) | 58.3 (+8.3) | 75.0 (+25.0) |" in (tmp_path / "runs" / "rep" / "results.md").read_text()
    bad = subprocess.run([*cmd, "--repeats", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--repeats must be at least 1" in bad.stdout + bad.stderr


def test_the_table_is_every_regime_but_the_extra_ones(tmp_path):
    # the CPU preset's default run is the paper's table; the strong-start variants run when named
    exp = load_experiment("configs/experiments/textworld_cpu.yaml")
    table = [r.name for r in selected(exp, [])]
    # the claims' regimes first, the ablations with a Mexp of their own after those that reuse the full
    # regime's, PPO last (no claim needs it): a table stopped short has checked the most it could
    assert table == ["base", "sft", "dreamgym_grpo", "real_grpo", "dreamgym_s2r", "no_replay", "no_curriculum",
                     "no_writeback", "no_retrieval", "no_reasoning", "real_ppo", "dreamgym_ppo"]
    assert [r.name for r in selected(exp, ["sft_strong", "sft"])] == ["sft", "sft_strong"]  # file order
    # the untrained and warm-started policies, evaluated greedily, are the same in every repeat
    assert [r.name for r in exp.regimes if identical_repeats(exp, r)] == ["base", "sft", "sft_8steps", "sft_long",
                                                                          "sft_strong", "sft_generate"]
    assert len(selected(exp, [], everything=True)) == len(exp.regimes) > len(table)
    # an extra regime that has not run is not missing from the table; a finished one is reported
    res = results(exp, {})
    assert res["missing"] == table
    spec = tmp_path / "exp.yaml"
    spec.write_text(yaml.safe_dump({"regimes": {"a": {}, "b": {"extra": True}}}))
    done = {"heldout_after": {"success_rate": 1.0, "episodes": 1, "successes": 1,
                              "per_task": [{"task_id": "g", "success": True}]}}
    res = results(load_experiment(spec), {"b": [done]})
    assert res["missing"] == ["a"] and [r["regime"] for r in res["regimes"]] == ["b"]
    assert res["table_regimes_run"] == 0 and "Wall time" not in markdown(res)  # an extra regime is not the table's
    # the table's wall time: its regimes' runs summed, repeats included, extra regimes not
    spec.write_text(yaml.safe_dump({"regimes": {"a": {}, "c": {}, "d": {}, "b": {"extra": True}}}))
    res = results(load_experiment(spec), {"a": [{**done, "total_seconds": 3000.0}, {**done, "total_seconds": 1000.0}],
                                          "c": [{**done, "total_seconds": 1500.0}], "b": [{**done, "total_seconds": 9e3}]})
    assert res["table_seconds"] == 5500.0 and res["table_regimes_run"] == 2
    assert "Wall time: 2 of the table's 3 regimes took 1 h 31 min" in markdown(res)
    # a run that continues another carries its history, so its total holds the source's time: counted once
    spec.write_text(yaml.safe_dump({"regimes": {"a": {}, "s": {"continues": "a",
                                                               "overrides": ["learner.s2r_real_transitions=9"]}}}))
    # (to the source's last update: its final evaluation after it is not carried)
    res = results(load_experiment(spec), {"a": [{**done, "total_seconds": 3000.0, "history": [{"wall": 2900.0}]}],
                                          "s": [{**done, "total_seconds": 3200.0}]})
    assert [r["wall_seconds"] for r in res["regimes"]] == [3000.0, 300.0] and res["table_seconds"] == 3300.0
    spec.write_text(yaml.safe_dump({"regimes": {"a": {"extra": "yes"}}}))
    with pytest.raises(ConfigError, match="regimes.a.extra must be true or false"):
        load_experiment(spec)


def test_the_miniwob_preset_runs_the_main_regimes_on_web_pages():
    # textworld_cpu.yaml's recipe on MiniWoB++ pages: its own data directory, held-out tasks never trained on,
    # and sim-to-real with a tenth of real GRPO's real transitions
    exp = load_experiment("configs/experiments/miniwob_cpu.yaml")
    assert [r.name for r in selected(exp, [])] == ["base", "sft", "dreamgym_grpo", "real_grpo", "dreamgym_s2r",
                                                   "no_replay"]
    cfgs = {r.name: exp.config(r) for r in exp.regimes}
    assert {c.actors.env_family for c in cfgs.values()} == {"miniwob"}
    assert {c.infra.data_dir for c in cfgs.values()} == {"data/exp-miniwob"}
    data = cfgs["sft"].data
    assert data.miniwob_heldout and not set(data.miniwob_heldout) & set(data.miniwob_tasks)
    assert 10 * cfgs["dreamgym_s2r"].learner.s2r_real_transitions == cfgs["real_grpo"].actors.real_transitions
    assert cfgs["dreamgym_grpo"].actors.env_kind == "synthetic" and cfgs["real_grpo"].actors.env_kind == "real"


def test_no_replay_is_dreamgym_with_every_step_asked_of_mexp():
    """Every preset with a DreamGym GRPO regime has its paper-faithful twin, loaded through the real loader: the
    same run but for simulator.replay_real (retrieval still on), the same cached Mexp, in the table, and the
    regime claim 1 is checked on a second time."""
    presets = sorted(Path("configs/experiments").glob("*.yaml"))
    assert {"textworld_cpu", "textworld_gpu", "miniwob_cpu", "textworld_long", "alfworld_cpu"} <= {p.stem for p in presets}
    for preset in presets:
        exp = load_experiment(preset)
        regimes = {r.name: r for r in exp.regimes}
        if "dreamgym_grpo" not in regimes:
            continue
        assert "no_replay" in [r.name for r in selected(exp, [])], preset  # the table's, not an extra
        faithful, full = exp.config(regimes["no_replay"]), exp.config(regimes["dreamgym_grpo"])
        a, b = faithful.to_dict(), full.to_dict()
        assert [f"{s}.{k}" for s in a for k in a[s] if a[s][k] != b[s][k]] == ["simulator.replay_real"], preset
        assert not faithful.simulator.replay_real and full.simulator.replay_real and faithful.simulator.retrieval
        assert faithful.actors.env_kind == "synthetic" and faithful.learner.total_updates > 0
        assert mexp_sft.cache_dir(faithful) == mexp_sft.cache_dir(full)  # replay acts when serving, not in SFT
        assert exp.roles.dreamgym_faithful == "no_replay"


def test_experiment_files_are_validated_before_anything_runs(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"regimes": {"a": {"overrides": ["learner.lr=abc"]}}}))
    with pytest.raises(ConfigError, match="regime a: learner.lr"):
        load_experiment(bad)
    bad.write_text(yaml.safe_dump({"compare_to": "zzz", "regimes": {"a": {}}}))
    with pytest.raises(ConfigError, match="compare_to"):
        load_experiment(bad)
    bad.write_text(yaml.safe_dump({"regimes": {"a": {}, "b": {"compare_to": "zzz"}}}))
    with pytest.raises(ConfigError, match="regimes.b.compare_to: 'zzz'"):
        load_experiment(bad)
    # a regime continues another only when that one's run is its first part: same settings but sim-to-real's
    bad.write_text(yaml.safe_dump({"regimes": {"a": {}, "b": {"continues": "zzz"}}}))
    with pytest.raises(ConfigError, match="'zzz' is not another regime"):
        load_experiment(bad)
    bad.write_text(yaml.safe_dump({"regimes": {"a": {}, "b": {"continues": "a", "overrides": ["learner.lr=1e-3"]}}}))
    with pytest.raises(ConfigError, match="differ in learner.lr"):
        load_experiment(bad)
    # the real phase's budget, rollout temperature and task selection act after the source's run
    bad.write_text(yaml.safe_dump({"regimes": {"a": {}, "b": {"continues": "a", "overrides": [
        "learner.s2r_real_transitions=9", "learner.s2r_temperature=1.5", "learner.s2r_selection=curriculum"]}}}))
    assert load_experiment(bad).regimes[1].continues == "a"
    for shipped in [*Path("configs/experiments").glob("*.yaml"), *Path("benchmarks/gpu").glob("*.yaml")]:
        assert load_experiment(shipped).regimes  # every shipped experiment loads (the GPU lease's too)


def test_a_forked_run_keeps_its_redis_state_under_the_new_name(tmp_path):
    """infra/run/fork.py on a real appendonly Redis: streams (with their group's pending entries) and
    counters move to the new prefix, the source's end (summary, log) stays behind, the checkpoint comes."""
    import redis as sync_redis

    from infra.redis_server import EmbeddedRedis
    from infra.run.fork import fork_run

    src, dst = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    (src / "checkpoints" / "step_3").mkdir(parents=True)
    (src / "checkpoints" / "step_3" / "state.pt").write_bytes(b"x")
    (src / "summary.json").write_text("{}")
    (src / "train.log").write_text("the source's log")
    (src / "history.json").write_text("[]")
    with EmbeddedRedis(data_dir=src / "redis", appendonly=True, password="") as server:
        c = sync_redis.Redis(port=server.port)
        c.xadd("dg:a:trajectories", {"b": b"1"})
        c.xgroup_create("dg:a:trajectories", "learner", id="0")
        c.xreadgroup("learner", "l1", {"dg:a:trajectories": ">"})  # one pending entry
        c.set("dg:a:budget:real_steps", 6)
        c.set("dg:ab:other", 1)  # another run whose name starts the same: not ours
        c.close()
    last = fork_run(src, dst, "dg:a", "dg:b")
    assert last == dst / "checkpoints" / "step_3" and (dst / "history.json").exists()
    assert not (dst / "summary.json").exists() and not (dst / "train.log").exists()
    with EmbeddedRedis(data_dir=dst / "redis", appendonly=True, password="") as server:
        c = sync_redis.Redis(port=server.port)
        assert sorted(k.decode() for k in c.keys("*")) == ["dg:ab:other", "dg:b:budget:real_steps", "dg:b:trajectories"]
        assert int(c.get("dg:b:budget:real_steps")) == 6
        assert c.xpending("dg:b:trajectories", "learner")["pending"] == 1
        c.close()
    with EmbeddedRedis(data_dir=src / "redis", appendonly=True, password="") as server:  # the source is untouched
        c = sync_redis.Redis(port=server.port)
        assert int(c.get("dg:a:budget:real_steps")) == 6
        c.close()
    with pytest.raises(ValueError, match="not empty"):
        fork_run(src, dst, "dg:a", "dg:b")
