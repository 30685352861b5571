"""Held-out success by slice: families seen in training, families never seen, and tasks longer than training's.

Owns splitting one experiment's held-out tasks into the slices that say whether a policy generalises
(issue 64, part 7), and each regime's success and paired difference on each slice. A regime's overall
held-out success can rise while it loses on every task unlike its training ones; these figures show it.

The slices are read from what a run records: each held-out evaluation row carries its task's `family`
and `plan_length` (the expert's plan from the task's start, actors/evaluate.summarize), and the run's
summary its training tasks' families and longest expert plan (`training_tasks`, infra/run/report.py):

- seen:   held-out tasks of a family some training task has (unseen seeds of a trained family);
- unseen: held-out tasks of a family no training task has;
- long:   held-out tasks whose expert plan is longer than the longest one among the training tasks
          (it overlaps the other two).

A slice that a run did not record (a run from before these fields, a family whose tasks carry no plan
length) is None, and shows as "not recorded", never as an empty slice.

Beside the slices, the training tasks themselves, where the runs played them after training
(evaluation.training_tasks, summary `train_after`): a regime that gains on its training tasks and not on held-out
ones learned those tasks, not their families. Pure functions on summaries.
"""

from __future__ import annotations

from typing import Any, Sequence

from actors.confidence import compare_runs

SEEN, UNSEEN, LONG, TRAINING = "seen", "unseen", "long", "training"
SLICES = (SEEN, UNSEEN, LONG)
TITLES = {SEEN: "families seen in training", UNSEEN: "families never seen", LONG: "longer than training",
          TRAINING: "its training tasks"}


def training_of(runs: Sequence[dict]) -> dict | None:
    """The training tasks' families and longest expert plan that a regime's runs recorded (they share one split)."""
    return next((r["training_tasks"] for r in runs if r.get("training_tasks")), None)


def slice_ids(per_task: Sequence[dict], training: dict | None) -> dict[str, list[str] | None]:
    """The held-out task ids of each slice (sorted); None for a slice the rows or the run did not record."""
    rows = {str(r["task_id"]): r for r in per_task}
    out: dict[str, list[str] | None] = {s: None for s in SLICES}
    if training is None or not rows:
        return out
    families = set(training.get("families") or [])
    if families and all(r.get("family") for r in rows.values()):
        out[SEEN] = sorted(t for t, r in rows.items() if r["family"] in families)
        out[UNSEEN] = sorted(t for t, r in rows.items() if r["family"] not in families)
    horizon = training.get("plan_length_max")
    if horizon is not None and all(r.get("plan_length") is not None for r in rows.values()):
        out[LONG] = sorted(t for t, r in rows.items() if r["plan_length"] > horizon)
    return out


def _rows(run: dict, ids: set[str]) -> list[dict]:
    return [r for r in run["heldout_after"].get("per_task", []) if str(r["task_id"]) in ids]


def slices(runs: Sequence[dict], baseline: Sequence[dict] | None = None) -> dict[str, dict | None]:
    """A regime's success on each slice (the mean over its runs, with an interval over runs and tasks), and,
    against `baseline`'s runs, the paired difference on the slice's tasks. None: the slice is not recorded;
    {"tasks": 0}: recorded, and no held-out task falls in it."""
    training = training_of(runs)
    ids = slice_ids(runs[0]["heldout_after"].get("per_task", []), training)
    out: dict[str, dict | None] = {}
    for name in SLICES:
        if ids[name] is None or not ids[name]:
            out[name] = None if ids[name] is None else {"tasks": 0}
            continue
        keep = set(ids[name])
        mine = [_rows(r, keep) for r in runs]
        pooled = compare_runs(mine)
        fig: dict[str, Any] = {"tasks": len(keep), "success_rate": pooled.diff, "ci_low": pooled.ci_low,
                               "ci_high": pooled.ci_high}
        if baseline:
            d = compare_runs(mine, [_rows(b, keep) for b in baseline])
            fig.update({"diff": d.diff, "diff_ci_low": d.ci_low, "diff_ci_high": d.ci_high})
        out[name] = fig
    if training is not None and training.get("plan_length_max") is not None:
        out["horizon"] = {"plan_length_max": training["plan_length_max"]}
    out[TRAINING] = trained(runs, baseline)
    return out


def trained(runs: Sequence[dict], baseline: Sequence[dict] | None = None) -> dict | None:
    """A regime's success on its own training tasks after training (the mean over its runs, with an interval over
    runs and tasks) and, where every baseline run played them too, the paired difference on the tasks both
    played (a baseline trained on other tasks pairs on the shared ones only). None: some run did not play them."""
    if not all(r.get("train_after") for r in runs):
        return None
    mine = [r["train_after"].get("per_task", []) for r in runs]
    pooled = compare_runs(mine)
    fig: dict[str, Any] = {"tasks": pooled.tasks, "success_rate": pooled.diff, "ci_low": pooled.ci_low,
                           "ci_high": pooled.ci_high}
    if baseline and all(b.get("train_after") for b in baseline):
        d = compare_runs(mine, [b["train_after"].get("per_task", []) for b in baseline])
        fig.update({"diff": d.diff, "diff_ci_low": d.ci_low, "diff_ci_high": d.ci_high, "diff_tasks": d.tasks})
    return fig


def mixed(by_slice: dict[str, dict | None]) -> str:
    """'' unless the regime gains on what it trained on (its training tasks where they were played, else the
    held-out seeds of its training families) and loses on a held-out slice: then says so."""
    for gained, elsewhere in ((TRAINING, SLICES), (SEEN, (UNSEEN, LONG))):
        won = by_slice.get(gained) or {}
        if won.get("diff") is None or won["diff"] <= 0:
            continue
        lost = [f"{TITLES[s]} {100 * f['diff']:+.1f}" for s in elsewhere
                if (f := by_slice.get(s) or {}).get("diff") is not None and f["diff"] < 0]
        if lost:
            return f"gains {100 * won['diff']:+.1f} pts on {TITLES[gained]} but loses on " + " and ".join(lost)
    return ""


def _cell(f: dict | None) -> tuple[str, str]:
    if f is None:
        return "not recorded", "–"
    if not f.get("tasks"):
        return "no task", "–"
    rate = f"{100 * f['success_rate']:.1f} [{100 * f['ci_low']:.1f}, {100 * f['ci_high']:.1f}] ({f['tasks']})"
    diff = "–" if f.get("diff") is None else \
        f"{100 * f['diff']:+.1f} [{100 * f['diff_ci_low']:+.1f}, {100 * f['diff_ci_high']:+.1f}]"
    return rate, diff


def markdown_lines(rows: Sequence[dict], compare_to: str) -> list[str]:
    """results.md's table of held-out success by slice, one line per regime, and the regimes whose gain
    on their training families came with a loss elsewhere."""
    if not rows:
        return []
    horizon = next((h["plan_length_max"] for r in rows if (h := (r.get("slices") or {}).get("horizon"))), None)
    long = TITLES[LONG] + (f" (plan > {horizon} steps)" if horizon is not None else "")
    vs = f"Δ vs {compare_to}" if compare_to else "Δ"
    head = ["regime", f"{TITLES[SEEN]} % [95% CI] (tasks)", vs, f"{TITLES[UNSEEN]} %", vs, f"{long} %", vs]
    played = [r for r in rows if (r.get("slices") or {}).get(TRAINING)]
    names = (*SLICES, TRAINING) if played else SLICES  # evaluation.training_tasks: learned tasks vs generalisation
    if played:
        head += [f"{TITLES[TRAINING]} % (not held out)", vs]
    lines = ["", "## Held-out success by slice", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s = r.get("slices") or {}
        cells = [c for name in names for c in _cell(s.get(name))]
        lines.append(f"| {r['regime']} | " + " | ".join(cells) + " |")
    flagged = [f"{r['regime']} {m}" for r in rows if (m := mixed(r.get("slices") or {}))]
    lines += ["", "Seen: unseen seeds of the families trained on; unseen: families no training task has; longer: "
                  "the expert's plan longer than the longest among the training tasks (overlaps the other two). "
                  "Δ is paired on the slice's tasks against each row's baseline, over runs and tasks."
              + (" Its training tasks: the final policy replayed on the tasks it trained on "
                 "(evaluation.training_tasks), paired with the baseline on the tasks both played; not a held-out "
                 "figure: a gain there and none held out is a policy that learned its tasks, not their families."
                 if played else "")]
    if flagged:
        lines += ["", "Gains on what a regime trained on that came with losses held out: " + "; ".join(flagged) + "."]
    return lines
