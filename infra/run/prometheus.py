"""Reading a run back from Prometheus: range queries over its HTTP API and panels drawn with matplotlib.

Owns the client side of Prometheus for reports: `query_range` (GET
/api/v1/query_range, the documented HTTP API), `dashboard_series` (every panel of a
dashboard in infra/dashboards.py over a time window) and `plot_panels` (a grid of
those panels as one PNG, the way Grafana would lay them out, for a run report or the
README: no Grafana runs here). Uses only the standard library's HTTP client.
"""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request
from pathlib import Path

from infra.dashboards import DASHBOARDS


class PrometheusError(RuntimeError):
    """Prometheus answered with an error status, or not at all."""


def _get(url: str, path: str, params: dict, timeout: float = 10.0) -> dict:
    full = f"{url.rstrip('/')}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(full, timeout=timeout) as r:
            body = json.loads(r.read())
    except OSError as exc:
        raise PrometheusError(f"GET {full}: {exc}") from exc
    if body.get("status") != "success":
        raise PrometheusError(f"GET {full}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def query_range(url: str, expr: str, start: float, end: float, step: float = 5.0) -> list[dict]:
    """The matrix of `expr` between `start` and `end` (unix seconds): [{"metric": labels, "values": [[t, "v"]...]}]."""
    return _get(url, "/api/v1/query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                             "step": f"{step:g}"})["result"]


def query(url: str, expr: str, at: float | None = None) -> list[dict]:
    """The instant vector of `expr` (now, or at `at`)."""
    return _get(url, "/api/v1/query", {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})})["result"]


def targets(url: str) -> list[dict]:
    """Prometheus's active targets (GET /api/v1/targets)."""
    return _get(url, "/api/v1/targets", {"state": "active"})["activeTargets"]


def dashboard_series(url: str, concern: str, start: float, end: float, step: float = 5.0) -> list[tuple[str, list[dict]]]:
    """(panel title, range result) for every panel of one dashboard."""
    return [(title, query_range(url, expr, start, end, step)) for title, expr, _unit in DASHBOARDS[concern][1]]


def _label(metric: dict) -> str:
    keep = {k: v for k, v in metric.items() if k not in ("__name__", "run", "instance")}
    return ", ".join(f"{k}={v}" for k, v in sorted(keep.items())) or metric.get("__name__", "value")


def plot_panels(panels: list[tuple[str, list[dict]]], path: Path, title: str = "", cols: int = 3,
                t0: float | None = None) -> Path:
    """Draw (title, range result) panels in a grid, x in seconds from `t0` (the earliest sample by default)."""
    import matplotlib  # heavy, and only a report draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display

    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.0 * rows), squeeze=False)
    if t0 is None:
        t0 = min((float(v[0][0]) for _, res in panels for s in res for v in [s["values"]] if v), default=0.0)
    for ax, (ptitle, result) in zip(axes.flat, panels):
        drawn = 0
        for series in result:
            pts = [(float(t) - t0, float(v)) for t, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=_label(series["metric"])[:48], lw=1.4)
                drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        elif drawn <= 6:
            ax.legend(fontsize=6, loc="best")
        ax.set_title(ptitle, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.set_xlabel("seconds", fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
