"""Metrics: one namespaced declaration each, served over HTTP; dashboards only query declared names."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client import REGISTRY

from infra import dashboards, metrics

PREFIXES = ("rollout_", "learner_", "stream_", "simulator_", "engine_", "curriculum_", "env_")


def _declared() -> dict[str, object]:
    return {name: obj for name, obj in vars(metrics).items() if hasattr(obj, "_name") and hasattr(obj, "_type")}


def test_names_are_namespaced_and_labels_bounded():
    for name, m in _declared().items():
        full = m._name  # type: ignore[attr-defined]
        assert full.startswith(PREFIXES), full
        assert not {"task", "task_id", "trajectory_id", "episode_id"} & set(m._labelnames), full  # type: ignore[attr-defined]


def test_metrics_endpoint_serves_declared_metrics():
    port = metrics.serve_metrics(0)
    metrics.STREAM_RECONNECTS.inc()
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "stream_reconnects_total" in body and "learner_weight_version" in body


def test_dashboard_queries_use_declared_metrics():
    samples = {s.name for fam in REGISTRY.collect() for s in fam.samples} | {fam.name for fam in REGISTRY.collect()}
    declared = {m._name for m in _declared().values()}  # type: ignore[attr-defined]
    for _row, title, expr, _unit in dashboards.PANELS:
        bare = re.sub(r"\b(by|on)\s*\([^)]*\)", "", expr)  # drop label lists
        names = set(re.findall(r"\b([a-z]+_[a-z_]+)\b", bare)) - {"histogram_quantile"}
        assert names, title
        for n in names:
            base = re.sub(r"_(bucket|count|sum|total)$", "", n)
            assert base in declared or n in samples, f"panel {title!r} queries undeclared {n}"


def test_committed_dashboard_files_are_current():
    for name, text in dashboards.provisioning_files().items():
        assert (dashboards.OUT / name).read_text() == text, f"run `python -m infra.dashboards` to refresh {name}"
