"""Grafana dashboards and Prometheus scrape config, as code.

Owns the monitoring view of a run: which panels exist and which PromQL each one
runs. `python -m infra.dashboards` regenerates `infra/dashboards/dreamgym.json` and
the provisioning files (a test keeps them in sync and checks that every query names
a metric declared in infra/metrics.py). `publish(url, token)` uploads the dashboard
with `grafana-client` (the maintained fork of grafana-api; `GrafanaApi`), for a
Grafana that was not provisioned from these files.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("dashboards")

# (row, title, PromQL, unit)
PANELS: list[tuple[str, str, str, str]] = [
    ("Rollout", "Episodes/s by status", "sum by (status) (rate(rollout_episodes_total[1m]))", "ops"),
    ("Rollout", "Env steps/s", "sum by (env_kind) (rate(rollout_steps_total[1m]))", "ops"),
    ("Rollout", "Invalid actions/s", "sum(rate(rollout_invalid_actions_total[1m]))", "ops"),
    ("Rollout", "Episode p50/p95 (s)", "histogram_quantile(0.95, sum by (le) (rate(rollout_episode_seconds_bucket[5m])))", "s"),
    ("Rollout", "Workers alive", "sum(rollout_workers)", "none"),
    ("Streams", "Trajectory stream in/out", "sum by (stream) (rate(stream_messages_added_total[1m])) - on(stream) sum by (stream) (rate(stream_messages_acked_total[1m]))", "ops"),
    ("Streams", "Dead letters", "sum by (stream, reason) (increase(stream_dead_letters_total[5m]))", "none"),
    ("Streams", "Reclaimed entries", "sum by (stream) (increase(stream_messages_reclaimed_total[5m]))", "none"),
    ("Streams", "Redis reconnects", "sum(increase(stream_reconnects_total[5m]))", "none"),
    ("Learner", "Policy loss", "learner_loss", "none"),
    ("Learner", "KL to reference", "learner_kl", "none"),
    ("Learner", "Clip fraction", "learner_clip_fraction", "percentunit"),
    ("Learner", "Mean reward", "learner_mean_reward", "none"),
    ("Learner", "Weight version", "learner_weight_version", "none"),
    ("Learner", "Staleness p95 (versions)", "histogram_quantile(0.95, sum by (le) (rate(learner_staleness_versions_bucket[5m])))", "none"),
    ("Learner", "Trajectories by outcome", "sum by (outcome) (rate(learner_trajectories_total[1m]))", "ops"),
    ("Learner", "Zero-variance groups", "sum(increase(learner_zero_variance_groups_total[5m]))", "none"),
    ("Engines", "Generated tokens/s", "sum by (role) (rate(engine_generated_tokens_total[1m]))", "ops"),
    ("Engines", "Request p95 (s)", "histogram_quantile(0.95, sum by (le, role) (rate(engine_request_seconds_bucket[5m])))", "s"),
    ("Engines", "Queue depth", "sum(engine_queue_depth)", "none"),
    ("Engines", "Failovers", "sum by (role) (increase(engine_server_failovers_total[5m]))", "none"),
    ("Simulator", "Synthetic steps/s", "rate(simulator_steps_total[1m])", "ops"),
    ("Simulator", "Parse failures by reason", "sum by (reason) (increase(simulator_parse_failures_total[5m]))", "none"),
    ("Simulator", "Retrieval p95 (s)", "histogram_quantile(0.95, sum by (le) (rate(simulator_retrieval_seconds_bucket[5m])))", "s"),
    ("Simulator", "Replay buffer size", "sum by (source) (simulator_buffer_size)", "none"),
    ("Curriculum", "Pool size", "sum by (origin) (curriculum_pool_size)", "none"),
    ("Curriculum", "Generated share", "curriculum_generated_share", "percentunit"),
    ("Curriculum", "Mean task variance", "curriculum_mean_task_variance", "none"),
    ("Curriculum", "Variants by outcome", "sum by (outcome) (increase(curriculum_variants_total[15m]))", "none"),
]


def dashboard() -> dict:
    panels, y, pid = [], 0, 1
    rows: dict[str, list] = {}
    for row, title, expr, unit in PANELS:
        rows.setdefault(row, []).append((title, expr, unit))
    for row, items in rows.items():
        panels.append({"type": "row", "title": row, "id": pid, "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "collapsed": False})
        pid, y = pid + 1, y + 1
        for i, (title, expr, unit) in enumerate(items):
            panels.append({
                "type": "timeseries", "title": title, "id": pid,
                "gridPos": {"x": (i % 3) * 8, "y": y + (i // 3) * 7, "w": 8, "h": 7},
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"expr": expr, "refId": "A", "legendFormat": "__auto"}],
            })
            pid += 1
        y += 7 * ((len(items) + 2) // 3)
    return {
        "uid": "dreamgym-overview", "title": "DreamGym", "schemaVersion": 39, "version": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "tags": ["dreamgym"], "panels": panels,
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "current": {}}]},
    }


def provisioning_files() -> dict[str, str]:
    """File name -> content for Grafana provisioning and a Prometheus scrape config."""
    return {
        "dreamgym.json": json.dumps(dashboard(), indent=2) + "\n",
        "grafana-datasource.yml": "apiVersion: 1\ndatasources:\n  - name: Prometheus\n    type: prometheus\n"
                                  "    access: proxy\n    url: http://localhost:9090\n    isDefault: true\n",
        "grafana-dashboards.yml": "apiVersion: 1\nproviders:\n  - name: dreamgym\n    type: file\n"
                                  "    options:\n      path: /etc/dreamgym/dashboards\n",
        "prometheus.yml": "# Scrape every DreamGym process that called infra.metrics.serve_metrics.\n"
                          "global:\n  scrape_interval: 5s\nscrape_configs:\n  - job_name: dreamgym\n"
                          "    static_configs:\n      - targets: ['127.0.0.1:9400']\n",
    }


def write(out: Path = OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in provisioning_files().items():
        (out / name).write_text(text)


def publish(url: str, token: str) -> dict:
    """Upload the dashboard to a running Grafana (overwriting the same uid)."""
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(url, credential=token)
    return api.dashboard.update_dashboard({"dashboard": dashboard(), "overwrite": True})


if __name__ == "__main__":
    write()
    print(f"wrote {', '.join(provisioning_files())} to {OUT}")
