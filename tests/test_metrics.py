"""Metrics: one namespaced declaration each, served over HTTP; dashboards only query declared names."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client import REGISTRY

from infra import dashboards, metrics

PREFIXES = ("rollout_", "learner_", "stream_", "simulator_", "engine_", "curriculum_", "env_",
            "policy_")  # policy_: what the policy wrote (generate mode), named by issue 60


def _declared() -> dict[str, object]:
    return {name: obj for name, obj in vars(metrics).items() if hasattr(obj, "_name") and hasattr(obj, "_type")}


def _engine_declared() -> list:
    engine = metrics.EngineServerMetrics()
    return [m for m in vars(engine).values() if hasattr(m, "_name")]


def test_names_are_namespaced_and_labels_bounded():
    for m in [*_declared().values(), *_engine_declared()]:
        full = m._name  # type: ignore[attr-defined]
        assert full.startswith(PREFIXES), full
        assert not {"task", "task_id", "trajectory_id", "episode_id"} & set(m._labelnames), full  # type: ignore[attr-defined]


def test_metrics_endpoint_serves_declared_metrics():
    server = metrics.serve_metrics(0)
    try:
        metrics.STREAM_RECONNECTS.inc()
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
        assert "stream_reconnects_total" in body and "learner_weight_version" in body
        assert "engine_queue_depth" not in body  # an engine's server-side metrics live in its own registry
    finally:
        server.close()


def test_each_engine_has_its_own_registry():
    a, b = metrics.EngineServerMetrics(), metrics.EngineServerMetrics()
    a.queue_depth.set(3)
    b.queue_depth.set(4)
    assert a.registry.get_sample_value("engine_queue_depth") == 3
    assert b.registry.get_sample_value("engine_queue_depth") == 4
    assert REGISTRY.get_sample_value("engine_queue_depth") is None
    a.queue_depth.set(0)
    b.queue_depth.set(0)


def test_dashboard_queries_use_declared_metrics():
    samples = {s.name for fam in REGISTRY.collect() for s in fam.samples} | {fam.name for fam in REGISTRY.collect()}
    declared = {m._name for m in [*_declared().values(), *_engine_declared()]}  # type: ignore[attr-defined]
    declared.add("up")  # Prometheus's own per-target series
    for concern, title, expr, _unit in dashboards.panels():
        bare = re.sub(r"\b(by|on)\s*\([^)]*\)", "", expr)  # drop label lists
        bare = re.sub(r"\{[^}]*\}", "", bare)  # and label matchers
        names = set(re.findall(r"\b([a-z]+_[a-z_]+)\b", bare)) - {"histogram_quantile", "clamp_min"}
        names |= {"up"} & set(re.findall(r"\b[a-z]+\b", bare))
        assert names, title
        for n in names:
            base = re.sub(r"_(bucket|count|sum|total)$", "", n)
            assert base in declared or n in samples, f"{concern} panel {title!r} queries undeclared {n}"


def test_one_dashboard_per_concern():
    assert list(dashboards.DASHBOARDS) == ["throughput", "learner", "rewards", "curriculum", "streams", "engines",
                                           "workers", "fidelity"]
    uids = {dashboards.dashboard(c)["uid"] for c in dashboards.DASHBOARDS}
    assert len(uids) == len(dashboards.DASHBOARDS)
    assert "file_sd_configs" in dashboards.provisioning_files()["prometheus.yml"]


def test_committed_dashboard_files_are_current():
    for name, text in dashboards.provisioning_files().items():
        assert (dashboards.OUT / name).read_text() == text, f"run `python -m infra.dashboards` to refresh {name}"


def test_main_panels_exist():
    titles = {(c, t) for c, t, _e, _u in dashboards.panels()}
    assert set(dashboards.MAIN_PANELS) <= titles
