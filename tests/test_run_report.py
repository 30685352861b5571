"""The run directory's report: one PNG per curve, a JSON summary, the before/after table."""

from __future__ import annotations

import json

from infra.run.report import PLOTS, RunHistory, phase_row, results_table, write_plots, write_summary


def test_plots_summary_and_table(tmp_path):
    h = RunHistory()
    for v in range(1, 4):
        h.record(version=v, loss=1.0 / v, kl=0.01 * v, mean_reward=0.2 * v, success_rate=0.2 * v, staleness=0.5,
                 traj_per_s=1.5)
    paths = write_plots(h, tmp_path / "plots")
    assert sorted(p.name for p in paths) == sorted(f"{k}.png" for k, _ in PLOTS)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    write_summary(tmp_path / "summary.json", {"heldout_before": {"success_rate": 0.0}, "history": h.rows})
    assert json.loads((tmp_path / "summary.json").read_text())["history"][2]["version"] == 3
    r = {"success_rate": 0.5, "ci_low": 0.2, "ci_high": 0.8, "mean_steps": 4.0, "invalid_rate": 0.0, "episodes": 6}
    t = results_table(r, None, {"updates": 3})
    assert t.row_count == 1 and "updates: 3" in t.caption


def test_a_resumed_history_continues_the_rows_and_clocks_up_to_its_checkpoint(tmp_path):
    first = RunHistory(path=tmp_path / "history.json", started=100.0, run_started=50.0)
    for v in range(1, 4):  # version 3's update was made, but the run stopped before its checkpoint
        first.record(version=v, loss=1.0)
    assert json.loads(first.path.read_text()) == first.rows and first.rows[0]["wall"] > first.rows[0]["t"]
    again = RunHistory(path=first.path)
    again.resume(version=2)
    assert [r["version"] for r in again.rows] == [1, 2]
    assert again.earlier_s == first.rows[1]["t"] and again.earlier_wall_s == first.rows[1]["wall"]
    assert again.seconds >= first.rows[1]["t"] and again.wall_seconds >= first.rows[1]["wall"]
    again.record(version=3, loss=0.5)
    assert [r["version"] for r in json.loads(first.path.read_text())] == [1, 2, 3]
    fresh = RunHistory(path=tmp_path / "none.json")
    fresh.resume(version=5)  # nothing saved: nothing to continue
    assert fresh.rows == [] and fresh.earlier_s == 0.0


def test_empty_history_still_draws(tmp_path):
    assert len(write_plots(RunHistory(), tmp_path)) == len(PLOTS)


def test_dreamgym_report_redraws_plots_and_markdown_of_a_finished_run(tmp_path, capsys):
    from infra.cli import main

    h = RunHistory()
    for v in range(1, 3):
        h.record(phase="DreamGym", version=v, loss=0.5 / v, kl=0.01, mean_reward=0.5, success_rate=0.5, staleness=0.0,
                 traj_per_s=2.0)
    r = {"success_rate": 0.25, "ci_low": 0.05, "ci_high": 0.6, "episodes": 8}
    write_summary(tmp_path / "summary.json", {
        "run": "r", "algo": "grpo", "family": "textworld", "env_kind": "synthetic", "updates": 2, "weight_version": 2,
        "trajectories_trained": 8, "train_seconds": 30.0, "total_seconds": 60.0, "heldout_before": None,
        "heldout_after": r, "transitions": {"offline_real": 10, "online_real": 0, "synthetic": 40},
        "phases": [{"phase": "DreamGym", "updates": 2, "seconds": 30.0, "trajectories_pushed": 8}],
        "mexp_fidelity": {"steps": 4, "reward_accuracy": 0.75}, "history": h.rows})
    assert main(["report", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "# Run r" in md and "0.250 [0.05, 0.60]" in md and "| synthetic | 40 |" in md
    assert "reward_accuracy 0.75" in md
    for key, _ in PLOTS:
        assert f"(plots/{key}.png)" in md and (tmp_path / "plots" / f"{key}.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["report", str(tmp_path / "missing")]) == 1


def test_a_phase_done_in_an_earlier_segment_is_not_reported_as_zero_work():
    done = {"phase": "DreamGym", "env_kind": "synthetic", "updates": 0, "seconds": 0.0, "trajectories_pushed": 0,
            "trajectories_set_aside": {}, "trajectories_waiting": 0, "earlier_segment": True}
    ran = {**done, "phase": "sim-to-real: real env", "updates": 2, "seconds": 308.2, "trajectories_pushed": 92,
           "trajectories_set_aside": {"zero_variance": 76, "broken": 8}, "earlier_segment": False}
    assert phase_row(done) == "| DreamGym | done in an earlier segment (counted in the totals above) | – | – | – | – |"
    assert phase_row(ran) == "| sim-to-real: real env | 2 | 308.2 | 92 | broken 8, zero_variance 76 | 0 |"


def _eval(successes: list[bool]) -> dict:
    n = len(successes)
    return {"success_rate": sum(successes) / n, "per_task": [{"task_id": f"t{i}", "success": s} for i, s in enumerate(successes)]}


def test_the_verdict_line_says_whether_a_change_is_outside_the_noise():
    from infra.run.report import verdict

    same = verdict(_eval([True, False] * 6), _eval([False, True] * 6), 3)
    assert "0.500 -> 0.500 after 3 updates" in same and "within the noise" in same
    assert "dreamgym experiment" in same  # it points to where learning is measured
    gain = verdict(_eval([False] * 40), _eval([True] * 40), 1)
    assert "+100.0 points" in gain and "outside this run's noise" in gain and "not a learning result" in gain
    assert "after 1 update:" in gain
    assert verdict(None, _eval([True]), 0) == ""
    assert verdict(_eval([True]), {"success_rate": 0.0}, 2).startswith("Held-out success 1.000 -> 0.000 after 2 updates.")
