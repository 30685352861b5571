"""Every metric DreamGym exports, declared once.

Names are namespaced by the component that owns them (`rollout_`, `learner_`,
`stream_`, `simulator_`, `engine_`, `curriculum_`, `env_`), use base units
(`_seconds`, `_bytes`) and `_total` for counters, and never carry a task id or any
other unbounded value as a label. Grafana dashboards in infra/dashboards/ query these names.

Registries: every process exports its own. The module-level metrics below live in
the process's default registry (the driver with its learner and curriculum, each Ray
rollout-worker, buffer and scheduler actor), served by `serve_metrics(port, host)`.
An embedded engine's server-side metrics are an `EngineServerMetrics` with a registry
of its own, served on the engine's own `/metrics`: two engines in one driver process
never export each other's queue, and the driver's `/metrics` carries neither.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# --- streams (infra/streams.py) ---
STREAM_MESSAGES_ADDED = Counter("stream_messages_added_total", "Messages appended with XADD.", ["stream"])
STREAM_MESSAGES_READ = Counter("stream_messages_read_total", "Messages delivered by XREADGROUP.", ["stream"])
STREAM_MESSAGES_ACKED = Counter("stream_messages_acked_total", "Messages acknowledged with XACK.", ["stream"])
STREAM_MESSAGES_RECLAIMED = Counter("stream_messages_reclaimed_total", "Pending messages reclaimed from idle consumers (XAUTOCLAIM).", ["stream"])
STREAM_MESSAGES_REDELIVERED = Counter("stream_messages_redelivered_total", "Deliveries of a message delivered before (reclaimed, nacked or re-read after a restart).", ["stream"])
STREAM_MESSAGES_NACKED = Counter("stream_messages_nacked_total", "Deliveries whose handler reported a failure (StreamConsumer.nack).", ["stream"])
STREAM_DEAD_LETTERS = Counter("stream_dead_letters_total", "Messages moved to the dead-letter stream.", ["stream", "reason"])
STREAM_RECONNECTS = Counter("stream_reconnects_total", "Redis operations retried after a connection error.")
STREAM_BYTES_ADDED = Counter("stream_bytes_added_total", "Payload bytes appended.", ["stream"])
STREAM_MESSAGES_TRIMMED = Counter("stream_messages_trimmed_total", "Entries every consumer group had acked, removed with XTRIM MINID (infra.streams.trim_acked).", ["stream"])
STREAM_BACKLOG = Gauge("stream_backlog", "Entries a stream's consumer group has not read yet (sampled by the driver).", ["stream"])
STREAM_PENDING = Gauge("stream_pending", "Entries delivered to a consumer but not acknowledged (sampled by the driver).", ["stream"])

# --- rollout workers (actors/) ---
ROLLOUT_EPISODES = Counter("rollout_episodes_total", "Episodes finished.", ["env_kind", "status"])
ROLLOUT_STEPS = Counter("rollout_steps_total", "Environment steps taken.", ["env_kind"])
ROLLOUT_INVALID_ACTIONS = Counter("rollout_invalid_actions_total", "Actions the environment rejected as invalid.", ["env_kind"])
POLICY_INVALID_REPLIES = Counter("policy_invalid_replies_total", "Generate-mode replies that named no legal action, by reason: 'truncated' (cut off at actors.max_reply_tokens), 'no_action' (no <action>...</action>), 'not_admissible' (not a candidate); the environment was not stepped.", ["reason"])
ROLLOUT_EPISODE_SECONDS = Histogram("rollout_episode_seconds", "Wall time of one episode.", ["env_kind"], buckets=_LATENCY)
ROLLOUT_WORKERS = Gauge("rollout_workers", "Rollout workers running their loop in this process.")
ROLLOUT_POOL_WORKERS = Gauge("rollout_pool_workers", "Rollout workers the elastic pool runs (set by the driver, local or Ray).")
ROLLOUT_INFLIGHT_EPISODES = Gauge("rollout_inflight_episodes", "Episodes in progress in this process.")
ROLLOUT_SCALE_EVENTS = Counter("rollout_scale_events_total", "Rollout workers started or stopped by the elastic pool.", ["direction"])
ROLLOUT_POOL_TARGET = Gauge("rollout_pool_target_workers", "Rollout workers the elastic pool is asked to run: actors.num_workers, then `dreamgym scale` or actors.autoscale (set by the driver).")
ROLLOUT_POOL_RESIZES = Counter("rollout_pool_resizes_total", "Changes of the pool's target, by cause: 'command' (`dreamgym scale`) or 'autoscale' (actors.autoscale).", ["cause"])
ROLLOUT_BACKPRESSURE_SECONDS = Counter("rollout_backpressure_wait_seconds_total", "Seconds rollout workers waited before taking a task because the trajectories not yet delivered to the learner exceeded actors.max_trajectory_backlog.")
ROLLOUT_BACKPRESSURE_WAITING = Gauge("rollout_backpressure_waiting", "Rollout task loops in this process waiting on the trajectory backlog now.")

# --- environments (actors/envs/) ---
ENV_RESETS = Counter("env_resets_total", "Real environment resets.", ["family"])
ENV_ERRORS = Counter("env_errors_total", "Real environment crashes caught.", ["family"])

# --- engines (infra/engine/) ---
ENGINE_REQUESTS = Counter("engine_requests_total", "Generation requests served.", ["role", "outcome"])
ENGINE_REQUEST_SECONDS = Histogram("engine_request_seconds", "Latency of one generation request.", ["role"], buckets=_LATENCY)
ENGINE_GENERATED_TOKENS = Counter("engine_generated_tokens_total", "Tokens generated.", ["role"])
ENGINE_SERVER_FAILOVERS = Counter("engine_server_failovers_total", "Requests moved to another server after a failure.", ["role"])
ENGINE_RETRY_AFTER_WAITS = Counter("engine_retry_after_waits_total", "Client waits on a 429/503 Retry-After before retrying.", ["role"])


class EngineServerMetrics:
    """One embedded engine's server-side metrics, in a registry of its own (served on the engine's /metrics)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.queue_depth = Gauge("engine_queue_depth", "Requests waiting or decoding in the embedded engine.", registry=r)
        self.batch_size = Histogram("engine_batch_size", "Sequences decoded together per step.", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.weight_version = Gauge("engine_weight_version", "Weight version the engine serves.", registry=r)
        self.prompt_tokens = Counter("engine_prompt_tokens_total", "Prompt tokens the embedded engine admitted.", registry=r)
        self.prefix_cached_tokens = Counter("engine_prefix_cached_tokens_total", "Prompt tokens whose KV came from the prefix cache (not prefilled).", registry=r)
        self.score_cached_tokens = Counter("engine_score_cached_tokens_total", "Scoring-request prompt tokens whose KV came from the CPU scorer's prompt cache (engines.score_cache_mb), not run.", registry=r)
        self.prefix_cache_bytes = Gauge("engine_prefix_cache_bytes", "Bytes of KV held by the embedded engine's prefix cache.", registry=r)
        self.rejected = Counter("engine_rejected_requests_total", "Requests the embedded engine refused before queueing them.", ["reason"], registry=r)
        self.server_seconds = Histogram("engine_server_request_seconds", "Time from admission to reply inside the embedded engine.", buckets=_LATENCY, registry=r)
        self.server_tokens = Counter("engine_server_generated_tokens_total", "Tokens the embedded engine generated.", registry=r)
        self.draft_tokens = Counter("engine_speculative_draft_tokens_total", "Prompt-lookup draft tokens the embedded engine verified (engines.speculative_tokens).", registry=r)
        self.accepted_tokens = Counter("engine_speculative_accepted_tokens_total", "Draft tokens the model's greedy choice agreed with (each saves a decode step).", registry=r)
        self.graph_steps = Counter("engine_decode_graph_steps_total", "Decode steps the embedded engine replayed as CUDA graphs (engines.cuda_graphs).", registry=r)
        self.graph_captures = Counter("engine_decode_graph_captures_total", "CUDA graphs of the decode step captured (one per batch bucket, again after the KV buffer grows or the weights change).", registry=r)
        for reason in ("unauthorized", "invalid", "queue_full", "body_too_large", "weights_path"):
            self.rejected.labels(reason=reason)


# --- simulator (simulator/) ---
SIMULATOR_FIDELITY_REWARD_ACCURACY = Gauge("simulator_fidelity_reward_accuracy", "Live probe: share of held-out real steps whose reward Mexp predicts (|r̂ - r| < 0.5).")
SIMULATOR_FIDELITY_DELTA_R = Gauge("simulator_fidelity_delta_r", "Live probe: mean absolute reward error ΔR on held-out real steps.")
SIMULATOR_FIDELITY_ITEM_AGREEMENT = Gauge("simulator_fidelity_item_agreement", "Live probe (ΔP estimate): share of the real next state's items that Mexp predicts.")
SIMULATOR_FIDELITY_ITEM_TV = Gauge("simulator_fidelity_item_tv_distance", "Live probe (ΔP estimate): total-variation distance between predicted and real next-state item distributions.")
SIMULATOR_FIDELITY_SUCCESS_GAP = Gauge("simulator_fidelity_success_gap", "Success rate of the last update's trajectories (synthetic in DreamGym) minus held-out real success; set when a real evaluation runs.")
SIMULATOR_FIDELITY_PROBES = Counter("simulator_fidelity_probes_total", "Live fidelity probes run.")
SIMULATOR_FIDELITY_WEIGHT_VERSION = Gauge("simulator_fidelity_weight_version", "Learner weight version at the last live fidelity probe.")
SIMULATOR_STEPS = Counter("simulator_steps_total", "Synthetic transitions produced by Mexp.")
SIMULATOR_PARSE_FAILURES = Counter("simulator_parse_failures_total", "Mexp outputs that did not parse.", ["reason"])
SIMULATOR_CONTRADICTED_REWARDS = Counter("simulator_contradicted_rewards_total", "Mexp rewards set to 0 because the reply's own reasoning did not check off every item of the state's To do line (simulator.reward_check).")
SIMULATOR_AFFIRMED_REWARDS = Counter("simulator_affirmed_rewards_total", "Mexp rewards of 0 set to 1 (the episode ended) because the reply's own reasoning checked off every item of the state's To do line (simulator.reward_affirm).")
SIMULATOR_REPLAYED_STEPS = Counter("simulator_replayed_steps_total", "Synthetic steps answered with a real transition of the same task, state and action from the buffer instead of Mexp (simulator.replay_real).")
SIMULATOR_MEMO_HITS = Counter("simulator_memo_hits_total", "Greedy Mexp requests answered with the reply of an identical earlier (or in-flight) request instead of generating it again (simulator.reply_memo).")
SIMULATOR_CHECKED_ACTIONS = Counter("simulator_checked_actions_total", "Actions simulator.action_check changed in Mexp's next states: 'dropped' (listed, and ruled out by the state's own description) or 'added' (implied by the description, and not listed).", ["change"])
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
LEARNER_SHORT_UPDATES = Counter("learner_short_updates_total", "Updates trained on fewer units than learner.groups_per_update: `group_cap` once learner.max_groups_per_update groups had come in since the last update, `final` once no more would come (a spent real-transition budget).", ["reason"])
LEARNER_ZERO_VARIANCE_GROUPS = Counter("learner_zero_variance_groups_total", "GRPO groups skipped because all rewards were equal.")
LEARNER_UPDATE_SECONDS = Histogram("learner_update_seconds", "Wall time of one gradient update.", buckets=_LATENCY)
LEARNER_NONFINITE_UPDATES = Counter("learner_nonfinite_updates_total", "Updates undone because the loss, a gradient or the new weights were not finite (weights restored, nothing published).", ["where"])
LEARNER_UPDATE_ERRORS = Counter("learner_update_errors_total", "Updates undone because they raised (weights restored, the batch retried once, then dead-lettered).")
LEARNER_MEAN_REWARD = Gauge("learner_mean_reward", "Mean episode reward in the last batch.")
LEARNER_REWARD_MEAN = Gauge("learner_reward_mean", "Mean episode reward in the last batch, by environment kind.", ["env_kind"])
LEARNER_REWARD_VARIANCE = Gauge("learner_reward_variance", "Variance of episode rewards in the last batch, by environment kind.", ["env_kind"])
LEARNER_TOKENS = Counter("learner_tokens_total", "Tokens run through the policy in trained forward/backward passes (packed multi-turn trajectories count each token once).")

# --- curriculum (simulator/curriculum.py) ---
CURRICULUM_POOL_SIZE = Gauge("curriculum_pool_size", "Tasks in the pool.", ["origin"])
CURRICULUM_GENERATED_SHARE = Gauge("curriculum_generated_share", "Share of generated tasks in the last batch.")
CURRICULUM_MEAN_TASK_VARIANCE = Gauge("curriculum_mean_task_variance", "Mean V_tau over tasks with statistics.")
CURRICULUM_ZERO_VARIANCE_FRACTION = Gauge("curriculum_zero_variance_fraction", "Fraction of recent groups with zero reward variance.")
CURRICULUM_VARIANTS = Counter("curriculum_variants_total", "Task variants written by Mtask, by outcome.", ["outcome"])
CURRICULUM_TASKS_PUSHED = Counter("curriculum_tasks_pushed_total", "Tasks pushed to the task stream.", ["origin"])


# Counters with a bounded label set start at 0, so a rate or increase over them has a series
# (and a dashboard panel data) before the first event.
for _direction in ("up", "down"):
    ROLLOUT_SCALE_EVENTS.labels(direction=_direction)
for _cause in ("command", "autoscale"):
    ROLLOUT_POOL_RESIZES.labels(cause=_cause)
for _where in ("loss", "gradient", "weights"):
    LEARNER_NONFINITE_UPDATES.labels(where=_where)
for _change in ("dropped", "added"):
    SIMULATOR_CHECKED_ACTIONS.labels(change=_change)
for _reason in ("group_cap", "final"):
    LEARNER_SHORT_UPDATES.labels(reason=_reason)


def counted(counter: Counter) -> float:
    """A counter's total in this process, over all its labels."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def mexp_steps() -> dict[str, float]:
    """This process's synthetic steps so far: answered by Mexp ("simulated"), or replayed from a real
    transition (simulator.replay_real); and the Mexp requests (steps and their retries) that the reply memo
    answered without the engine (simulator.reply_memo)."""
    return {"simulated": counted(SIMULATOR_STEPS), "replayed": counted(SIMULATOR_REPLAYED_STEPS),
            "memo_hits": counted(SIMULATOR_MEMO_HITS)}


class MetricsServer:
    """A running /metrics endpoint of this process: `.port`, `.close()`."""

    def __init__(self, server, thread) -> None:
        self.server, self.thread, self.port = server, thread, server.server_port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(port: int, addr: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY) -> MetricsServer:
    """Expose `registry` (this process's) as /metrics on `addr:port` (0 picks a free port)."""
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server, thread)

# --- real environments out of process (actors/envs/env_process.py) ---
ENV_PROCESS_FAILURES = Counter("env_process_failures_total", "Real environment child processes lost during a call "
                               "(reason: env_crash, env_timeout); each is replaced at the next reset.",
                               ["family", "reason"])
ENV_TASKS_REFUSED = Counter("env_tasks_refused_total", "Resets refused without a child: the task crashed or hung its "
                            "environment actors.env_max_crashes times.", ["family"])
STREAM_HANDLER_TIMEOUTS = Counter("stream_handler_timeouts_total", "Stream entries nacked because their handler held "
                                  "them past infra.handler_timeout_s without ack or nack (infra/streams.py).", ["stream"])
