"""The experiment's results table (infra/run/results_table.py) on fabricated runs, as `dreamgym train` leaves them:
the share of each DreamGym row's synthetic steps that Mexp answered, and held-out success by slice (families
seen in training, never seen, longer than training: infra/run/generalisation.py). No model, no game."""

from __future__ import annotations

import pytest
import yaml

from infra.run import generalisation
from infra.run.experiment import load_experiment, markdown, results
from infra.run.generalisation import LONG, SEEN, UNSEEN
from infra.run.report import training_tasks
from infra.schema import Task

# Held-out games: 8 of the trained family (plans of 2-3 steps), 4 of a family never trained on with plans as
# long as training's, 4 of it with longer plans. Training: family custom, plans of at most 3 steps.
HELD = [("custom", 2 + i % 2) for i in range(8)] + [("custom-3", 3)] * 4 + [("custom-3", 5)] * 4
TRAINING = {"tasks": 64, "families": ["custom"], "plan_length_max": 3}


def summary(wins: list[int], phases: list[dict] | None = None, held: list = HELD, training: dict | None = TRAINING
            ) -> dict:
    per_task = [{"task_id": f"g{i}", "success": bool(w), "family": fam, "plan_length": plan}
                for i, (w, (fam, plan)) in enumerate(zip(wins, held))]
    out = {"heldout_after": {"success_rate": sum(wins) / len(wins), "episodes": len(wins), "successes": sum(wins),
                             "per_task": per_task}, "phases": phases or []}
    return {**out, "training_tasks": training} if training else out


def experiment(tmp_path, regimes: dict):
    spec = tmp_path / "exp.yaml"
    spec.write_text(yaml.safe_dump({"compare_to": "sft", "regimes": regimes}))
    return load_experiment(spec)


def cells(md: str, regime: str, header_start: str) -> dict[str, str]:
    """The cells of `regime`'s line in the markdown table whose header starts with `header_start`."""
    lines = md.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    head = [c.strip() for c in lines[top].strip("|").split("|")]
    for line in lines[top + 2:]:
        if not line.startswith("|"):
            break
        row = [c.strip() for c in line.strip("|").split("|")]
        if row[0] == regime:
            return dict(zip(head, row))
    raise AssertionError(f"no line for {regime}")


def test_every_dreamgym_row_reports_the_share_of_its_steps_mexp_answered(tmp_path):
    exp = experiment(tmp_path, {"sft": {"overrides": ["learner.total_updates=0"]}, "dg": {}, "dg2": {},
                                "s2r": {"continues": "dg", "overrides": ["learner.s2r_real_transitions=9"]}})
    dreamgym = {"phase": "DreamGym", "mexp_steps": {"simulated": 102, "replayed": 261, "memo_hits": 40}}
    second = {"phase": "DreamGym", "mexp_steps": {"simulated": 399, "replayed": 436, "memo_hits": 0}}
    wins = [1] * 8 + [0] * 8
    res = results(exp, {"sft": [summary(wins)], "dg": [summary(wins, [dreamgym])],
                        "dg2": [summary(wins, [dreamgym]), summary(wins, [second])],  # two runs: summed
                        # sim-to-real's summary holds its own (real) phase only: the DreamGym phase is its source's
                        "s2r": [summary(wins, [{"phase": "DreamGym", "earlier_segment": True},
                                               {"phase": "real env"}])]})
    rows = {r["regime"]: r for r in res["regimes"]}
    assert rows["dg"]["mexp_answered"] == {"simulated": 102, "replayed": 261, "share": pytest.approx(102 / 363)}
    assert rows["dg2"]["mexp_answered"]["share"] == pytest.approx((102 + 399) / (363 + 835))
    assert rows["s2r"]["mexp_answered"]["carried_from_source"] and rows["sft"]["mexp_answered"] is None
    md = markdown(res)
    column = "Mexp answered % of synthetic steps"
    assert cells(md, "dg", "| regime |")[column] == "28.1 (102 of 363)"
    assert cells(md, "dg2", "| regime |")[column] == f"{100 * 501 / 1198:.1f} (501 of 1198)"
    assert cells(md, "s2r", "| regime |")[column] == "28.1 (102 of 363) (its DreamGym phase)"
    assert cells(md, "sft", "| regime |")[column] == "–"


def test_held_out_success_is_reported_by_slice_with_its_difference(tmp_path):
    exp = experiment(tmp_path, {"sft": {"overrides": ["learner.total_updates=0"]}, "rl": {}})
    sft = [1, 0] * 4 + [1] * 8  # half the trained family, every game of the unseen one
    rl = [[1] * 8 + [0] * 8, [1] * 8 + [1, 0] * 4]  # two runs: all of the trained family, little elsewhere
    res = results(exp, {"sft": [summary(sft)], "rl": [summary(w) for w in rl]})
    by = {r["regime"]: r["slices"] for r in res["regimes"]}
    # slow and obvious: each slice's mean over the runs and its tasks, minus the baseline's on the same tasks
    slices = {SEEN: range(0, 8), UNSEEN: range(8, 16), LONG: range(12, 16)}
    for name, idx in slices.items():
        mean_rl = sum(sum(w[i] for i in idx) / len(idx) for w in rl) / len(rl)
        mean_sft = sum(sft[i] for i in idx) / len(idx)
        got = by["rl"][name]
        assert got["tasks"] == len(idx) and got["success_rate"] == pytest.approx(mean_rl)
        assert got["diff"] == pytest.approx(mean_rl - mean_sft) and got["diff_ci_low"] <= got["diff"] <= got["diff_ci_high"]
        assert by["sft"][name]["success_rate"] == pytest.approx(mean_sft) and "diff" not in by["sft"][name]
    assert by["rl"][SEEN]["diff"] == pytest.approx(0.5) and by["rl"][UNSEEN]["diff"] == pytest.approx(-0.75)
    md = markdown(res)
    row = cells(md, "rl", "| regime | families seen in training")
    assert row["families seen in training % [95% CI] (tasks)"].startswith("100.0 [") and \
        row["families seen in training % [95% CI] (tasks)"].endswith("(8)")
    assert "longer than training (plan > 3 steps) %" in md
    # a gain on the training family that came with losses elsewhere is said in words
    assert ("rl gains +50.0 pts on families seen in training but loses on families never seen -75.0 and longer "
            "than training -75.0") in md
    assert "sft gains" not in md


def test_a_slice_a_run_did_not_record_says_so():
    old = summary([1] * 16, training=None)  # a run from before the slices: no training tasks recorded
    assert generalisation.slices([old]) == {SEEN: None, UNSEEN: None, LONG: None, generalisation.TRAINING: None}
    no_plans = summary([1] * 16, held=[(fam, None) for fam, _ in HELD])  # a family whose tasks record no plan
    s = generalisation.slices([no_plans])
    assert s[LONG] is None and s[SEEN]["tasks"] == 8 and s[UNSEEN]["tasks"] == 8
    every_seen = summary([1] * 16, training={**TRAINING, "families": ["custom", "custom-3"], "plan_length_max": 9})
    s = generalisation.slices([every_seen])
    assert s[UNSEEN] == {"tasks": 0} and s[LONG] == {"tasks": 0} and s[SEEN]["success_rate"] == 1.0
    lines = "\n".join(generalisation.markdown_lines([{"regime": "old", "slices": generalisation.slices([old])},
                                                     {"regime": "every", "slices": s}], "sft"))
    assert "| old | not recorded | – | not recorded | – | not recorded | – |" in lines
    assert "| every | 100.0 [100.0, 100.0] (16) | – | no task | – | no task | – |" in lines


def played(summary_: dict, wins: list[int], ids: range) -> dict:
    """`summary_` with its training tasks played after training (evaluation.training_tasks): t<i> won or lost."""
    per_task = [{"task_id": f"t{i}", "success": bool(w)} for i, w in zip(ids, wins)]
    return {**summary_, "train_after": {"success_rate": sum(wins) / len(wins), "episodes": len(wins),
                                        "per_task": per_task}}


def test_success_on_the_training_tasks_tells_learned_tasks_from_generalisation(tmp_path):
    """A regime that wins its training tasks and loses held-out ones (collection 42's real GRPO) is reported as
    such: its training tasks' success and the paired difference to the baseline on the tasks both played."""
    exp = experiment(tmp_path, {"sft": {"overrides": ["learner.total_updates=0"]}, "rl": {}, "wide": {}})
    held_sft, held_rl = [1, 0] * 8, [1, 0] * 4 + [0] * 8  # the RL policy loses the unseen family's games
    sft = played(summary(held_sft), [1, 0, 0, 1, 0, 0], range(6))
    rl = [played(summary(held_rl), [1, 1, 1, 1, 0, 1], range(6)), played(summary(held_rl), [1, 1, 0, 1, 1, 1], range(6))]
    wide = played(summary(held_rl), [1] * 10, range(2, 12))  # trained on other tasks too: pairs on t2..t5 only
    res = results(exp, {"sft": [sft], "rl": rl, "wide": [wide]})
    by = {r["regime"]: r["slices"][generalisation.TRAINING] for r in res["regimes"]}
    # slow and obvious: each run's mean over its tasks, then over runs; minus the baseline's on the same tasks
    assert by["rl"]["success_rate"] == pytest.approx((5 / 6 + 5 / 6) / 2) and by["rl"]["tasks"] == 6
    assert by["rl"]["diff"] == pytest.approx(5 / 6 - 2 / 6) and by["rl"]["diff_ci_low"] <= by["rl"]["diff"]
    assert by["wide"]["diff_tasks"] == 4 and by["wide"]["diff"] == pytest.approx(1 - 1 / 4)
    assert by["sft"]["success_rate"] == pytest.approx(2 / 6) and "diff" not in by["sft"]
    md = markdown(res)
    row = cells(md, "rl", "| regime | families seen in training")
    assert row["its training tasks % (not held out)"].startswith(f"{100 * 5 / 6:.1f} [") and \
        row["its training tasks % (not held out)"].endswith("(6)")
    assert "rl gains +50.0 pts on its training tasks but loses on families never seen -50.0" in md
    # a run that did not play them (the setting off, or from before it) shows no figure, not an empty one
    res = results(exp, {"sft": [sft], "rl": [rl[0], summary(held_rl)]})
    assert {r["regime"]: r["slices"][generalisation.TRAINING] for r in res["regimes"]}["rl"] is None
    assert "| rl |" in markdown(res) and "not recorded" in cells(markdown(res), "rl", "| regime | families seen")[
        "its training tasks % (not held out)"]
    assert "(not held out)" not in markdown(results(exp, {"sft": [summary(held_sft)], "rl": [summary(held_rl)]}))


def test_a_runs_training_tasks_are_summed_up_for_the_slices():
    tasks = [Task("a", "x", family="custom", meta={"plan_length": 2}),
             Task("b", "x", family="custom-2", meta={"plan_length": 4})]
    assert training_tasks(tasks) == {"tasks": 2, "families": ["custom", "custom-2"], "plan_length_max": 4}
    tasks.append(Task("c", "x", family="miniwob/click"))  # one task without a recorded plan: no horizon
    assert training_tasks(tasks)["plan_length_max"] is None


def test_every_row_names_the_warm_start_it_started_from(tmp_path):
    """summary.json's `warm_start` (infra/run/artifacts.warm_start_record) becomes the row's 'warm start' cell:
    the early-stopped step and how many were trained, a fixed start's steps, '–' for a run without one."""
    exp = experiment(tmp_path, {"base": {}, "sft": {"overrides": ["learner.total_updates=0"]}, "sft_8": {}})
    wins = [1] * 8 + [0] * 8
    best = {"mode": "best", "steps": 40, "trained_steps": 64, "val_success": 10 / 13, "val_tasks": 13}
    res = results(exp, {"base": [summary(wins)], "sft": [{**summary(wins), "warm_start": best}],
                        "sft_8": [{**summary(wins), "warm_start": {"mode": "fixed", "steps": 8}}]})
    md = markdown(res)
    assert cells(md, "sft", "| regime |")["warm start"] == "best: 40 of 64 steps (val 76.9)"
    assert cells(md, "sft_8", "| regime |")["warm start"] == "8 steps"
    assert cells(md, "base", "| regime |")["warm start"] == "–"


def test_repeated_regimes_are_listed_run_by_run_paired_by_seed(tmp_path):
    """Run i of `--repeats` has infra.run_seed i-1: the 'Runs by seed' section gives each run of a repeated
    regime its own paired Δ against the baseline (and its invalid steps where there were any), and a last
    line averages each seed over the regimes, so a seed that helps every regime shows as a column."""
    exp = experiment(tmp_path, {"sft": {"overrides": ["learner.total_updates=0"]}, "a": {}, "b": {}, "once": {}})
    sft = [1, 0] * 8  # 8 of 16

    def run(wins: list[int], invalid: float) -> dict:
        s = summary(wins)
        s["heldout_after"]["invalid_rate"] = invalid
        return s

    a = [run([1] * 12 + [0] * 4, 0.1), run([0] * 16, 0.5), run([1, 0] * 8, 0.3)]  # 12, 0, 8 of 16
    b = [run([1] * 10 + [0] * 6, 0.2), run([1] * 4 + [0] * 12, 0.4)]  # 10, 4 of 16; no third run
    res = results(exp, {"sft": [run(sft, 0.3)], "a": a, "b": b, "once": [run(sft, 0.3)]})
    md = markdown(res)
    # slow and obvious: a run's paired Δ on the same 16 tasks is its success minus the baseline's
    assert cells(md, "a", "| regime | run 1 (seed 0)") == {
        "regime": "a", "run 1 (seed 0)": "75.0 (+25.0; invalid 10.0)", "run 2 (seed 1)": "0.0 (-50.0; invalid 50.0)",
        "run 3 (seed 2)": "50.0 (+0.0; invalid 30.0)", "mean": "41.7 (-8.3)"}
    assert cells(md, "b", "| regime | run 1 (seed 0)")["run 3 (seed 2)"] == "–"
    assert cells(md, "mean of the regimes' Δ", "| regime | run 1 (seed 0)") == {
        "regime": "mean of the regimes' Δ", "run 1 (seed 0)": "+18.8 (2)", "run 2 (seed 1)": "-37.5 (2)",
        "run 3 (seed 2)": "+0.0 (1)", "mean": ""}
    with pytest.raises(AssertionError):  # a regime run once has no line there
        cells(md, "once", "| regime | run 1 (seed 0)")
    # a run that did not finish is a gap, not a shift: runs_of names each summary's run seed
    gap = results(exp, {"sft": [run(sft, 0.3)], "a": [{**a[0], "run_seed": 0}, {**a[2], "run_seed": 2}]})
    assert cells(markdown(gap), "a", "| regime | run 1 (seed 0)") == {
        "regime": "a", "run 1 (seed 0)": "75.0 (+25.0; invalid 10.0)", "run 3 (seed 2)": "50.0 (+0.0; invalid 30.0)",
        "mean": "62.5 (+12.5)"}
    # score mode (no invalid step in any run) says nothing of invalid steps; one run a regime: no section
    plain = results(exp, {"sft": [summary(sft)], "a": [summary(w) for w in ([1] * 16, sft)]})
    assert cells(markdown(plain), "a", "| regime | run 1 (seed 0)")["run 1 (seed 0)"] == "100.0 (+50.0)"
    assert "Runs by seed" not in markdown(results(exp, {"sft": [summary(sft)], "a": [summary(sft)]}))


def test_a_repeated_sim_to_real_reports_what_its_real_phase_added_over_all_runs(tmp_path):
    """dreamgym_s2r after its DreamGym phase: the mean over the regime's runs, each run's gain paired on its own
    tasks (collection 39 printed run 1's alone). Slow and obvious: the mean of each run's final minus phase."""
    exp = experiment(tmp_path, {"sft": {"overrides": ["learner.total_updates=0"]}, "s2r": {}})

    def run(phase_wins: list[int], final_wins: list[int]) -> dict:
        between = summary(phase_wins)["heldout_after"]
        return summary(final_wins, [{"phase": "DreamGym", "heldout_after": between}, {"phase": "sim-to-real: real env"}])

    runs = [run([1] * 8 + [0] * 8, [1] * 8 + [0] * 8),  # +0 of 16
            run([1] * 4 + [0] * 12, [1] * 8 + [0] * 8)]  # +4 of 16
    res = results(exp, {"sft": [summary([1, 0] * 8)], "s2r": runs})
    (b,) = next(r for r in res["regimes"] if r["regime"] == "s2r")["between_phases"]
    assert b["runs"] == [0.5, 0.25] and b["success_rate"] == pytest.approx(0.375)
    assert b["gain_after"]["diff"] == pytest.approx((0 + 4 / 16) / 2) and b["gain_after"]["tasks"] == 16
    assert b["gain_after"]["ci_low"] <= b["gain_after"]["diff"] <= b["gain_after"]["ci_high"]
    assert ('s2r after its phase "DreamGym": 37.5 % (2 runs: 50.0, 25.0) on 16 episodes; the phases after it '
            'added +12.5 pts') in markdown(res)
    # one run: as before, paired on its tasks alone
    (one,) = next(r for r in results(exp, {"sft": [summary([1, 0] * 8)], "s2r": runs[1:]})["regimes"]
                  if r["regime"] == "s2r")["between_phases"]
    assert one["success_rate"] == 0.25 and one["gain_after"]["diff"] == pytest.approx(0.25)
