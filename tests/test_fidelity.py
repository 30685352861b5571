"""Fidelity metrics against slow obvious references, and a teacher-forced replay."""

from __future__ import annotations

import json
import logging
import math

import numpy as np

import pytest

from infra.config import SimulatorConfig
from infra.schema import Step, Task, Trajectory
from infra import metrics
from simulator.fidelity import (FidelityProbe, even_spread, item_recall, item_tv_distance, judge, judge_scores,
                                log_tenths, replay, summarize, token_f1)
from simulator.mexp_data import build_examples

REAL = "Goal: g\nRoom: Hall.\nActions:\n[1] go north\n[2] open door\n[3] take key"


def _slow_f1(pred: str, real: str) -> float:
    import re

    p, r = re.findall(r"\w+", pred.lower()), re.findall(r"\w+", real.lower())
    if not p and not r:
        return 1.0
    common, rest = 0, list(r)
    for w in p:
        if w in rest:
            rest.remove(w)
            common += 1
    if not common:
        return 0.0
    prec, rec = common / len(p), common / len(r)
    return 2 * prec * rec / (prec + rec)


@pytest.mark.parametrize("pred", ["", REAL, "Room: Hall.\nActions:\n[1] go north", "the the door door key", "x y z"])
def test_token_f1_matches_reference(pred):
    assert token_f1(pred, REAL) == pytest.approx(_slow_f1(pred, REAL))


def test_item_recall():
    assert item_recall(REAL, REAL) == 1.0
    assert item_recall("Room: x\n[4] take key\n[9] Go North", REAL) == pytest.approx(2 / 3)
    assert item_recall("no items", REAL) == 0.0


def _slow_tv(pred: str, real: str) -> float:
    """0.5 * sum |p(x) - q(x)| over the union, p and q uniform over each state's item texts."""
    import re

    def items(s: str) -> list[str]:
        return sorted({m.strip().lower() for m in re.findall(r"^\[\d+\]\s*(.+)$", s, re.M)})
    a, b = items(pred), items(real)
    if not a or not b:
        return 0.0 if not a and not b else 1.0
    return 0.5 * sum(abs((x in a) / len(a) - (x in b) / len(b)) for x in set(a) | set(b))


@pytest.mark.parametrize("pred", [REAL, "Room: x\n[4] take key\n[9] Go North", "Room: x\n[1] jump",
                                  "Room: x\nActions:\n[1] go north\n[2] open door\n[3] take key\n[4] eat apple"])
def test_item_tv_distance_matches_reference(pred):
    assert item_tv_distance(pred, REAL) == pytest.approx(_slow_tv(pred, REAL))


def test_item_tv_distance_of_unparseable_state_is_one():
    assert item_tv_distance("no items", REAL) == 1.0


def test_summarize_counts_rejections_as_wrong():
    recs = [dict(parsed=True, reward=1.0, true_reward=1.0, done=True, true_done=True, item_recall=1.0, token_f1=1.0),
            dict(parsed=True, reward=0.0, true_reward=1.0, done=False, true_done=True, item_recall=0.5, token_f1=0.5),
            dict(parsed=False, reward=0.0, true_reward=0.0, done=False, true_done=False, item_recall=0.0, token_f1=0.0)]
    s = summarize(recs)
    assert s["parse_failure_rate"] == pytest.approx(1 / 3)
    assert s["reward_accuracy"] == pytest.approx(1 / 3) and s["done_accuracy"] == pytest.approx(1 / 3)
    assert s["delta_r_mean"] == 0.5 and s["delta_r_max"] == 1.0
    assert s["item_recall"] == pytest.approx(0.5)


def test_summarize_says_how_rare_rewards_are_predicted():
    """1 real reward caught of 2, 1 of Mexp's 2 rewards real: a Mexp that never rewards would score 0.6."""
    def rec(reward, true_reward, parsed=True):
        return dict(parsed=parsed, reward=reward, true_reward=true_reward, done=False, true_done=False,
                    item_recall=1.0, token_f1=1.0)
    s = summarize([rec(1.0, 1.0), rec(0.0, 1.0), rec(1.0, 0.0), rec(0.0, 0.0), rec(0.0, 0.0, parsed=False)])
    assert s["reward_accuracy"] == pytest.approx(2 / 5)  # the rejected step counts as wrong
    assert s["reward_recall"] == pytest.approx(1 / 2) and s["reward_precision"] == pytest.approx(1 / 2)
    assert s["reward_accuracy_all_zero"] == pytest.approx(3 / 5)
    assert s["reward_false_positive_rate"] == pytest.approx(1 / 3)  # 1 false reward over 3 unrewarded steps
    nothing = summarize([rec(0.0, 0.0)])
    assert math.isnan(nothing["reward_recall"]) and math.isnan(nothing["reward_precision"])
    assert nothing["reward_false_positive_rate"] == 0.0 and math.isnan(summarize([rec(1.0, 1.0)])["reward_false_positive_rate"])
    checked = summarize([rec(1.0, 1.0), {**rec(0.0, 0.0), "contradicted": True}])  # a false reward the check undid
    assert checked["rewards_contradicted"] == 1 and checked["reward_precision"] == 1.0


def test_the_spread_of_held_out_steps_keeps_rewarded_ones():
    """Ten 8-step episodes, each rewarded on its last step: a plain stride of 8 would pick step 1 of
    each and no reward; the spread takes at least a quarter of its picks among the rewarded steps."""
    from types import SimpleNamespace as NS
    steps = [NS(truth=NS(reward=float(i % 8 == 7)), i=i) for i in range(80)]
    picked = even_spread(steps, 8)
    assert len(picked) == 8 and sum(ex.truth.reward for ex in picked) == 2
    assert [ex.i for ex in picked] == sorted(ex.i for ex in picked)  # the examples' own order
    assert even_spread(steps, 0) == steps and even_spread(steps[:5], 8) == steps[:5]
    common = [NS(truth=NS(reward=float(i % 2)), i=i) for i in range(80)]  # rewarded half the time: kept at half
    assert sum(ex.truth.reward for ex in even_spread(common, 20)) == 10
    only_one = [NS(truth=NS(reward=float(i == 40)), i=i) for i in range(80)]
    assert [ex.i for ex in even_spread(only_one, 8) if ex.truth.reward] == [40] and len(even_spread(only_one, 8)) == 8


@pytest.mark.slow
async def test_replay_is_teacher_forced():
    from infra.engine.models import load_tokenizer
    from simulator.experience_model import ExperienceModel
    from tests.test_experience_model import ScriptedClient

    tok = load_tokenizer()
    nxt = "Goal: g\nRoom: North.\nActions:\n[1] go south"
    traj = Trajectory("t", "g", task=Task("t", "g"), steps=[
        Step(state=REAL, action="go north", next_state=nxt, reasoning="moved"),
        Step(state=nxt, action="go south", next_state=REAL, reward=1.0, done=True, reasoning="back")])
    examples = build_examples([traj], tok, SimulatorConfig(retrieval=False), None)
    client = ScriptedClient(["moved</think><state>\nRoom: North.\nActions:\n[1] go south\n</state>"
                             "<reward>0</reward><done>false", "junk"])
    calls = []
    records = await replay(ExperienceModel(client, None, SimulatorConfig(retrieval=False, parse_retries=0), tok),
                           examples, concurrency=1, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 2), (2, 2)]  # as each reply comes back, the rejected one too
    assert records[0]["parsed"] and records[0]["item_recall"] == 1.0 and records[0]["token_f1"] == 1.0
    assert not records[1]["parsed"] and records[1]["true_done"] is True
    assert "Previous actions: go north" in client.prompts[1]  # the real history, not Mexp's
    assert "Room: North." in client.prompts[1]  # the real state, teacher-forced
    assert records[0]["item_tv"] == 0.0 and records[1]["item_tv"] == 1.0


def test_replay_progress_logs_each_tenth(caplog):
    report = log_tenths("fidelity (full)")
    with caplog.at_level(logging.INFO, logger="simulator.fidelity"):
        for done in range(1, 207):
            report(done, 206)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 10 and lines[-1].startswith("fidelity (full): 206/206 steps replayed")
    assert lines[0].startswith("fidelity (full): 21/206")  # the first step past a tenth


class _NoEmbedder:
    """The probe's private buffer with nothing to embed (retrieval off)."""

    def embed(self, texts):
        return np.zeros((len(texts), 384), dtype=np.float32)


@pytest.mark.slow
async def test_live_probe_exports_gauges_every_n_updates(tmp_path):
    from infra.engine.models import load_tokenizer
    from tests.test_experience_model import ScriptedClient

    nxt = "Goal: g\nRoom: North.\nActions:\n[1] go south"
    traj = Trajectory("t", "g", task=Task("t", "g"), steps=[
        Step(state=REAL, action="go north", next_state=nxt, reasoning="moved", reward=1.0, done=True)])
    reply = "moved</think><state>\nRoom: North.\nActions:\n[1] go south\n</state><reward>1</reward><done>true"
    probe = FidelityProbe(ScriptedClient([reply] * 4), SimulatorConfig(retrieval=False, parse_retries=0),
                          load_tokenizer(), [], [traj], _NoEmbedder(), steps=4, every=2)
    try:
        before = metrics.SIMULATOR_FIDELITY_PROBES._value.get()
        probe.after_update(1, 1)  # not a multiple of `every`
        assert probe.task is None
        probe.after_update(2, 2)
        s = await probe.wait()
        assert s["steps"] == 1 and s["reward_accuracy"] == 1.0 and s["item_tv"] == 0.0
        assert metrics.SIMULATOR_FIDELITY_PROBES._value.get() == before + 1
        assert metrics.SIMULATOR_FIDELITY_REWARD_ACCURACY._value.get() == 1.0
        assert metrics.SIMULATOR_FIDELITY_ITEM_TV._value.get() == 0.0
        assert metrics.SIMULATOR_FIDELITY_WEIGHT_VERSION._value.get() == 2
    finally:
        probe.close()


@pytest.mark.parametrize("reply,expected", [
    ("consistency=4 informativeness=3 hallucination=5", {"consistency": 4, "informativeness": 3, "hallucination": 5}),
    ("Consistency: 2, Informativeness = 1\nhallucination=9", {"consistency": 2, "informativeness": 1}),
    ("consistency=45 inconsistency=3", {}),
    ("", {}),
    ("<think>consistency=</think> hallucination=0", {}),
])
def test_judge_scores_reads_only_in_range_scores(reply, expected):
    assert judge_scores(reply) == expected


async def test_judge_averages_what_each_reply_scores_over_parsed_steps():
    from types import SimpleNamespace

    from tests.test_experience_model import ScriptedClient

    nxt = "Room: North.\nActions:\n[1] go south"
    examples = [SimpleNamespace(state=REAL, action="go north", truth=SimpleNamespace(next_state=nxt))] * 3
    records = [{"parsed": True, "state": nxt}, {"parsed": False, "state": ""}, {"parsed": True, "state": "junk"}]
    client = ScriptedClient(["consistency=5 informativeness=4 hallucination=5", "consistency=1 no other scores"])
    got = await judge(client, examples, records, concurrency=1)
    assert len(client.prompts) == 2  # the unparsed step is not judged
    assert "Predicted next state:\n" + nxt in client.prompts[0] and "Real next state:\n" + nxt in client.prompts[0]
    assert got["judge_consistency"] == 3.0 and got["judge_informativeness"] == 4.0
    assert got["judge_hallucination"] == 5.0 and got["judge_replies_scored"] == 1


async def test_the_check_before_rl_is_kept_for_the_mexp_it_measured(tmp_path):
    """`dreamgym train`'s fidelity check is replayed once per Mexp and settings: a resumed run (or a
    sim-to-real run continuing another) reads it from its run directory; another setting replays again."""
    from types import SimpleNamespace

    from rich.console import Console

    from infra.config import load_config
    from infra.engine.models import load_tokenizer
    from infra.run.driver import FIDELITY_FILE, fidelity_check
    from tests.test_experience_model import ScriptedClient

    nxt = "Goal: g\nRoom: North.\nActions:\n[1] go south"
    trajs = [Trajectory(f"t{i}", "g", task=Task(f"t{i}", "g"), steps=[
        Step(state=REAL, action="go north", next_state=nxt, reasoning="moved", reward=1.0, done=True)])
        for i in range(2)]  # two tasks: one is held out
    reply = "moved</think><state>\nRoom: North.\nActions:\n[1] go south\n</state><reward>1</reward><done>true"
    cfg = load_config(None, ["simulator.retrieval=false", "simulator.parse_retries=0",
                             "simulator.fidelity_check_steps=4", "actors.env_kind=synthetic"])
    svc = SimpleNamespace(mexp=ScriptedClient([reply] * 2), tokenizer=load_tokenizer(),
                          buffer=SimpleNamespace(embedder=_NoEmbedder()), run_dir=tmp_path)
    console = Console(record=True, width=300)

    first = await fidelity_check(cfg, svc, trajs, "mexp-a", console)
    assert first["steps"] == 1 and first["reward_accuracy"] == 1.0 and len(svc.mexp.prompts) == 1
    assert (tmp_path / FIDELITY_FILE).is_file()
    again = await fidelity_check(cfg, svc, trajs, "mexp-a", console)  # resumed: nothing replayed
    # compared as JSON: with no unrewarded step the false-reward rate is NaN, and NaN != NaN
    assert json.dumps(again) == json.dumps(first) and len(svc.mexp.prompts) == 1 and "kept in" in console.export_text()
    await fidelity_check(cfg, svc, trajs, "mexp-b", console)  # another Mexp is measured anew
    assert len(svc.mexp.prompts) == 2


async def test_dreamgym_fidelity_serves_mexp_as_the_config_says(monkeypatch, tmp_path):
    """`dreamgym fidelity` starts its engine on engines.device and dtype with the config's engine settings
    (it used the defaults: a GPU config replayed on the CPU in fp32), on every core."""
    import simulator.fidelity as fid
    from infra.config import load_config

    seen = {}

    async def fake_engine(**kwargs):
        seen.update(kwargs)
        raise RuntimeError("engine started")

    monkeypatch.setattr(fid, "start_embedded_engine", fake_engine)
    cfg = load_config(None, ["engines.dtype=bfloat16", "engines.prefix_cache_mb=64", "engines.threads=1"])
    with pytest.raises(RuntimeError, match="engine started"):
        await fid.measure(cfg.simulator, "", [], [], tmp_path, ["full"], max_batch_size=5, engines=cfg.engines)
    assert seen["dtype"] == "bfloat16" and seen["device"] == cfg.engines.device and seen["max_batch_size"] == 5
    assert seen["engine_cfg"].prefix_cache_mb == 64 and seen["engine_cfg"].threads == 0


def test_the_summary_table_reads_at_80_columns():
    """`dreamgym fidelity`'s table: a row per measure, a column per checkpoint and setting, every figure whole."""
    from rich.console import Console

    from simulator.fidelity import SUMMARY_ROWS, summary_table

    summary = {k: 0.123456 for k in SUMMARY_ROWS} | {"steps": 160, "reward_recall": 0.6}
    results = {"data/x/mexp/textworld-e0ae9c2f0dc7": {"full": {"summary": summary}, "no-retrieval": {"summary": summary}},
               "base": {"full": {"summary": summary}}}
    console = Console(record=True, width=80)
    console.print(summary_table(results, "t"))
    text = console.export_text()
    for row in SUMMARY_ROWS:
        assert row in text
    assert "0.123" in text and "0.6" in text and "160" in text and "…" not in text
