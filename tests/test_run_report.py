"""The run directory's report: one PNG per curve, a JSON summary, the before/after table."""

from __future__ import annotations

import json

from infra.run_report import PLOTS, RunHistory, results_table, write_plots, write_summary


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


def test_empty_history_still_draws(tmp_path):
    assert len(write_plots(RunHistory(), tmp_path)) == len(PLOTS)
