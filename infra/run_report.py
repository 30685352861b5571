"""What a training run leaves behind: the time series, PNG plots, summary.json and the printed table.

Owns the run directory's report files, nothing about training. The driver appends one
row per learner update (`record`); `write` draws success, reward, loss, KL, staleness
and throughput over wall time with matplotlib (Agg, no display) and writes
`summary.json` with the before/after held-out evaluation.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLOTS = (("success_rate", "success (synthetic)"), ("mean_reward", "mean reward"), ("loss", "loss"), ("kl", "KL"),
         ("staleness", "mean staleness (versions)"), ("traj_per_s", "trajectories / s"))


@dataclass
class RunHistory:
    started: float = field(default_factory=time.time)
    rows: list[dict] = field(default_factory=list)

    def record(self, **values: Any) -> None:
        self.rows.append({"t": time.time() - self.started, **values})


def write_plots(history: RunHistory, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def results_table(before: dict | None, after: dict | None, extra: dict) -> Any:
    from rich.table import Table

    t = Table(title="DreamGym quickstart: held-out REAL TextWorld games")
    for col in ("policy", "success", "95% CI", "mean steps", "invalid rate", "episodes"):
        t.add_column(col, justify="right")
    for name, r in (("before (base)", before), ("after (GRPO in DreamGym)", after)):
        if r:
            t.add_row(name, f"{r['success_rate']:.3f}", f"[{r['ci_low']:.2f}, {r['ci_high']:.2f}]",
                      f"{r['mean_steps']:.1f}", f"{r['invalid_rate']:.3f}", str(r["episodes"]))
    t.caption = ", ".join(f"{k}: {v}" for k, v in extra.items())
    return t
