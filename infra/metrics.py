"""Every metric DreamGym exports, declared once.

Names are namespaced by the component that owns them (`rollout_`, `learner_`,
`stream_`, `simulator_`, `engine_`, `curriculum_`, `env_`), use base units
(`_seconds`, `_bytes`) and `_total` for counters, and never carry a task id or any
other unbounded value as a label. `serve_metrics(port)` exposes `/metrics` from any
process; Grafana dashboards in infra/dashboards/ query these names.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

_LATENCY = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# --- streams (infra/streams.py) ---
STREAM_MESSAGES_ADDED = Counter("stream_messages_added_total", "Messages appended with XADD.", ["stream"])
STREAM_MESSAGES_READ = Counter("stream_messages_read_total", "Messages delivered by XREADGROUP.", ["stream"])
STREAM_MESSAGES_ACKED = Counter("stream_messages_acked_total", "Messages acknowledged with XACK.", ["stream"])
STREAM_MESSAGES_RECLAIMED = Counter("stream_messages_reclaimed_total", "Pending messages reclaimed from idle consumers (XAUTOCLAIM).", ["stream"])
STREAM_DEAD_LETTERS = Counter("stream_dead_letters_total", "Messages moved to the dead-letter stream.", ["stream", "reason"])
STREAM_RECONNECTS = Counter("stream_reconnects_total", "Redis operations retried after a connection error.")
STREAM_BYTES_ADDED = Counter("stream_bytes_added_total", "Payload bytes appended.", ["stream"])

# --- rollout workers (actors/) ---
ROLLOUT_EPISODES = Counter("rollout_episodes_total", "Episodes finished.", ["env_kind", "status"])
ROLLOUT_STEPS = Counter("rollout_steps_total", "Environment steps taken.", ["env_kind"])
ROLLOUT_INVALID_ACTIONS = Counter("rollout_invalid_actions_total", "Actions the environment rejected as invalid.", ["env_kind"])
ROLLOUT_EPISODE_SECONDS = Histogram("rollout_episode_seconds", "Wall time of one episode.", ["env_kind"], buckets=_LATENCY)
ROLLOUT_WORKERS = Gauge("rollout_workers", "Rollout workers alive.")
ROLLOUT_INFLIGHT_EPISODES = Gauge("rollout_inflight_episodes", "Episodes in progress in this process.")

# --- environments (actors/envs/) ---
ENV_RESETS = Counter("env_resets_total", "Real environment resets.", ["family"])
ENV_ERRORS = Counter("env_errors_total", "Real environment crashes caught.", ["family"])

# --- engines (infra/engine_*.py) ---
ENGINE_REQUESTS = Counter("engine_requests_total", "Generation requests served.", ["role", "outcome"])
ENGINE_REQUEST_SECONDS = Histogram("engine_request_seconds", "Latency of one generation request.", ["role"], buckets=_LATENCY)
ENGINE_GENERATED_TOKENS = Counter("engine_generated_tokens_total", "Tokens generated.", ["role"])
ENGINE_QUEUE_DEPTH = Gauge("engine_queue_depth", "Requests waiting or decoding in the embedded engine.")
ENGINE_BATCH_SIZE = Histogram("engine_batch_size", "Sequences decoded together per step.", buckets=(1, 2, 4, 8, 16, 32, 64))
ENGINE_WEIGHT_VERSION = Gauge("engine_weight_version", "Weight version the engine serves.", ["role"])
ENGINE_SERVER_FAILOVERS = Counter("engine_server_failovers_total", "Requests moved to another server after a failure.", ["role"])

# --- simulator (simulator/) ---
SIMULATOR_STEPS = Counter("simulator_steps_total", "Synthetic transitions produced by Mexp.")
SIMULATOR_PARSE_FAILURES = Counter("simulator_parse_failures_total", "Mexp outputs that did not parse.", ["reason"])
SIMULATOR_REJECTED_STEPS = Counter("simulator_rejected_steps_total", "Steps rejected after the retry budget.")
SIMULATOR_RETRIEVAL_SECONDS = Histogram("simulator_retrieval_seconds", "Replay-buffer top-k query latency.", buckets=_LATENCY)
SIMULATOR_BUFFER_SIZE = Gauge("simulator_buffer_size", "Transitions in the replay buffer.", ["source"])

# --- learner (learner/) ---
LEARNER_UPDATES = Counter("learner_updates_total", "Gradient updates applied.")
LEARNER_TRAJECTORIES = Counter("learner_trajectories_total", "Trajectories consumed.", ["outcome"])
LEARNER_LOSS = Gauge("learner_loss", "Last policy loss.")
LEARNER_KL = Gauge("learner_kl", "Last mean KL to the reference policy.")
LEARNER_CLIP_FRACTION = Gauge("learner_clip_fraction", "Share of ratios clipped in the last update.")
LEARNER_STALENESS = Histogram("learner_staleness_versions", "Weight versions between a trajectory's policy and the learner.", buckets=(0, 1, 2, 3, 4, 8, 16))
LEARNER_WEIGHT_VERSION = Gauge("learner_weight_version", "Weight version the learner has published.")
LEARNER_ZERO_VARIANCE_GROUPS = Counter("learner_zero_variance_groups_total", "GRPO groups skipped because all rewards were equal.")
LEARNER_UPDATE_SECONDS = Histogram("learner_update_seconds", "Wall time of one gradient update.", buckets=_LATENCY)
LEARNER_MEAN_REWARD = Gauge("learner_mean_reward", "Mean episode reward in the last batch.")

# --- curriculum (simulator/curriculum.py) ---
CURRICULUM_POOL_SIZE = Gauge("curriculum_pool_size", "Tasks in the pool.", ["origin"])
CURRICULUM_GENERATED_SHARE = Gauge("curriculum_generated_share", "Share of generated tasks in the last batch.")
CURRICULUM_MEAN_TASK_VARIANCE = Gauge("curriculum_mean_task_variance", "Mean V_tau over tasks with statistics.")
CURRICULUM_ZERO_VARIANCE_FRACTION = Gauge("curriculum_zero_variance_fraction", "Fraction of recent groups with zero reward variance.")
CURRICULUM_VARIANTS = Counter("curriculum_variants_total", "Task variants written by Mtask, by outcome.", ["outcome"])
CURRICULUM_TASKS_PUSHED = Counter("curriculum_tasks_pushed_total", "Tasks pushed to the task stream.", ["origin"])


def serve_metrics(port: int, addr: str = "127.0.0.1") -> int:
    """Expose /metrics on `port` (0 picks a free one); returns the port."""
    server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
    return server.server_port
