"""The results of `dreamgym experiment`: one row per regime, results.json/results.md, the plot, the console table.

Owns reading a regime's finished runs (their summary.json files, infra/run/experiment.runs_of) into its line
of the table: held-out success (one run: a Wilson interval; several: their mean, with an interval that
resamples runs and tasks, actors/confidence.compare_runs), the paired difference to the regime it is
compared with, real and synthetic transitions, the share of its synthetic steps that Mexp answered (the
rest replayed real transitions of the offline data, simulator.replay_real), Mexp's fidelity, wall time;
held-out success by slice (families seen in training, never seen, longer than training:
infra/run/generalisation.py); each repeated regime's runs one by one, by run seed (its paired difference and,
in generate mode, its invalid steps: run i of `--repeats` has infra.run_seed i-1, so regimes pair by seed
and a seed that helps or hurts every regime shows as a column); and the paper's claims checked on the mean of
the repeats (infra/run/claims.py).
Nothing here runs a regime.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from actors.confidence import PairedDifference, compare_runs, per_task_success, runs_bootstrap, wilson_interval
from infra.run import claims, generalisation

if TYPE_CHECKING:  # experiment.py imports this module for its command
    from infra.run.experiment import Experiment, Regime

def mexp_answered(runs: list[dict]) -> dict | None:
    """Of the synthetic steps of a regime's runs (their DreamGym phases, summed), those Mexp answered (from the
    engine or its reply memo) and those that replayed a real transition of the offline data instead
    (simulator.replay_real); None where no phase counted them (no DreamGym phase, a Ray fleet, older runs)."""
    counted = [m for r in runs for p in r.get("phases", []) if (m := p.get("mexp_steps"))]
    if not counted:
        return None
    asked, replayed = sum(m.get("simulated", 0) for m in counted), sum(m.get("replayed", 0) for m in counted)
    return {"simulated": asked, "replayed": replayed,
            "share": asked / (asked + replayed) if asked + replayed else None}


def row(name: str, about: str, runs: list[dict], baseline: list[dict] | None, baseline_name: str,
        wall_seconds: float | None = None, source: list[dict] | None = None) -> dict:
    """One regime's line of the results: success and its interval, the paired difference, the costs.

    `runs` (and `baseline`) hold the summaries of each of the regime's runs. One run: its success with
    a Wilson interval. Several: their mean, with a bootstrap interval over runs and tasks; the costs
    and the Mexp's fidelity are then the first run's, and `runs` lists each run's success. `source`: the runs
    of the regime this one continues, whose DreamGym phase it carries (its share of Mexp-answered steps)."""
    s = runs[0]
    after = s["heldout_after"]
    k, n = after.get("successes", round(after["success_rate"] * after["episodes"])), after["episodes"]
    rates = [r["heldout_after"]["success_rate"] for r in runs]
    if len(runs) == 1:
        lo, hi = wilson_interval(int(k), int(n))
    else:
        pooled = compare_runs([r["heldout_after"].get("per_task", []) for r in runs])
        lo, hi = pooled.ci_low, pooled.ci_high
    tr = s.get("transitions", {})
    fid = s.get("mexp_fidelity") or {}
    out = {"regime": name, "about": about, "success_rate": sum(rates) / len(rates), "ci_low": lo, "ci_high": hi,
           "runs": rates,
           "episodes": n, "updates": s.get("updates", 0), "real_transitions": tr.get("online_real", 0),
           "offline_real_transitions": tr.get("offline_real", 0), "synthetic_transitions": tr.get("synthetic", 0),
           "mexp_reward_accuracy": fid.get("reward_accuracy"), "mexp_delta_r": fid.get("delta_r_mean"),
           "mexp_reward_recall": fid.get("reward_recall"), "mexp_reward_precision": fid.get("reward_precision"),
           "mexp_below_threshold": fid.get("below_threshold"), "wall_seconds": s.get("total_seconds") if wall_seconds is None else wall_seconds,
           "train_seconds": s.get("train_seconds")}
    if baseline and name != baseline_name:
        d = compare_runs([r["heldout_after"].get("per_task", []) for r in runs],
                         [b["heldout_after"].get("per_task", []) for b in baseline])
        out.update({"vs": baseline_name, "diff": d.diff, "diff_ci_low": d.ci_low, "diff_ci_high": d.ci_high,
                    "diff_tasks": d.tasks, "diff_excludes_zero": d.excludes_zero})
        # each run alone against the baseline (all of its runs), in run-seed order
        out["run_diffs"] = [compare_runs([r["heldout_after"].get("per_task", [])],
                                         [b["heldout_after"].get("per_task", []) for b in baseline]).diff for r in runs]
    out["run_invalid"] = [r["heldout_after"].get("invalid_rate") for r in runs]
    out["run_seeds"] = [r.get("run_seed", i) for i, r in enumerate(runs)]  # runs_of says; else their order
    out["run_sittings"] = [r.get("sitting", "") for r in runs]  # "" here, else the --pool directory it ran in
    out["warm_start"] = s.get("warm_start")  # which SFT the run started from (summary.json; None without one)
    out["mexp_answered"] = mexp_answered(runs)
    if out["mexp_answered"] is None and source and (carried := mexp_answered(source)) is not None:
        out["mexp_answered"] = {**carried, "carried_from_source": True}  # sim-to-real: its DreamGym phase's
    out["slices"] = generalisation.slices(runs, baseline if name != baseline_name else None)
    out["between_phases"] = between_phases(runs)
    return out


def between_phases(runs: list[dict]) -> list[dict]:
    """Sim-to-real evaluates between its phases: what its synthetic phase alone reached, and what the phases
    after it added on the same tasks, paired within each run, then over all of the regime's runs (the mean of
    the runs' gains, its interval resampling runs and tasks). A phase counts only in the runs that evaluated it."""
    out = []
    for j, p in enumerate(runs[0].get("phases", [])):
        if not p.get("heldout_after"):
            continue
        pairs = [(r["heldout_after"], r["phases"][j]["heldout_after"]) for r in runs
                 if len(r.get("phases", [])) > j and r["phases"][j].get("heldout_after")]
        gains = [_gain(final, between) for final, between in pairs]
        common = sorted(set.intersection(*(set(g) for g in gains)))
        d = runs_bootstrap([[g[t] for t in common] for g in gains]) if common else PairedDifference(0.0, -1.0, 1.0, 0)
        rates = [between["success_rate"] for _, between in pairs]
        out.append({"after": p["phase"], "success_rate": sum(rates) / len(rates), "runs": rates,
                    "episodes": p["heldout_after"]["episodes"],
                    "gain_after": {"diff": d.diff, "ci_low": d.ci_low, "ci_high": d.ci_high, "tasks": d.tasks}})
    return out


def _gain(final: dict, between: dict) -> dict[str, float]:
    """Each task's success after all phases minus after the one phase, over the tasks both evaluated."""
    a, b = per_task_success(final.get("per_task", [])), per_task_success(between.get("per_task", []))
    return {t: a[t] - b[t] for t in a.keys() & b.keys()}


def carried_seconds(source: dict) -> float:
    """The wall time a run that continues `source`'s finished run carries: that run's clock at its last
    update (the checkpoint continued from; RunHistory.resume), not its total, which adds its final evaluation."""
    history = source.get("history") or []
    return float(history[-1].get("wall", history[-1].get("t", 0.0))) if history else 0.0


def own_seconds(regime: Regime, summaries: dict[str, list[dict]]) -> list[float]:
    """The wall time of each of a regime's runs, its own part only: a run that continues another's finished
    run carries that run's history, so its total includes the source's time to its last update."""
    source = [carried_seconds(s) for s in summaries.get(regime.continues, [])] if regime.continues else []
    return [max(0.0, (s.get("total_seconds") or 0.0) - (source[i] if i < len(source) else 0.0))
            for i, s in enumerate(summaries[regime.name])]


def results(exp: Experiment, summaries: dict[str, list[dict]], anchors: dict[str, dict] | None = None) -> dict:
    """The experiment's results from each regime's finished runs (`runs_of`)."""
    ran = [r for r in exp.regimes if summaries.get(r.name)]
    own = {r.name: own_seconds(r, summaries) for r in ran}
    rows = [row(r.name, r.about, summaries[r.name], summaries.get(vs := r.compare_to or exp.compare_to), vs,
                wall_seconds=own[r.name][0],  # the first run's, as the row's other costs
                source=summaries.get(r.continues) if r.continues else None)
            for r in ran]
    table = [r for r in ran if not r.extra]
    return {"experiment": exp.name, "about": exp.about, "file": exp.path, "compare_to": exp.compare_to,
            "regimes": rows, "missing": [r.name for r in exp.regimes if not summaries.get(r.name) and not r.extra],
            # the other machines' or sittings' run directories whose runs joined this one's (--pool)
            "pooled": sorted({s["sitting"] for runs in summaries.values() for s in runs if s.get("sitting")}),
            # each run's own wall time (a continuing regime's counts its own part), summed over the table's
            "table_seconds": sum(sum(own[r.name]) for r in table),
            "table_regimes_run": len(table),
            # on the mean of each regime's runs; a regime whose repeats would reproduce its first run counts as repeated
            "claims": claims.check(exp.roles, summaries, exp.identical_regimes()) if exp.roles else [],
            "anchors": {p: {k: a[k] for k in ("success_rate", "ci_low", "ci_high", "episodes", "mean_steps")}
                        for p, a in (anchors or {}).items()}}


def _diff(r: dict, column: str) -> str:
    """A row's paired difference, naming its baseline where it is not the column's."""
    if "diff" not in r:
        return "–"
    vs = "" if r["vs"] == column else f" vs {r['vs']}"
    return f"{100 * r['diff']:+.1f} [{100 * r['diff_ci_low']:+.1f}, {100 * r['diff_ci_high']:+.1f}]{vs}"


def _runs(r: dict) -> str:
    """A regime's runs, where it has more than one: '; 2 runs: 91.7, 58.3'."""
    runs = r.get("runs", [])
    return f"; {len(runs)} runs: {', '.join(_pct(x) for x in runs)}" if len(runs) > 1 else ""


def _pct(x: Any) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def wall_time(res: dict) -> str:
    """The table's wall time: its regimes' runs, each its own time, summed."""
    t, n = res["table_seconds"], res["table_regimes_run"]
    of = f"{n} of the table's {n + len(res['missing'])} regimes" if res["missing"] else f"the table's {n} regimes"
    return (f"Wall time: {of} took {int(t // 3600)} h {int(t % 3600 // 60):02d} min, each run's own time summed "
            "(a regime that continues another counts only its own part).")


def started_from(r: dict) -> str:
    """A row's warm start: 'best: 40 of 64 steps (val 76.9)' for an early-stopped one (the step kept, the steps
    trained, its validation success), '8 steps' for a fixed one, '–' without one (or a run from before it was recorded)."""
    w = r.get("warm_start")
    if not w or w.get("steps") is None:
        return "–"
    if w.get("mode") == "best":
        return f"best: {w['steps']} of {w.get('trained_steps', w['steps'])} steps (val {_pct(w.get('val_success'))})"
    return f"{w['steps']} steps"


def answered(r: dict) -> str:
    """A row's share of synthetic steps that Mexp answered: '28.1 (102 of 363)'; '–' where none was counted."""
    m = r.get("mexp_answered")
    if not m or m.get("share") is None:
        return "–"
    carried = " (its DreamGym phase)" if m.get("carried_from_source") else ""
    return f"{_pct(m['share'])} ({m['simulated']} of {m['simulated'] + m['replayed']}){carried}"


def markdown(res: dict) -> str:
    head = ["regime", "held-out success % [95% CI]", f"Δ vs {res['compare_to']} (pts) [95% CI]" if res["compare_to"]
            else "Δ", "real transitions (online)", "synthetic transitions", "Mexp answered % of synthetic steps",
            "warm start", "updates", "Mexp reward acc", "Mexp ΔR", "wall s"]
    lines = [f"# {res['experiment']}", "", res["about"], "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for r in res["regimes"]:
        diff = _diff(r, res["compare_to"])
        acc = _pct(r["mexp_reward_accuracy"]) + (" (below threshold)" if r["mexp_below_threshold"] else "")
        if r.get("mexp_reward_recall") is not None:  # runs from before recall was measured have none
            acc += f"; recall {_pct(r['mexp_reward_recall'])}, precision {_pct(r.get('mexp_reward_precision'))}"
        dr = "–" if r["mexp_delta_r"] is None else f"{r['mexp_delta_r']:.3f}"
        lines.append(f"| {r['regime']} | {_pct(r['success_rate'])} [{_pct(r['ci_low'])}, {_pct(r['ci_high'])}]{_runs(r)} "
                     f"| {diff} | {r['real_transitions']} | {r['synthetic_transitions']} | {answered(r)} "
                     f"| {started_from(r)} | {r['updates']} | {acc} "
                     f"| {dr} | {r['wall_seconds'] or 0:.0f} |")
    for r in res["regimes"]:
        for b in r.get("between_phases", []):
            g = b["gain_after"]
            each = f" ({len(b['runs'])} runs: " + ", ".join(_pct(x) for x in b["runs"]) + ")" \
                if len(b.get("runs", [])) > 1 else ""
            lines += ["", f"{r['regime']} after its phase \"{b['after']}\": {_pct(b['success_rate'])} %{each} on "
                          f"{b['episodes']} episodes; the phases after it added {100 * g['diff']:+.1f} pts "
                          f"[{100 * g['ci_low']:+.1f}, {100 * g['ci_high']:+.1f}] (paired, same tasks"
                          + (", over runs and tasks)." if each else ").")]
    if res.get("anchors"):
        lines += ["", "Scripted choosers on the same held-out games: " + ", ".join(
            f"{p} {_pct(a['success_rate'])} [{_pct(a['ci_low'])}, {_pct(a['ci_high'])}]"
            for p, a in res["anchors"].items()) + "."]
    if res.get("table_regimes_run"):
        lines += ["", wall_time(res)]
    if res["missing"]:
        lines += ["", f"Not run yet: {', '.join(res['missing'])}."]
    if res.get("pooled"):
        lines += ["", f"Runs pooled from other run directories (`--pool`): {', '.join(res['pooled'])}. Each counts as a "
                      "run of its regime; a row's Δ compares its runs with all of its baseline's runs, not each with "
                      "its own machine's."]
    lines += generalisation.markdown_lines(res["regimes"], res["compare_to"])
    lines += by_seed_lines(res["regimes"])
    lines += claims.markdown_lines(res.get("claims", []))
    lines += ["", f"{res['regimes'][0]['episodes'] if res['regimes'] else 0} held-out episodes per regime; "
                  "the paired Δ resamples tasks (bootstrap, 10,000 draws). A regime trained more than once "
                  "(--repeats) shows the mean of its runs, each run's success after it, and intervals that "
                  "resample its runs as well as the tasks; its costs are its first run's. Mexp answered: of "
                  "the synthetic steps of a regime's DreamGym phases (all its runs), those Mexp generated (or "
                  "its reply memo repeated), the rest replayed a real transition of the offline data "
                  "(simulator.replay_real). Warm start: the SFT the run started from (learner.warm_start=best: the "
                  "step kept of those trained, chosen by greedy success on a validation split of the training tasks)."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> Path:
    """Held-out success against online real transitions used, with Wilson intervals."""
    import matplotlib  # heavy, and only the end of an experiment draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in res["regimes"]:
        x, y = r["real_transitions"], r["success_rate"]
        ax.errorbar([x], [y], yerr=[[y - r["ci_low"]], [r["ci_high"] - y]], fmt="o", capsize=4, label=r["regime"])
        ax.annotate(r["regime"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
    for p, a in res.get("anchors", {}).items():
        ax.axhline(a["success_rate"], ls=":", lw=1, color="grey")
        ax.annotate(f"{p} chooser", (0, a["success_rate"]), textcoords="offset points", xytext=(2, 2), fontsize=7,
                    color="grey")
    ax.set_xlabel("online real transitions used")
    ax.set_ylabel("held-out real success")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{res['experiment']}: held-out success vs real transitions")
    ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_table(res: dict, console: Console) -> None:
    t = Table(title=f"dreamgym experiment {res['experiment']}: held-out real success")
    for col in ("regime", "success", "95% CI", f"Δ vs {res['compare_to']}", "real tr.", "synthetic tr.",
                "Mexp answered %", "seen / unseen / longer", "wall s"):
        t.add_column(col, justify="right")
    for r in res["regimes"]:
        diff = _diff(r, res["compare_to"])
        name = r["regime"] + (f" ×{len(r['runs'])}" if len(r.get("runs", [])) > 1 else "")
        t.add_row(name, f"{r['success_rate']:.3f}", f"[{r['ci_low']:.2f}, {r['ci_high']:.2f}]", diff,
                  str(r["real_transitions"]), str(r["synthetic_transitions"]),
                  _pct((r.get("mexp_answered") or {}).get("share")), by_slice(r), f"{r['wall_seconds'] or 0:.0f}")
    console.print(t)
    if res.get("table_regimes_run"):
        console.print(wall_time(res), highlight=False)
    for r in res["regimes"]:
        if m := generalisation.mixed(r.get("slices") or {}):
            console.print(f"[yellow]{r['regime']}: {m}[/]", highlight=False)
    for c in res.get("claims", []):
        colour = {claims.MET: "green", claims.NOT_MET: "red", claims.UNDECIDED: "yellow"}.get(c["status"], "dim")
        console.print(f"[{colour}]{c['target']}. {c['status']}[/]: {escape(c['claim'])}. {escape(c['detail'])}.",
                      highlight=False)


def by_slice(r: dict) -> str:
    """A row's held-out success on the three slices, for the console: '91.7 / 50.0 / –', then its training
    tasks' where they were played (evaluation.training_tasks): '91.7 / 50.0 / – (trained 95.8)'."""
    s = r.get("slices") or {}
    trained = s.get(generalisation.TRAINING)
    return " / ".join(_pct((s.get(k) or {}).get("success_rate")) for k in generalisation.SLICES) + \
        (f" (trained {_pct(trained['success_rate'])})" if trained else "")


def _columns(r: dict) -> list[tuple[str, int]]:
    """Each of a row's runs as its column of "Runs by seed": where it ran ("" here, else its --pool directory)
    and its run seed."""
    return list(zip(r.get("run_sittings") or [""] * len(r["runs"]), r["run_seeds"]))


def by_seed_lines(regimes: list[dict]) -> list[str]:
    """The section that lists each repeated regime's runs one by one, by run seed (run i: infra.run_seed i-1):
    held-out success, the paired difference to its baseline and, where the evaluation counted them
    (generate mode: some step was invalid), the share of invalid steps; a last line averages each seed over the
    regimes, so a seed that helps or hurts every regime shows as a column. Empty when no regime ran more than once."""
    repeated = [r for r in regimes if len(r.get("runs", [])) > 1]
    if not repeated:
        return []
    seeds = sorted({k for r in repeated for k in _columns(r)})
    lines = ["", "## Runs by seed", "", "| regime | " + " | ".join(
        f"run {k + 1} (seed {k})" if not where else f"{where}: seed {k}" for where, k in seeds)
             + " | mean |", "|" + "---|" * (len(seeds) + 2)]
    by_seed: dict[tuple[str, int], list[float]] = {k: [] for k in seeds}  # the regimes' paired Δ, column by column
    for r in repeated:
        diffs, invalid = r.get("run_diffs") or [None] * len(r["runs"]), r.get("run_invalid") or []
        if not any(invalid):  # label/score mode: every step names a candidate
            invalid = []
        at = {k: i for i, k in enumerate(_columns(r))}
        cell = []
        for k in seeds:
            if (i := at.get(k)) is None:
                cell.append("–")
                continue
            notes = ([f"{100 * diffs[i]:+.1f}"] if diffs[i] is not None else []) + (
                [f"invalid {_pct(invalid[i])}"] if i < len(invalid) and invalid[i] is not None else [])
            cell.append(_pct(r["runs"][i]) + (f" ({'; '.join(notes)})" if notes else ""))
            if diffs[i] is not None:
                by_seed[k].append(diffs[i])
        mean = _pct(r["success_rate"]) + (f" ({100 * r['diff']:+.1f})" if "diff" in r else "")
        lines.append(f"| {r['regime']} | " + " | ".join(cell) + f" | {mean} |")
    if sum(1 for r in repeated if r.get("run_diffs")) > 1:
        lines.append("| mean of the regimes' Δ | " + " | ".join(
            f"{100 * sum(d) / len(d):+.1f} ({len(d)})" if d else "–" for d in by_seed.values()) + " | |")
    lines += ["", "Each cell: held-out success % (the paired Δ in points against the row's baseline, all of its "
                  "runs; the share of invalid steps where the evaluation counted them). Run i of `--repeats` "
                  "has `infra.run_seed` i-1: its own rollout draws and curriculum, the data and the warm start "
                  "shared; a run not finished is a gap."]
    return lines
