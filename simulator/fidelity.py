"""`dreamgym fidelity`: how faithfully Mexp reproduces held-out real transitions.

Owns the simulator's fidelity measurement. Held-out REAL trajectories (the same
task-level split as `dreamgym train-mexp`, simulator/mexp_data.py) are replayed step
by step with the real actions teacher-forced: at each step Mexp sees the real
history, the real state and the real action (and the top-k neighbours from a buffer
of the TRAIN trajectories), and its prediction is compared with what the real
environment did:

- reward accuracy (|r̂ - r| < 0.5) and ΔR, the mean and max absolute reward error; since
  outcome rewards are rare, also the reward's recall (rewarded real steps Mexp rewards), its
  precision (Mexp's rewards that are real) and the accuracy of always answering 0;
- done accuracy;
- next-state agreement: item recall (share of the real state's actionable items that
  the predicted state lists) and token F1 (bag of words over the whole state);
- a ΔP estimate: item agreement (the recall above) and the total-variation distance
  between the predicted and the real next state's items, each read as a uniform
  distribution over its item set (0 = the same items, 1 = disjoint);
- parse-failure rate: share of steps whose reply was rejected (no retries by default,
  so this is the per-sample rate). Rejected steps count as wrong in the accuracies,
  as 0 in the agreement scores and as 1 in the TV distance; ΔR is over parsed steps only.

`--split train` replays the training trajectories instead, the steps the Mexp was
fine-tuned on (each episode still retrieves only other episodes' transitions): high
there and low held out is a Mexp that memorised its tasks rather than learned the
rule (ALFWorld's, collection 57 of docs/experiments.md).

Each checkpoint is measured in three settings: full, without retrieval and without
reasoning (the paper's ablations, Table 3). With `--judge-url`, an LLM judge scores
consistency, informativeness and hallucination 1-5 (paper Fig. 4). Decoding is
greedy by default so settings differ only in what they change.

`FidelityProbe` is the same measurement live: `dreamgym train` with
`simulator.fidelity_every` replays a fixed, even spread of held-out real steps through
the served Mexp every N learner updates, in the background, and exports the summary as
gauges (`simulator_fidelity_*`, infra/metrics.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import re
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from actors.envs.base import StateFormatError, validate_state
from actors.envs.registry import add_family_argument, family_of
from infra import metrics
from infra.config import EngineConfig, SimulatorConfig, UsageError, add_config_arguments, config_from_args
from infra.engine.client import EngineClient
from infra.engine.models import load_tokenizer
from infra.engine.server import start_embedded_engine
from simulator.embedder import Embedder
from simulator.experience_model import ExperienceModel, MexpRejected
from simulator.mexp_data import MexpExample, build_examples, load_offline, split_trajectories
from simulator.replay_buffer import EdgeBuffer, seed_buffer

log = logging.getLogger(__name__)

VARIANTS = {"full": {}, "no-retrieval": {"retrieval": False}, "no-reasoning": {"reasoning": False},
            "no-reward-check": {"reward_check": False}}
_WORD = re.compile(r"\w+")


# ---------------------------------------------------------------- pure metrics
def _items(state: str) -> set[str] | None:
    try:
        return {t.strip().lower() for _, t in validate_state(state).items}
    except StateFormatError:
        return None


def item_recall(pred: str, real: str) -> float:
    """Share of the real state's item texts that appear among the predicted state's items."""
    real_items, pred_items = _items(real), _items(pred)
    if real_items is None or pred_items is None:
        return 0.0
    return len(real_items & pred_items) / len(real_items) if real_items else 1.0


def item_tv_distance(pred: str, real: str) -> float:
    """Total-variation distance between the uniform distributions over the two states' item sets.

    For uniform p on A and q on B, TV = 1 - |A ∩ B| / max(|A|, |B|): 0 for the same items, 1 for
    disjoint ones (or a state that does not parse). Two states with no items are identical (0)."""
    a, b = _items(pred), _items(real)
    if a is None or b is None:
        return 1.0
    if not a and not b:
        return 0.0
    return 1.0 - len(a & b) / max(len(a), len(b))


def token_f1(pred: str, real: str) -> float:
    p, r = Counter(_WORD.findall(pred.lower())), Counter(_WORD.findall(real.lower()))
    common = sum((p & r).values())
    if not p or not r or not common:
        return float(not p and not r)
    precision, recall = common / sum(p.values()), common / sum(r.values())
    return 2 * precision * recall / (precision + recall)


def summarize(records: list[dict]) -> dict[str, float]:
    """Aggregate per-step records ({parsed, reward, true_reward, done, true_done, item_recall, token_f1})."""
    n = len(records)
    if not n:
        return {"steps": 0}
    parsed = [r for r in records if r["parsed"]]
    errs = [abs(r["reward"] - r["true_reward"]) for r in parsed]
    # Outcome rewards are rare, so accuracy flatters a Mexp that never rewards: say how it does on
    # the rewarded steps (recall), how often its rewards are real (precision), and what always
    # answering 0 would score. A rejected step rewards nothing.
    real = [r for r in records if r["true_reward"] >= 0.5]
    said = [r for r in parsed if r["reward"] >= 0.5]
    hits = sum(1 for r in said if r["true_reward"] >= 0.5)
    unrewarded = n - len(real)
    return {
        "steps": n,
        "parse_failure_rate": 1 - len(parsed) / n,
        "reward_accuracy": sum(1 for r in parsed if abs(r["reward"] - r["true_reward"]) < 0.5) / n,
        "reward_recall": hits / len(real) if real else float("nan"),
        "reward_precision": hits / len(said) if said else float("nan"),
        # Mexp's rewards on unrewarded real steps, per such step: unlike precision, it does not move with
        # the sample's share of rewarded steps (even_spread raises that share to at least a quarter).
        "reward_false_positive_rate": (len(said) - hits) / unrewarded if unrewarded else float("nan"),
        "reward_accuracy_all_zero": 1 - len(real) / n,
        "delta_r_mean": sum(errs) / len(errs) if errs else float("nan"),
        "delta_r_max": max(errs) if errs else float("nan"),
        "done_accuracy": sum(1 for r in parsed if r["done"] == r["true_done"]) / n,
        "rewards_contradicted": sum(1 for r in parsed if r.get("contradicted")),  # set to 0 by the reward check
        "rewards_affirmed": sum(1 for r in parsed if r.get("affirmed")),  # set to 1 by simulator.reward_affirm
        "item_recall": sum(r["item_recall"] for r in records) / n,
        "item_tv": sum(r.get("item_tv", 1.0) for r in records) / n,
        "token_f1": sum(r["token_f1"] for r in records) / n,
    }


# ---------------------------------------------------------------- replay
async def replay(mexp: Any, examples: list[MexpExample], concurrency: int = 16,
                 progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Teacher-forced replay of `examples` through `mexp` (an ExperienceModel); one record per step.
    `progress(done, total)` is called as each step's reply comes back."""
    sem, done = asyncio.Semaphore(concurrency), 0

    async def answer(ex: MexpExample) -> dict:
        rec = {"task_id": ex.task.task_id, "action": ex.action, "true_reward": ex.truth.reward,
               "true_done": ex.truth.done, "true_state": ex.truth.next_state}
        async with sem:
            try:
                out = await mexp.step(ex.task, ex.history, ex.state, ex.action, ex.episode_id)
            except MexpRejected as exc:
                return {**rec, "parsed": False, "reason": exc.reasons[-1], "reward": 0.0, "done": False,
                        "state": "", "item_recall": 0.0, "item_tv": 1.0, "token_f1": 0.0}
        return {**rec, "parsed": True, "reward": out.reward, "done": out.done, "state": out.next_state,
                "reasoning": out.reasoning, "contradicted": out.contradicted, "affirmed": out.affirmed,
                "item_recall": item_recall(out.next_state, ex.truth.next_state),
                "item_tv": item_tv_distance(out.next_state, ex.truth.next_state),
                "token_f1": token_f1(out.next_state, ex.truth.next_state)}

    async def one(ex: MexpExample) -> dict:
        nonlocal done
        rec = await answer(ex)
        done += 1
        if progress is not None:
            progress(done, len(examples))
        return rec

    return list(await asyncio.gather(*(one(ex) for ex in examples)))


def log_tenths(what: str) -> Callable[[int, int], None]:
    """A `replay` progress callback that logs a line at each tenth of the steps: a CPU replay of long
    replies takes minutes (ALFWorld's 206 held-out steps 25 on 2 cores)."""
    t0 = time.monotonic()

    def report(done: int, total: int) -> None:
        if done * 10 // total > (done - 1) * 10 // total:
            log.info("%s: %d/%d steps replayed (%.0f s)", what, done, total, time.monotonic() - t0)
    return report


JUDGE_PROMPT = ("You grade a simulated text-environment transition against the real one. Score 1-5 each: "
                "consistency (the predicted next state follows from the state and action), informativeness "
                "(it gives the details an agent needs), hallucination (5 = nothing invented). Reply as "
                "consistency=N informativeness=N hallucination=N.\n\nState:\n{state}\nAction: {action}\n"
                "Real next state:\n{real}\nPredicted next state:\n{pred}\n")


JUDGE_KEYS = ("consistency", "informativeness", "hallucination")


def judge_scores(reply: str) -> dict[str, int]:
    """The 1-5 scores a judge reply gives, by key; keys it does not score (or scores out of range) are absent."""
    out: dict[str, int] = {}
    for key in JUDGE_KEYS:
        m = re.search(rf"\b{key}\s*[=:]\s*([0-9]+)\b", reply, re.I)
        if m and 1 <= int(m.group(1)) <= 5:
            out[key] = int(m.group(1))
    return out


async def judge(client: Any, examples: list[MexpExample], records: list[dict], concurrency: int = 8) -> dict[str, float]:
    """Mean LLM-judge scores over the parsed steps (a key a reply does not score is skipped for that step)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(ex: MexpExample, rec: dict) -> dict[str, int]:
        async with gate:
            res = await client.generate(JUDGE_PROMPT.format(state=ex.state, action=ex.action,
                                                            real=ex.truth.next_state, pred=rec["state"]),
                                        sampling_params={"max_new_tokens": 40, "temperature": 0.0})
        return judge_scores(res.text)

    replies = await asyncio.gather(*(one(ex, rec) for ex, rec in zip(examples, records) if rec["parsed"]))
    means = {}
    for key in JUDGE_KEYS:
        got = [r[key] for r in replies if key in r]
        means[f"judge_{key}"] = sum(got) / len(got) if got else float("nan")
    means["judge_replies_scored"] = sum(1 for r in replies if len(r) == len(JUDGE_KEYS))
    return means


def _spread(examples: list, k: int) -> list:
    """At most `k` of `examples`, evenly spread."""
    return examples[::max(1, len(examples) // k)][:k] if k > 0 else []


def even_spread(examples: list, max_steps: int, min_rewarded: float = 0.25) -> list:
    """At most `max_steps` of `examples` (all of them for 0), evenly spread over the rewarded real
    steps and, apart, over the unrewarded ones, in their own order.

    Outcome rewards come once an episode, so a plain stride over long episodes can miss every rewarded
    step: textworld_long's 24-step check on a lent H200 held none, and its reward accuracy said
    nothing about reward (docs/gpu_runs.md, 2026-12-04). The rewarded steps keep their share of
    the held-out steps, but at least `min_rewarded` of the picks while there are enough of them, so
    the recall and precision rest on some rewarded steps; the summary's always-0 accuracy is the
    sample's, so a Mexp that never rewards still scores what it would here."""
    if not max_steps or len(examples) <= max_steps:
        return examples
    rewarded = [ex for ex in examples if ex.truth.reward >= 0.5]
    rest = [ex for ex in examples if ex.truth.reward < 0.5]
    k = min(len(rewarded), max(round(max_steps * len(rewarded) / len(examples)),
                               math.ceil(max_steps * min_rewarded)))
    picked = {id(ex) for ex in _spread(rewarded, k) + _spread(rest, max_steps - k)}
    return [ex for ex in examples if id(ex) in picked]


def export_fidelity(summary: dict, weight_version: int | None = None) -> None:
    """A fidelity summary as the `simulator_fidelity_*` gauges (nothing when no step was replayed)."""
    if not summary.get("steps"):
        return
    metrics.SIMULATOR_FIDELITY_REWARD_ACCURACY.set(summary["reward_accuracy"])
    if summary["delta_r_mean"] == summary["delta_r_mean"]:  # NaN when no step parsed: leave the last value
        metrics.SIMULATOR_FIDELITY_DELTA_R.set(summary["delta_r_mean"])
    metrics.SIMULATOR_FIDELITY_ITEM_AGREEMENT.set(summary["item_recall"])
    metrics.SIMULATOR_FIDELITY_ITEM_TV.set(summary["item_tv"])
    metrics.SIMULATOR_FIDELITY_PROBES.inc()
    if weight_version is not None:
        metrics.SIMULATOR_FIDELITY_WEIGHT_VERSION.set(weight_version)


class FidelityProbe:
    """Live fidelity during training: `steps` held-out real steps, replayed teacher-forced through the
    Mexp behind `client` every `every` learner updates (in the background; one probe at a time).

    Retrieval draws from a private buffer of the TRAIN trajectories, built once, as in `replay_heldout`;
    the examples are fixed at construction, so successive probes are comparable."""

    def __init__(self, client: Any, cfg: SimulatorConfig, tokenizer: Any, train_trajs: list, held_trajs: list,
                 embedder: Any, steps: int, every: int):
        self.every, self.task, self.last = every, None, None
        self._tmp = tempfile.TemporaryDirectory(prefix="fidelity-probe-")
        self.buffer = EdgeBuffer(Path(self._tmp.name) / "edge", embedder)
        seed_buffer(self.buffer, train_trajs)
        self.examples = even_spread(build_examples(held_trajs, tokenizer, cfg, self.buffer), steps)
        self.mexp = ExperienceModel(client, self.buffer, cfg, tokenizer)

    async def probe(self, weight_version: int | None = None) -> dict:
        """Replay the probe's steps now; export and return the summary."""
        t0 = time.monotonic()
        summary = summarize(await replay(self.mexp, self.examples))
        summary["seconds"] = time.monotonic() - t0
        export_fidelity(summary, weight_version)
        self.last = summary
        return summary

    def after_update(self, updates: int, weight_version: int) -> None:
        """Start a probe in the background when `updates` is a multiple of `every` and none is running."""
        if self.examples and updates % self.every == 0 and (self.task is None or self.task.done()):
            self.task = asyncio.create_task(self.probe(weight_version))

    async def wait(self) -> dict | None:
        """Let a running probe finish (its gauges land); the last summary."""
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)
        return self.last

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.buffer.close()
        self._tmp.cleanup()


async def replay_heldout(client: Any, cfg: SimulatorConfig, tokenizer: Any, train_trajs: list, held_trajs: list,
                         embedder: Any, max_steps: int = 0, concurrency: int = 16,
                         variants: list[str] = ("full",), progress: bool = False) -> dict:
    """Teacher-forced replay of held-out steps through the Mexp behind `client`, in each variant
    (`progress`: a log line at each tenth of a variant's steps). `held_trajs` are the steps replayed:
    `dreamgym fidelity --split train` passes the training trajectories here.

    Retrieval draws from a fresh buffer of the TRAIN trajectories only, so no held-out
    episode grounds its own replay. `max_steps` takes an even spread of the held-out steps,
    the same in every setting. Returns {variant: {"summary": ..., "records": [...]}}."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fidelity-buffer-") as tmp:
        buffer = EdgeBuffer(Path(tmp) / "edge", embedder)
        try:
            seed_buffer(buffer, train_trajs)
            for name in variants:
                vcfg = replace(cfg, **VARIANTS[name])
                examples = even_spread(build_examples(held_trajs, tokenizer, vcfg, buffer), max_steps)
                t0, report = time.monotonic(), log_tenths(f"fidelity ({name})") if progress else None
                records = await replay(ExperienceModel(client, buffer, vcfg, tokenizer), examples, concurrency,
                                       report)
                summary = summarize(records)
                summary["seconds"] = time.monotonic() - t0
                results[name] = {"summary": summary, "records": records, "examples": examples}
        finally:
            buffer.close()
    return results


async def measure(cfg: SimulatorConfig, checkpoint: str, train_trajs: list, held_trajs: list, data_dir: str | Path,
                  variants: list[str], max_steps: int = 0, judge_url: str = "", max_batch_size: int = 16,
                  engines: EngineConfig | None = None) -> dict:
    """Start an engine serving `checkpoint` (or the base model) and replay held-out steps in each variant.

    `engines` (the config's) places it: its device, dtype and engine settings, on every core of a CPU
    (the engine computes alone here); None: a CPU engine in fp32 with the defaults."""
    model = checkpoint or "smollm2"
    tokenizer = load_tokenizer(model)
    embedder = Embedder(cache_path=Path(data_dir) / ".cache" / "embeddings.sqlite")
    e = replace(engines or EngineConfig(), threads=0)  # EngineConfig.threads 0: every core
    engine = await start_embedded_engine(model=model, max_batch_size=max_batch_size, dtype=e.dtype, device=e.device,
                                         engine_cfg=e)
    try:
        # A long timeout: on a shared CPU a batch of long replies can take minutes, and a retry redoes it.
        async with EngineClient([engine.url], timeout_s=3600.0, max_retries=0, api_key=e.api_key) as client:
            results = await replay_heldout(client, cfg, tokenizer, train_trajs, held_trajs, embedder, max_steps,
                                           max_batch_size, variants, progress=True)
            if judge_url:
                async with EngineClient([judge_url], role="judge") as jc:
                    for r in results.values():
                        r["summary"].update(await judge(jc, r["examples"], r["records"]))
    finally:
        await engine.stop()
        embedder.close()
    for r in results.values():
        r.pop("examples")
    return results


SUMMARY_ROWS = ("steps", "parse_failure_rate", "reward_accuracy", "reward_accuracy_all_zero", "reward_recall",
                "reward_precision", "reward_false_positive_rate", "rewards_contradicted", "rewards_affirmed",
                "delta_r_mean", "delta_r_max", "done_accuracy", "item_recall", "token_f1")


def summary_table(results: dict, title: str, judged: bool = False) -> Table:
    """One row per measure, one column per checkpoint and setting: readable at any terminal width
    (fourteen measures side by side were cut to one character each in an 80-column log)."""
    rows = list(SUMMARY_ROWS) + ([f"judge_{k}" for k in JUDGE_KEYS] if judged else [])
    runs = [(f"{Path(ck).name or ck} / {name}", r["summary"]) for ck, res in results.items() for name, r in res.items()]
    table = Table(title=title)
    table.add_column("measure", no_wrap=True)
    for label, _ in runs:
        table.add_column(label, justify="right", overflow="fold")
    for row in rows:
        table.add_row(row, *(str(s.get(row, 0)) if row == "steps" else f"{s.get(row, float('nan')):.3g}" for _, s in runs))
    return table


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    add_family_argument(p)
    p.add_argument("--checkpoints", default="",
                   help="comma-separated Mexp checkpoints to compare; 'base' = the untrained model "
                        "(default: simulator.checkpoint, else base)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="settings to run (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=0, help="replay at most this many held-out steps (0 = all)")
    p.add_argument("--temperature", type=float, default=0.0, help="Mexp sampling temperature (default: greedy)")
    p.add_argument("--retries", type=int, default=0, help="parse retries per step (default 0: per-sample failure rate)")
    p.add_argument("--judge-url", default="", help="SGLang-compatible endpoint of an LLM judge (optional)")
    p.add_argument("--split", choices=("heldout", "train"), default="heldout",
                   help="whose steps to replay: the held-out trajectories (how the Mexp generalises), or the "
                        "training ones it was fine-tuned on (what it memorised; each episode still retrieves "
                        "only other episodes' transitions) (default: %(default)s)")
    p.add_argument("--out", default="", help="JSON report path (default: <run_dir>/fidelity.json)")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    sim = replace(cfg.simulator, temperature=args.temperature, parse_retries=args.retries)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise UsageError(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    ckpts = [c.strip() for c in (args.checkpoints or sim.checkpoint or "base").split(",") if c.strip()]
    family = family_of(args, cfg)
    trajs = load_offline(cfg.infra.data_dir, family)
    train_trajs, held_trajs = split_trajectories(trajs, sim.heldout_frac, cfg.infra.data_dir, family)
    replayed = held_trajs if args.split == "heldout" else train_trajs
    report: dict[str, Any] = {"split": args.split, "heldout_tasks": sorted({t.task_id for t in held_trajs}),
                              "tasks": sorted({t.task_id for t in replayed}), "results": {}}
    for ck in ckpts:
        report["results"][ck] = asyncio.run(measure(sim, "" if ck == "base" else ck, train_trajs, replayed,
                                                    cfg.infra.data_dir, variants, args.max_steps, args.judge_url,
                                                    cfg.engines.max_batch_size, cfg.engines))
    out = Path(args.out or Path(cfg.infra.run_dir) / "fidelity.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    split = "held-out" if args.split == "heldout" else "training"
    Console().print(summary_table(report["results"], f"Mexp fidelity on {len(replayed)} {split} real trajectories",
                                  judged=bool(args.judge_url)))
    Console().print(f"report: {out}")
    return 0
