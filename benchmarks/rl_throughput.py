"""The quickstart's RL phase for a fixed time, old vs new settings side by side in one run.

What it measures: for each setting, the RL phase of `dreamgym train` (configs/quickstart.yaml
unless --config) runs for `--seconds` of wall time with its real parts: embedded Redis,
the Qdrant Edge replay buffer seeded with the offline data, embedded engines serving Mexp
and the policy, rollout workers playing the curriculum's tasks in the synthetic
environment, and the GRPO learner. It prints synthetic trajectories/s (pushed by the
workers), learner updates/min and learner tokens/s (tokens through the policy in the
updates' forward/backward passes, from `learner_tokens_total`, over the phase's wall
time), with the load average beside each figure. Under each setting it prints each embedded
engine's own counters (requests, tokens generated, mean decode batch, prompt tokens and those
served from the prefix cache): where the rollout time went.

Settings: "old" is the quickstart before issue 13 (the policy names a letter on per-step
prompts, no prefix cache, the learner at the engines' priority and thread count, no bound
on the trajectory backlog); "new" switches on each improvement that its flag leaves on:

    --score on|off           actors.action_mode=score: the policy scores each candidate's text (one batched
                             forward, no decoding) on per-step prompts
    --packed on|off          actors.multi_turn: one chat per episode, one packed learner forward per trajectory
                             (label mode only, so skipped, saying so, while --score is on)
    --prefix-cache on|off    engines.prefix_cache_mb (256 MB vs 0)
    --learner-sched on|off   learner.threads=1, learner.nice=5 (a dedicated, lower-priority update thread),
                             actors.max_trajectory_backlog=8 (rollouts stop running ahead of the learner)
    --score-cache on|off     engines.score_cache_mb (256 MB vs 0): the CPU scorer's prompt cache (score mode)

A setting named "new-<switch>" (e.g. `--settings new-score-cache,new`) is "new" without that one
switch: its effect alone, measured in one run.

Each setting starts its own services (engines included), so they do not share caches.
Mexp is `--mexp DIR`, else the config's SFT checkpoint (cached under its data_dir, built
once before the timed phase when missing, as `dreamgym train` does); `--mexp base`
serves the untrained model (an untrained Mexp breaks more episodes).

    python benchmarks/rl_throughput.py [--seconds 180] [--settings old,new] [--packed on] [--set key=value ...]

A smoke run (checks that it runs, not a measurement): tiny data, one worker, PPO so that
every trajectory trains (GRPO drops the all-equal groups a short run mostly makes); the
first run also builds the small Mexp SFT checkpoint, several minutes here:

    python benchmarks/rl_throughput.py --seconds 180 --set infra.data_dir=/tmp/rl infra.run_dir=/tmp/rl/runs \
        data.textworld_games=2 data.textworld_heldout=1 actors.num_workers=1 actors.concurrent_episodes=2 \
        actors.group_size=2 actors.max_steps=2 curriculum.variants_per_seed=0 learner.algo=ppo learner.groups_per_update=1

A shared 2-core CPU is noisy: compare the two settings of one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rich.console import Console  # noqa: E402

from infra import metrics  # noqa: E402
from infra.config import Config, load_config  # noqa: E402
from infra.run import artifacts, report  # noqa: E402
from infra.run.driver import make_trainer, rl_phase  # noqa: E402
from infra.run.services import Services  # noqa: E402
from learner import mexp_sft  # noqa: E402

OLD = {"actors.action_mode": "label", "actors.multi_turn": False, "engines.prefix_cache_mb": 0.0,
       "engines.score_cache_mb": 0.0, "learner.threads": 0, "learner.nice": 0, "actors.max_trajectory_backlog": 256}
SWITCHES = {  # flag -> the overrides it turns on in the "new" setting
    "score": {"actors.action_mode": "score"},
    "packed": {"actors.multi_turn": True},
    "prefix_cache": {"engines.prefix_cache_mb": 256.0},
    "score_cache": {"engines.score_cache_mb": 256.0},
    "learner_sched": {"learner.threads": 1, "learner.nice": 5, "actors.max_trajectory_backlog": 8},
}


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def counter(c) -> float:
    return float(c._value.get())  # the process-wide prometheus counter


async def engine_figures(url: str) -> dict:
    """An embedded engine's own counters (its /metrics): decode batches, generated and prompt tokens."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return {"forwards": values.get("engine_batch_size_count", 0.0), "rows": values.get("engine_batch_size_sum", 0.0),
            "generated": values.get("engine_server_generated_tokens_total", 0.0),
            "prompt": values.get("engine_prompt_tokens_total", 0.0),
            "cached": values.get("engine_prefix_cached_tokens_total", 0.0),
            "score_cached": values.get("engine_score_cached_tokens_total", 0.0),
            "requests": values.get("engine_server_request_seconds_count", 0.0)}


def inapplicable(args: argparse.Namespace) -> set[str]:
    """The switches another one rules out: packing needs label mode (score mode uses per-step prompts)."""
    return {"packed"} if args.score == "on" else set()


def setting_overrides(name: str, args: argparse.Namespace) -> dict:
    """"old", "new", or "new-<switch>": new without that one switch (its effect alone, in one run)."""
    out = dict(OLD)
    if name == "new" or name.startswith("new-"):
        skip = inapplicable(args) | {name[len("new-"):].replace("-", "_")}
        for flag, over in SWITCHES.items():
            if getattr(args, flag) == "on" and flag not in skip:
                out.update(over)
    return out


async def measure(cfg: Config, name: str, seconds: float, mexp: str | None, console: Console) -> dict:
    """One RL phase of `seconds` on fresh services; its throughput figures."""
    cfg.infra.train_budget_s = seconds
    cfg.learner.total_updates = 1_000_000  # the budget ends the phase
    async with Services(cfg, f"bench-rl-{name}-{time.strftime('%H%M%S')}", console) as svc:
        splits, offline = artifacts.prepare_data(cfg, console)
        svc.open_buffer(offline)
        mexp_model = mexp or artifacts.mexp_checkpoint(cfg, offline, console)
        policy_model = artifacts.policy_start(cfg, offline, console)
        await svc.start_engines(mexp_model, policy_model)
        learner, curriculum = await make_trainer(cfg, svc, policy_model, splits.train, False)
        tokens0, load0 = counter(metrics.LEARNER_TOKENS), os.getloadavg()
        history = report.RunHistory()
        phase = await rl_phase(cfg, svc, learner, curriculum, history, name, cfg.learner.total_updates, console)
        tokens = counter(metrics.LEARNER_TOKENS) - tokens0
        busy = sum(r.get("update_s", 0.0) for r in history.rows)
        e = cfg.engines  # our engines' counters only: configured endpoints and SGLang name theirs otherwise
        engines = {role: await engine_figures(client.urls[0])
                   for role, client, endpoints in (("mexp", svc.mexp, e.mexp_endpoints), ("policy", svc.policy, e.policy_endpoints))
                   if client is not None and not endpoints and e.launch != "sglang"}
    s = phase["seconds"]
    return {"setting": name, "seconds": s, "trajectories": phase["trajectories_pushed"],
            "traj_per_s": phase["trajectories_pushed"] / s, "updates": phase["updates"],
            "updates_per_min": 60 * phase["updates"] / s, "tokens": int(tokens), "tokens_per_s": tokens / s,
            "update_s": busy, "tokens_per_update_s": tokens / busy if busy else 0.0,
            "steps": phase["synthetic_transitions"], "set_aside": phase["trajectories_set_aside"], "engines": engines,
            "load_before": load0, "load_after": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--seconds", type=float, default=180.0, help="RL wall time per setting")
    ap.add_argument("--settings", default="old,new", help="which settings to run, in order")
    for flag in SWITCHES:
        ap.add_argument("--" + flag.replace("_", "-"), dest=flag, choices=["on", "off"], default="on",
                        help=f"new setting: {', '.join(f'{k}={v}' for k, v in SWITCHES[flag].items())}")
    ap.add_argument("--mexp", default="", help="Mexp model directory, or 'base' for the untrained model (default: the "
                                               "config's cached SFT checkpoint, built first when missing)")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides for every setting, key=value")
    args = ap.parse_args()
    console = Console(quiet=True)
    for flag in sorted(inapplicable(args)):
        print(f"--{flag} skipped: --score on scores each candidate on a per-step prompt (no multi-turn chat to "
              f"pack)", flush=True)
    names = [s for s in args.settings.split(",") if s]
    unknown = [n for n in names if n not in ("old", "new") and n[len("new-"):].replace("-", "_") not in SWITCHES]
    if unknown:
        ap.error(f"--settings: {', '.join(unknown)}: each is old, new or new-<switch> "
                 f"({', '.join(f.replace('_', '-') for f in SWITCHES)})")
    results = []
    for name in names:
        cfg = load_config(args.config, [f"{k}={v}" for k, v in setting_overrides(name, args).items()] + list(args.set))
        mexp = cfg.engines.model if args.mexp == "base" else (args.mexp or None)
        if mexp is None and not (mexp_sft.cache_dir(cfg) / "config.json").exists():
            print(f"{name}: no cached Mexp SFT checkpoint under {cfg.infra.data_dir}: building it first (not timed)")
        print(f"{name}: {', '.join(f'{k}={v}' for k, v in setting_overrides(name, args).items())}  ({load()})",
              flush=True)
        r = asyncio.run(measure(cfg, name, args.seconds, mexp, console))
        results.append(r)
        print(f"{name}: {r['trajectories']} trajectories, {r['updates']} updates, {r['tokens']} learner tokens "
              f"in {r['seconds']:.0f} s  (load before {r['load_before'][0]:.2f}, after {r['load_after'][0]:.2f})",
              flush=True)
        aside = ", ".join(f"{k} {n}" for k, n in sorted(r["set_aside"].items())) or "none"
        print(f"  set aside by the learner: {aside}", flush=True)  # why trajectories did not become updates
        for role, e in r["engines"].items():  # where the rollout time goes: the engines' own counters
            print(f"  {role} engine: {e['requests']:.0f} requests, {e['generated']:.0f} tokens generated "
                  f"({e['generated'] / r['seconds']:.1f}/s), mean forward batch {e['rows'] / max(e['forwards'], 1):.1f} "
                  f"over {e['forwards']:.0f} forwards, {e['prompt']:.0f} prompt tokens of which {e['cached']:.0f} "
                  f"from the prefix cache; {e['score_cached']:.0f} scoring prompt tokens from the score cache",
                  flush=True)
    print(f"\n{'setting':>8} {'traj/s':>8} {'updates/min':>12} {'learner tok/s':>14} {'tok/s in updates':>17} "
          f"{'s/update':>9} {'steps':>6}  load(1m) at end")
    for r in results:
        per = r["update_s"] / r["updates"] if r["updates"] else float("nan")
        print(f"{r['setting']:>8} {r['traj_per_s']:8.3f} {r['updates_per_min']:12.2f} {r['tokens_per_s']:14.1f} "
              f"{r['tokens_per_update_s']:17.1f} {per:9.1f} {r['steps']:6d}  {r['load_after'][0]:.2f}")
    if len(results) == 2:
        a, b = results

        def ratio(key: str) -> float:
            return b[key] / a[key] if a[key] else float("nan")  # nan: the first setting got none in its time

        print(f"{b['setting']} / {a['setting']}: trajectories/s x{ratio('traj_per_s'):.2f}, "
              f"updates/min x{ratio('updates_per_min'):.2f}, learner tokens/s x{ratio('tokens_per_s'):.2f}  ({load()})")


if __name__ == "__main__":
    main()
