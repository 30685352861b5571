"""Grafana dashboards, the Prometheus scrape config and `dreamgym dashboards`, as code.

Owns the monitoring view of a run: which dashboards exist (one per concern: throughput,
learner, rewards, curriculum, streams, engines, workers, fidelity), which panels each
holds and which PromQL each panel runs. `dreamgym dashboards write` (or `python -m
infra.dashboards`) regenerates `infra/dashboards/` (one JSON per dashboard, Grafana
provisioning files, and `prometheus.yml`, which discovers every process of every run
through the file_sd targets the driver writes, infra/targets.py); a test keeps the
committed files current and checks that every query names a declared metric, and
tests/test_prometheus.py runs every query against a real Prometheus scraping a run.

`dreamgym dashboards push --url URL --token T [--folder F]` creates or updates, with
grafana-client (`GrafanaApi`), the Prometheus datasource, the folder and every
dashboard through Grafana's HTTP API (/api/datasources, /api/folders,
/api/dashboards/db). It reads what Grafana holds first and writes only what differs,
so a second push changes nothing. For a Grafana provisioned from files instead, mount
the provisioning files.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

OUT = Path(__file__).with_name("dashboards")
DATASOURCE_NAME = "DreamGym Prometheus"
DATASOURCE_UID = "dreamgym-prometheus"
FOLDER_UID = "dreamgym"

# concern -> (dashboard title, [(panel title, PromQL, unit)])
DASHBOARDS: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "throughput": ("DreamGym: throughput", [
        ("Trajectories/s by outcome", "sum by (outcome) (rate(learner_trajectories_total[1m]))", "ops"),
        ("Generated tokens/s by role", "sum by (role) (rate(engine_generated_tokens_total[1m]))", "ops"),
        ("Updates/min", "sum(rate(learner_updates_total[2m])) * 60", "none"),
        ("Env steps/s by kind", "sum by (env_kind) (rate(rollout_steps_total[1m]))", "ops"),
        ("Episodes/s by status", "sum by (status) (rate(rollout_episodes_total[1m]))", "ops"),
    ]),
    "learner": ("DreamGym: learner", [
        ("Policy loss", "learner_loss", "none"),
        ("KL to reference", "learner_kl", "none"),
        ("Clip fraction", "learner_clip_fraction", "percentunit"),
        ("Mean staleness (versions)",
         "sum(learner_staleness_versions_sum) / clamp_min(sum(learner_staleness_versions_count), 1)", "none"),
        ("Non-finite updates", "sum(learner_nonfinite_updates_total)", "none"),
        ("Short updates by reason", "sum by (reason) (learner_short_updates_total)", "none"),
        ("Weight version", "learner_weight_version", "none"),
        ("Update p95 (s)", "histogram_quantile(0.95, sum by (le) (rate(learner_update_seconds_bucket[5m])))", "s"),
    ]),
    "rewards": ("DreamGym: rewards", [
        ("Mean reward by env kind", "learner_reward_mean", "none"),
        ("Reward variance by env kind", "learner_reward_variance", "none"),
        ("Zero-variance groups", "sum(learner_zero_variance_groups_total)", "none"),
    ]),
    "curriculum": ("DreamGym: curriculum", [
        ("Pool size by origin", "sum by (origin) (curriculum_pool_size)", "none"),
        ("Generated share", "curriculum_generated_share", "percentunit"),
        ("Mean task variance V_tau", "curriculum_mean_task_variance", "none"),
        ("Zero-variance fraction", "curriculum_zero_variance_fraction", "percentunit"),
        ("Tasks pushed/s by origin", "sum by (origin) (rate(curriculum_tasks_pushed_total[1m]))", "ops"),
    ]),
    "streams": ("DreamGym: streams", [
        ("Backlog (unread)", "sum by (stream) (stream_backlog)", "none"),
        ("Pending (unacked)", "sum by (stream) (stream_pending)", "none"),
        ("Dead letters by reason", "sum by (stream, reason) (stream_dead_letters_total)", "none"),
        ("Added/s", "sum by (stream) (rate(stream_messages_added_total[1m]))", "ops"),
        ("Reclaimed and redelivered", "sum by (stream) (stream_messages_reclaimed_total + "
                                      "stream_messages_redelivered_total)", "none"),
        ("Acked entries trimmed/s", "sum by (stream) (rate(stream_messages_trimmed_total[1m]))", "ops"),
    ]),
    "engines": ("DreamGym: engines", [
        ("Queue depth by engine", "sum by (instance_name) (engine_queue_depth)", "none"),
        ("Request p50 (s) by role", "histogram_quantile(0.5, sum by (le, role) (rate(engine_request_seconds_bucket[5m])))", "s"),
        ("Request p95 (s) by role", "histogram_quantile(0.95, sum by (le, role) (rate(engine_request_seconds_bucket[5m])))", "s"),
        ("Weight version by engine", "max by (instance_name) (engine_weight_version)", "none"),
        ("Batch size p95 by engine",
         "histogram_quantile(0.95, sum by (le, instance_name) (rate(engine_batch_size_bucket[5m])))", "none"),
        ("Failovers by role", "sum by (role) (engine_server_failovers_total)", "none"),
    ]),
    "workers": ("DreamGym: workers", [
        ("Workers in the pool", "max(rollout_pool_workers)", "none"),
        ("Pool target (num_workers, dreamgym scale, autoscale)", "max(rollout_pool_target_workers)", "none"),
        ("Pool resizes by cause", "sum by (cause) (rollout_pool_resizes_total)", "none"),
        ("Workers running, by process", "sum by (job, instance_name) (rollout_workers)", "none"),
        ("Scale events", "sum by (direction) (rollout_scale_events_total)", "none"),
        ("Backpressure: share of time waiting", "sum(rate(rollout_backpressure_wait_seconds_total[1m]))", "none"),
        ("Backpressure: task loops waiting", "sum(rollout_backpressure_waiting)", "none"),
        ("Scrape targets up by job", "sum by (job) (up)", "none"),
    ]),
    "fidelity": ("DreamGym: Mexp fidelity", [
        ("Reward accuracy (held-out real steps)", "simulator_fidelity_reward_accuracy", "percentunit"),
        ("ΔR (mean |r̂ - r|)", "simulator_fidelity_delta_r", "none"),
        ("ΔP estimate: item agreement", "simulator_fidelity_item_agreement", "percentunit"),
        ("ΔP estimate: item TV distance", "simulator_fidelity_item_tv_distance", "none"),
        ("Train minus held-out real success", "simulator_fidelity_success_gap", "percentunit"),
        ("Mexp rewards its own reasoning contradicts, /s", "rate(simulator_contradicted_rewards_total[5m])", "ops"),
        ("Mexp rewards its own reasoning affirms, /s", "rate(simulator_affirmed_rewards_total[5m])", "ops"),
        ("Mexp's listed actions the action check changed, /s", "sum by (change) (rate(simulator_checked_actions_total[5m]))", "ops"),
    ]),
}


# The overview a README or a run report shows first: (concern, panel title).
MAIN_PANELS: list[tuple[str, str]] = [
    ("throughput", "Trajectories/s by outcome"), ("throughput", "Generated tokens/s by role"),
    ("learner", "Policy loss"), ("rewards", "Mean reward by env kind"),
    ("engines", "Queue depth by engine"), ("engines", "Request p95 (s) by role"),
    ("streams", "Backlog (unread)"), ("workers", "Scrape targets up by job"),
    ("fidelity", "Reward accuracy (held-out real steps)"),
]


def panels() -> list[tuple[str, str, str, str]]:
    """Every panel as (concern, title, PromQL, unit)."""
    return [(concern, t, e, u) for concern, (_title, items) in DASHBOARDS.items() for t, e, u in items]


def dashboard(concern: str) -> dict:
    """The Grafana dashboard JSON of one concern (uid `dreamgym-<concern>`)."""
    title, items = DASHBOARDS[concern]
    out = []
    for i, (ptitle, expr, unit) in enumerate(items):
        out.append({
            "type": "timeseries", "title": ptitle, "id": i + 1,
            "gridPos": {"x": (i % 3) * 8, "y": (i // 3) * 8, "w": 8, "h": 8},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"expr": expr, "refId": "A", "legendFormat": "__auto"}],
        })
    return {
        "uid": f"dreamgym-{concern}", "title": title, "schemaVersion": 39, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "tags": ["dreamgym", concern], "panels": out,
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "current": {}},
        ]},
    }


def datasource(prometheus_url: str) -> dict:
    return {"name": DATASOURCE_NAME, "uid": DATASOURCE_UID, "type": "prometheus", "access": "proxy",
            "url": prometheus_url, "isDefault": False, "jsonData": {"timeInterval": "5s"}}


PROMETHEUS_YML = """\
# Scrape every DreamGym process of every run: the driver lists them (driver, embedded
# engines, Ray rollout-worker and buffer actors, Ray's node exporters) as they start and
# stop, in <run_dir>/monitoring/targets.json and its copy <runs>/_prometheus/<run>.json
# (file_sd allows a * in the last path component only). A relative path is read from this
# file's directory: ../../runs is the repository's runs/; use an absolute infra.run_dir elsewhere.
global:
  scrape_interval: 5s
scrape_configs:
  - job_name: dreamgym
    file_sd_configs:
      - files: ['../../runs/_prometheus/*.json']
        refresh_interval: 10s
"""


def provisioning_files() -> dict[str, str]:
    """File name -> content: one dashboard JSON per concern, Grafana provisioning, the scrape config."""
    files = {f"{concern}.json": json.dumps(dashboard(concern), indent=2, ensure_ascii=False) + "\n"
             for concern in DASHBOARDS}
    files["grafana-datasource.yml"] = (
        "apiVersion: 1\ndatasources:\n"
        f"  - name: {DATASOURCE_NAME}\n    uid: {DATASOURCE_UID}\n    type: prometheus\n"
        "    access: proxy\n    url: http://localhost:9090\n")
    files["grafana-dashboards.yml"] = ("apiVersion: 1\nproviders:\n  - name: dreamgym\n    folder: DreamGym\n"
                                       "    type: file\n    options:\n      path: /etc/dreamgym/dashboards\n")
    files["prometheus.yml"] = PROMETHEUS_YML
    return files


def write(out: Path = OUT) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    files = provisioning_files()
    for name, text in files.items():
        (out / name).write_text(text)
    for stale in out.glob("*.json"):  # a dashboard that no longer exists
        if stale.name not in files:
            stale.unlink()
    return sorted(files)


# ---- push to a live Grafana ----------------------------------------------------------
def _subset_equal(want: Any, have: Any) -> bool:
    """True when every key of `want` has the same value in `have` (recursively); Grafana adds its own keys."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_subset_equal(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(_subset_equal, want, have))
    return want == have


def push(api: Any, prometheus_url: str, folder: str = "DreamGym") -> dict[str, list[str]]:
    """Create or update the datasource, the folder and every dashboard through `api` (a GrafanaApi);
    writes only what differs from what Grafana holds. Returns {"created"|"updated"|"unchanged": [...]}."""
    from grafana_client.client import GrafanaClientError  # only a push talks to Grafana

    done: dict[str, list[str]] = {"created": [], "updated": [], "unchanged": []}

    def existing(get, *args) -> Any:
        try:
            return get(*args)
        except GrafanaClientError as exc:
            if exc.status_code == 404:
                return None
            raise

    ds = datasource(prometheus_url)
    have = existing(api.datasource.get_datasource_by_uid, DATASOURCE_UID)
    if have is None:
        api.datasource.create_datasource(ds)
        done["created"].append(f"datasource {DATASOURCE_UID}")
    elif not _subset_equal(ds, have):
        api.datasource.update_datasource_by_uid(DATASOURCE_UID, ds)
        done["updated"].append(f"datasource {DATASOURCE_UID}")
    else:
        done["unchanged"].append(f"datasource {DATASOURCE_UID}")

    have = existing(api.folder.get_folder, FOLDER_UID)
    if have is None:
        api.folder.create_folder(folder, uid=FOLDER_UID)
        done["created"].append(f"folder {FOLDER_UID}")
    elif have.get("title") != folder:
        api.folder.update_folder(FOLDER_UID, title=folder, overwrite=True)
        done["updated"].append(f"folder {FOLDER_UID}")
    else:
        done["unchanged"].append(f"folder {FOLDER_UID}")

    for concern in DASHBOARDS:
        want = dashboard(concern)
        # Panels point at the pushed datasource rather than a template variable a pushed dashboard lacks a value for.
        want["templating"]["list"][0]["current"] = {"text": DATASOURCE_NAME, "value": DATASOURCE_UID}
        have = existing(api.dashboard.get_dashboard, want["uid"])
        if have is not None and have.get("meta", {}).get("folderUid") == FOLDER_UID \
                and _subset_equal(want, have.get("dashboard", {})):
            done["unchanged"].append(f"dashboard {want['uid']}")
            continue
        api.dashboard.update_dashboard({"dashboard": want, "folderUid": FOLDER_UID, "overwrite": True,
                                        "message": "dreamgym dashboards push"})
        done["updated" if have is not None else "created"].append(f"dashboard {want['uid']}")
    return done


def publish(url: str, token: str, folder: str = "DreamGym", prometheus_url: str = "http://localhost:9090") -> dict:
    """`push` to the Grafana at `url` with a service-account `token`."""
    return push(grafana_api(url, token), prometheus_url, folder)


def grafana_api(url: str, token: str) -> Any:
    from grafana_client import GrafanaApi  # only a push talks to Grafana

    return GrafanaApi.from_url(url, credential=token or None)


# ---- `dreamgym dashboards` -------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("write", "push"),
                   help="write: regenerate the dashboard JSON and provisioning files; "
                        "push: create or update the datasource, folder and dashboards in a running Grafana")
    p.add_argument("--out", default=str(OUT), help="write: the directory (default: %(default)s)")
    p.add_argument("--url", default="", help="push: Grafana base URL, e.g. http://grafana:3000")
    p.add_argument("--token", default="", help="push: a service-account token (or put user:password in --url)")
    p.add_argument("--folder", default="DreamGym", help="push: Grafana folder title (default: %(default)s)")
    p.add_argument("--prometheus-url", default="http://localhost:9090",
                   help="push: the Prometheus URL Grafana should query (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    if args.action == "push" and not args.url:
        print("dreamgym dashboards push: --url is required")
        return 2
    if args.action == "write":
        names = write(Path(args.out))
        print(f"wrote {', '.join(names)} to {args.out}")
        return 0
    done = push(grafana_api(args.url, args.token), args.prometheus_url, args.folder)
    for what, items in done.items():
        print(f"{what}: {', '.join(items) if items else '-'}")
    return 0


if __name__ == "__main__":
    print(f"wrote {', '.join(write())} to {OUT}")
