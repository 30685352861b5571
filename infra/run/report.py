"""What a training run shows and leaves behind: the progress bar, the time series, PNG plots,
summary.json, report.md and the printed table; and `dreamgym report RUN_DIR`.

Owns the run's reporting, nothing about training. `training_progress` yields the
learner's `on_update` callback: it moves a progress bar and appends one row per
update to a `RunHistory`; `write_report` draws success, reward, loss, KL, staleness
and throughput over wall time with matplotlib (Agg, no display), writes
`summary.json` with the before/after held-out evaluation and `report.md`, and prints
the table. `dreamgym report RUN_DIR` redraws the plots and report.md of a finished
run from its summary.json; with `--prometheus URL` it also draws every dashboard of
infra/dashboards.py from range queries over the run's time window
(`plots/prometheus/<concern>.png`, infra/run/prometheus.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from actors.confidence import compare
from infra.config import Config
from infra.dashboards import DASHBOARDS, MAIN_PANELS
from infra.run import prometheus

PLOTS = (("success_rate", "success (synthetic)"), ("mean_reward", "mean reward"), ("loss", "loss"), ("kl", "KL"),
         ("staleness", "mean staleness (versions)"), ("traj_per_s", "trajectories / s"))


@dataclass
class RunHistory:
    """One row per learner update, timed from the start of training.

    With `path` set, every row is also written there (`runs/<name>/history.json`), so a resumed
    run continues its earlier segments' rows up to the checkpoint it resumed from (`resume`),
    and both clocks count those segments: `seconds` (training) and `wall_seconds` (the run,
    from `run_started`). Time between that checkpoint and the stop is not counted."""

    started: float = field(default_factory=time.time)
    rows: list[dict] = field(default_factory=list)
    ended: float | None = None
    path: Path | None = None
    run_started: float = field(default_factory=time.time)
    earlier_s: float = 0.0  # training seconds of the earlier segments, to the checkpoint resumed from
    earlier_wall_s: float = 0.0  # their wall seconds

    def record(self, **values: Any) -> None:
        self.rows.append({"t": self.seconds, "wall": self.wall_seconds, **values})
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.rows))
            tmp.replace(self.path)

    def resume(self, version: int) -> None:
        """Take the earlier segments' rows up to weight `version` (the checkpoint resumed from) from `path`."""
        if self.path is None or not self.path.exists():
            return
        earlier = [r for r in json.loads(self.path.read_text()) if r.get("version", 0) <= version]
        if earlier:
            self.earlier_s, self.earlier_wall_s = earlier[-1]["t"], earlier[-1].get("wall", earlier[-1]["t"])
        self.rows = earlier + self.rows

    def end(self) -> None:
        self.ended = time.time()

    @property
    def seconds(self) -> float:
        """Training wall time: from the start to `end()` (or now), plus the earlier segments'."""
        return self.earlier_s + (self.ended or time.time()) - self.started

    @property
    def wall_seconds(self) -> float:
        """The run's wall time so far, plus the earlier segments'."""
        return self.earlier_wall_s + time.time() - self.run_started


def write_plots(history: RunHistory, out_dir: Path) -> list[Path]:
    import matplotlib  # heavy, and only the end of a run draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, title in PLOTS:
        pts = [(r["t"], r[key]) for r in history.rows if r.get(key) is not None]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("wall time (s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = out_dir / f"{key}.png"
        fig.savefig(p, dpi=80)
        plt.close(fig)
        paths.append(p)
    return paths


def write_summary(path: Path, summary: dict) -> None:
    path.write_text(json.dumps(summary, indent=2, default=str))


def results_table(before: dict | None, after: dict | None, extra: dict, family: str = "TextWorld",
                  trained: str = "after training") -> Any:
    t = Table(title=f"held-out REAL {family} tasks")
    for col in ("policy", "success", "95% CI", "mean steps", "invalid rate", "episodes"):
        t.add_column(col, justify="right")
    for name, r in (("before (the starting policy)", before), (trained, after)):
        if r:
            t.add_row(name, f"{r['success_rate']:.3f}", f"[{r['ci_low']:.2f}, {r['ci_high']:.2f}]",
                      f"{r['mean_steps']:.1f}", f"{r['invalid_rate']:.3f}", str(r["episodes"]))
    t.caption = ", ".join(f"{k}: {v}" for k, v in extra.items())
    return t


def verdict(before: dict | None, after: dict | None, updates: int) -> str:
    """One line under a run's table: what changed on the held-out tasks, and whether that is a learning
    result (it never is from one short run: the paper's claims are checked by `dreamgym experiment`)."""
    if not before or not after:
        return ""
    b, a = float(before["success_rate"]), float(after["success_rate"])
    head = f"Held-out success {b:.3f} -> {a:.3f} after {updates} update{'s' if updates != 1 else ''}"
    if before.get("per_task") and after.get("per_task"):
        d = compare(after["per_task"], before["per_task"])
        head += f": {100 * d.diff:+.1f} points, 95 % paired interval [{100 * d.ci_low:+.1f}, {100 * d.ci_high:+.1f}] over {d.tasks} tasks"
        if d.excludes_zero:
            why = ("outside this run's noise, yet one short run is a check that the loop works, not a learning "
                   "result")
        else:
            why = "within the noise of this many tasks, so neither a gain nor a loss"
        head += f". That is {why}."
    else:
        head += "."
    return (head + " Learning is measured against the best SFT, on repeats: "
            "`dreamgym experiment configs/experiments/textworld_cpu.yaml`.")


@contextlib.contextmanager
def training_progress(console: Any, cfg: Config, learner: Any, history: RunHistory, where: str = "DreamGym",
                      until: int | None = None, extra: Callable[[], dict] | None = None
                      ) -> Iterator[Callable[[Any], None]]:
    """A progress bar over learner updates; yields the `on_update(stats)` that records each update and moves the bar.

    `where` names the phase (DreamGym, real env, ...); `until` is the update count it runs up to; `extra()` gives
    more values for each update's row (the phase's running counts, kept by a run that is stopped before its summary)."""
    label = f"{cfg.learner.algo.upper()} in {where}"
    total = until if until is not None and until < 1_000_000 else None  # an open-ended phase: no total
    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[info]}"), console=console)
    task = bar.add_task(label, total=total, completed=learner.updates, info="waiting for the first groups")

    def on_update(s: Any) -> None:
        history.record(phase=where, version=s.version, loss=s.loss, kl=s.kl, mean_reward=s.mean_reward,
                       success_rate=s.success_rate, staleness=s.mean_staleness,
                       traj_per_s=learner.trained / max(1e-9, history.seconds),
                       discarded=s.discarded, tokens=s.tokens, action_tokens=s.action_tokens,
                       update_s=round(s.seconds, 2),
                       resident_mb=round(s.resident_mb), clip_fraction=s.clip_fraction,
                       invalid_share=s.invalid_share, trajectories=s.trajectories, steps=s.steps, passes=s.passes,
                       **(extra() if extra is not None else {}))
        invalid = "" if s.invalid_share is None else f" invalid {s.invalid_share:.0%}"  # generate mode
        bar.update(task, completed=s.version, info=f"loss {s.loss:.3f} reward {s.mean_reward:.2f} "
                                                    f"success {s.success_rate:.2f} stale {s.mean_staleness:.1f} "
                                                    f"mem {s.resident_mb / 1024:.1f} GB{invalid}")

    bar.start()
    try:
        yield on_update
    finally:
        bar.stop()


def brief(r: dict | None) -> dict | None:
    """What summary.json keeps of a held-out evaluation (the EvalReport as a dict)."""
    keep = ("success_rate", "successes", "ci_low", "ci_high", "episodes", "mean_steps", "invalid_rate",
            "seconds", "per_task")
    return None if r is None else {k: r[k] for k in keep if k in r}


def training_tasks(tasks: list) -> dict:
    """What the results table's held-out slices need of the training tasks (infra/run/generalisation.py):
    their families and the longest expert plan among them (None where a task records no plan length)."""
    lengths = [t.meta.get("plan_length") for t in tasks]
    return {"tasks": len(tasks), "families": sorted({t.family for t in tasks}),
            "plan_length_max": max(lengths) if lengths and None not in lengths else None}


def summary(cfg: Config, name: str, before: dict | None, after: dict | None, history: RunHistory, learner: Any,
            phases: list[dict], buffer_size: int, t_start: float, offline: list, fidelity: dict | None,
            counts: dict[str, int], train_tasks: list | None = None, train_after: dict | None = None) -> dict:
    """summary.json: the run's settings that matter, held-out success before and after (with per-task
    results, for paired comparisons), the RL phases, transitions by kind counted exactly, the history.
    `counts` (infra/budget.run_counts), the trajectories trained, the history and its clocks cover every
    segment of a resumed run (the last two up to the checkpoint it resumed from); `phases` only this one's.
    `train_tasks`: the split's training tasks, summed up as `training_tasks`; `train_after`: the final policy
    on them (evaluation.training_tasks), None where they were not evaluated."""
    return {
        "run": name, "algo": cfg.learner.algo, "sync": cfg.learner.sync, "env_kind": cfg.actors.env_kind,
        "family": cfg.actors.env_family,
        **({"training_tasks": training_tasks(train_tasks)} if train_tasks is not None else {}),
        "heldout_before": brief(before), "heldout_after": brief(after), "train_after": brief(train_after),
        "improved": (after["success_rate"] > before["success_rate"]) if before and after else None,
        "updates": learner.updates if learner else 0, "weight_version": learner.version if learner else 0,
        "trajectories_trained": learner.trained if learner else 0,
        "trajectories_pushed": counts["trajectories_pushed"],
        "trajectories_redelivered": learner.redelivered if learner else 0,  # retrained after a crash
        "trajectories_dead_lettered": learner.dead_lettered if learner else 0,
        "updates_undone": dict(learner.failed_updates) if learner else {},
        "transitions": {"offline_real": sum(len(t.steps) for t in offline),
                        "online_real": sum(p["real_transitions"] for p in phases),
                        "synthetic": counts["synthetic_steps_pushed"]},
        "phases": phases, "mexp_fidelity": fidelity,
        "replay_buffer_size": buffer_size,
        "train_seconds": round(history.seconds, 1), "total_seconds": round(history.wall_seconds, 1),
        "started_at": round(t_start, 3), "ended_at": round(time.time(), 3),
        "history": history.rows,
    }


def write_report(run_dir: Path, summary_: dict, history: RunHistory, console: Any) -> dict:
    """summary.json and the plots under `run_dir`, the before/after table on the console; returns the summary."""
    write_summary(run_dir / "summary.json", summary_)
    write_plots(history, run_dir / "plots")
    (run_dir / "report.md").write_text(markdown(summary_, [f"plots/{k}.png" for k, _ in PLOTS]))
    tr = summary_.get("transitions", {})
    console.print(results_table(summary_["heldout_before"], summary_["heldout_after"], {
        "updates": summary_["updates"], "weight version": summary_["weight_version"],
        "trajectories": summary_["trajectories_trained"], "real transitions": tr.get("online_real", 0),
        "synthetic transitions": tr.get("synthetic", 0), "train s": f"{summary_['train_seconds']:.0f}",
        "total s": f"{summary_['total_seconds']:.0f}"}, summary_.get("family", "TextWorld"),
        " then ".join(p["phase"] for p in summary_.get("phases", [])) or "after"))
    line = verdict(summary_["heldout_before"], summary_["heldout_after"], int(summary_.get("updates") or 0))
    if line:
        console.print(line)
    console.print(f"run directory: {run_dir}")
    return summary_


def markdown(s: dict, images: list[str]) -> str:
    """report.md: the run's outcome in a few lines and tables, then its plots."""
    def pct(r: dict | None) -> str:
        return "-" if not r else f"{r['success_rate']:.3f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}] ({r['episodes']} ep.)"
    tr = s.get("transitions", {})
    lines = [f"# Run {s.get('run', '?')}", "",
             f"{s.get('algo', '?').upper()} on {s.get('family', '?')} ({s.get('env_kind', '?')} rollouts"
             f"{', sync' if s.get('sync') else ''}): {s.get('updates', 0)} updates to weight version "
             f"{s.get('weight_version', 0)}, {s.get('trajectories_trained', 0)} trajectories trained, "
             f"{s.get('train_seconds', 0):.0f} s of training ({s.get('total_seconds', 0):.0f} s in all).", "",
             "| held-out REAL tasks | success [95% CI] |", "|---|---|",
             f"| before | {pct(s.get('heldout_before'))} |",
             *(f"| after {p['phase']} | {pct(p['heldout_after'])} |" for p in s.get("phases", [])
               if p.get("heldout_after")),
             f"| after | {pct(s.get('heldout_after'))} |",
             *([f"| after, on its training tasks | {pct(s['train_after'])} |"] if s.get("train_after") else []), "",
             "| transitions | count |", "|---|---|",
             *(f"| {k.replace('_', ' ')} | {v} |" for k, v in tr.items()), ""]
    if s.get("phases"):
        lines += ["| phase | updates | seconds | trajectories pushed | set aside by the learner | held for an update |",
                  "|---|---|---|---|---|---|",
                  *(phase_row(p) for p in s["phases"]), ""]
        lines += [f"{p['phase']}: Mexp answered {m['simulated']} steps and {m['replayed']} were replayed real ones; "
                  f"the reply memo answered {m['memo_hits']} of Mexp's requests" for p in s["phases"]
                  if (m := p.get("mexp_steps"))] + [""] * any("mexp_steps" in p for p in s["phases"])
    fid = s.get("mexp_fidelity")
    if fid:
        lines += ["Mexp fidelity before RL: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in fid.items()), ""]
    lines += [f"![{Path(i).stem}]({i})" for i in images]
    return "\n".join(lines) + "\n"


def phase_row(p: dict) -> str:
    """One phase's line; a phase a resumed run found already done says so (its figures are the earlier segment's)."""
    if p.get("earlier_segment"):
        return f"| {p['phase']} | done in an earlier segment (counted in the totals above) | – | – | – | – |"
    aside = ", ".join(f"{k} {n}" for k, n in sorted(p.get("trajectories_set_aside", {}).items())) or "-"
    return (f"| {p['phase']} | {p['updates']} | {p['seconds']} | {p['trajectories_pushed']} | {aside} | "
            f"{p.get('trajectories_waiting', '-')} |")


def history_of(summary_: dict) -> RunHistory:
    """The RunHistory a summary.json recorded (timestamps relative, as recorded)."""
    h = RunHistory(started=summary_.get("started_at", 0.0), rows=list(summary_.get("history", [])))
    h.ended = summary_.get("ended_at")
    return h


def run_window(run_dir: Path, summary_: dict) -> tuple[float, float]:
    """(start, end) unix seconds of a run: recorded in summary.json, else estimated from its mtime."""
    if "started_at" in summary_ and "ended_at" in summary_:
        return summary_["started_at"], summary_["ended_at"]
    end = (run_dir / "summary.json").stat().st_mtime
    return end - float(summary_.get("total_seconds", 3600)), end


def prometheus_plots(url: str, run_dir: Path, start: float, end: float, step: float = 0.0) -> list[Path]:
    """Every dashboard of infra/dashboards.py over [start, end], one PNG per concern under plots/prometheus/,
    and `overview.png` with the main panels (MAIN_PANELS) first."""
    step = step or max(1.0, (end - start) / 300)
    out = run_dir / "plots" / "prometheus"
    series = {concern: dict(prometheus.dashboard_series(url, concern, start, end, step)) for concern in DASHBOARDS}
    paths = [prometheus.plot_panels([(f"{concern}: {title}", series[concern][title]) for concern, title in MAIN_PANELS],
                                    out / "overview.png", f"DreamGym run {run_dir.name} (scraped by Prometheus)",
                                    t0=start)]
    paths += [prometheus.plot_panels(list(series[concern].items()), out / f"{concern}.png", title, t0=start)
              for concern, (title, _items) in DASHBOARDS.items()]
    return paths


# ---- `dreamgym report` ------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a finished run's directory (runs/<name>, with summary.json)")
    p.add_argument("--prometheus", default="", metavar="URL",
                   help="also draw every dashboard from this Prometheus's range queries over the run's window")
    p.add_argument("--step", type=float, default=0.0, help="range-query step in seconds (default: window/300, >= 1)")


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    path = run_dir / "summary.json"
    if not path.exists():
        print(f"dreamgym report: {path} not found (the run has not finished, or this is not a run directory)")
        return 1
    summary_ = json.loads(path.read_text())
    images = [p.relative_to(run_dir).as_posix() for p in write_plots(history_of(summary_), run_dir / "plots")]
    if args.prometheus:
        start, end = run_window(run_dir, summary_)
        images += [p.relative_to(run_dir).as_posix()
                   for p in prometheus_plots(args.prometheus, run_dir, start, end, args.step)]
    (run_dir / "report.md").write_text(markdown(summary_, images))
    print(f"wrote {run_dir / 'report.md'} and {len(images)} plots under {run_dir / 'plots'}")
    return 0
