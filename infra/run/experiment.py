"""`dreamgym experiment`: the paper's regimes on the same held-out real tasks, one command, one table.

Owns running named regimes (base, SFT, real-environment RL, DreamGym, sim-to-real,
PPO, the ablations) with the same seeds, data and task splits, and comparing them.
An experiment file (configs/experiments/*.yaml) names a `base` train preset, common
`overrides`, and one entry per regime with its own overrides; each regime is one
`dreamgym train` run (a child process, so every regime starts from a clean slate)
under `<run_dir>/<experiment>/<regime>/`, which leaves its summary.json: held-out
real success with per-task results, real and synthetic transitions counted exactly,
the Mexp's fidelity, wall time. Regimes that finished are skipped, and one stopped
after a learner checkpoint continues from it, so an interrupted experiment resumes
where it stopped; a run whose settings (its config.yaml) differ from what the file now
sets for its regime is neither skipped, resumed nor reported: the regime starts again, unless
only its `evaluation.*` settings changed, when its last checkpoint is evaluated again. A regime
that `continues` another (sim-to-real after DreamGym GRPO) starts from that one's finished run
(infra/run/fork.py), so a shared first part trains once;
the file's loading checks that the two differ only in what acts after that run's end.
A regime marked `extra: true` (a variant beside the paper's table, such as the
strong-start rows) runs only when `--only` names it, or with `--all`; the rest make the table.
`--repeats K` trains each selected regime K times (`<regime>`, `<regime>.r2`, ...): one RL run of a
regime has differed from the next by up to a third of the held-out games on the CPU, so one run
per regime cannot order two regimes that close. `--pool DIR,...` adds the finished runs of other run
directories of the experiment (another machine's, or a sitting's kept in docs/runs/) to the results and
the claims, where a 2-core machine finishes one long run a sitting and its run directory does not outlive it.

The results (infra/run/results_table.py): `results.json` and `results.md` (success with a 95 % Wilson interval,
the paired difference to the `compare_to` regime, the experiment's or a regime's own,
with a bootstrap interval over tasks (and over runs, for a regime that ran more than once: its
success is then the mean of its runs, actors/confidence.runs_bootstrap), real transitions used, synthetic transitions,
the share of a DreamGym row's synthetic steps that Mexp answered rather than replayed from the offline data,
Mexp reward accuracy and ΔR, wall time), held-out success by slice (families seen in training, never seen,
longer plans than training's: infra/run/generalisation.py), the paper's four claims checked on the mean of
each regime's runs, called only with `claims: repeats_needed` runs a regime (infra/run/claims.py, for the
regimes the file names under `claims:`) and `success_vs_real.png`
(held-out success against online real transitions used). Beside the regimes, the scripted random and expert choosers play the
same held-out games (`dreamgym eval --policy random|expert`, seconds each): the floor
and the ceiling a learned policy sits between. Caches are keyed by content (infra/run/artifacts.py), so regimes
share the offline data and the policy warm start, and an ablation that changes how
Mexp is trained (no reasoning) trains its own Mexp.

Departure from the paper: the paper reports one number per regime from 3-8B models
on GPUs; here every figure carries its interval, since the held-out sets of a
CPU run are small.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.console import Console

from infra import presets
from infra.config import Config, ConfigError, dump, load_config
from infra.run import claims
from infra.run.fork import fork_run
from infra.run.results_table import markdown, plot, print_table, results, row  # noqa: F401 (row: the tests')
from infra.streams import run_prefix
from learner import checkpoint

log = logging.getLogger(__name__)


@dataclass
class Regime:
    name: str
    overrides: list[str] = field(default_factory=list)
    about: str = ""
    continues: str = ""  # a regime whose finished run this one resumes (infra/run/fork.py)
    compare_to: str = ""  # the regime its paired difference is taken against (default: the experiment's)
    extra: bool = False  # outside the experiment's table: runs only when named (--only) or with --all


@dataclass
class Experiment:
    name: str
    base: str
    overrides: list[str]
    regimes: list[Regime]
    compare_to: str = ""
    about: str = ""
    path: str = ""
    roles: claims.Roles | None = None  # the regimes the paper's claims compare (`claims:`, infra/run/claims.py)

    def config_args(self, regime: Regime) -> list[str]:
        """The `dreamgym train` arguments (preset and overrides) of one regime."""
        return [self.base, *self.overrides, *regime.overrides]

    def config(self, regime: Regime) -> Config:
        """The config one regime's run trains with."""
        return load_config(self.base or None, [*self.overrides, *regime.overrides])

    def identical_regimes(self) -> set[str]:
        """The regimes whose repeats would reproduce their first run (`identical_repeats`): one run is all of them."""
        return {r.name for r in self.regimes if identical_repeats(self, r)}


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment file: every regime's config must load (so a typo fails now, not in hour 2)."""
    p = presets.resolve(path, "experiment")
    if not p.exists():
        raise ConfigError(f"experiment file {p} does not exist (nor a shipped one: "
                          f"{', '.join(presets.names('experiment'))})")
    try:
        doc = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    known = {"name", "about", "base", "overrides", "compare_to", "regimes", "claims"}
    if not isinstance(doc, dict) or set(doc) - known:
        raise ConfigError(f"{p}: expected a mapping with keys {sorted(known)}; unknown: {sorted(set(doc) - known)}")
    if not isinstance(doc.get("regimes"), dict) or not doc["regimes"]:
        raise ConfigError(f"{p}: 'regimes' must map regime names to {{overrides: [...], about: ...}}")
    regimes = []
    for name, spec in doc["regimes"].items():
        spec = spec or {}
        if not isinstance(spec, dict) or set(spec) - {"overrides", "about", "continues", "compare_to", "extra"}:
            raise ConfigError(f"{p}: regimes.{name}: expected {{overrides: [...], about: '...', continues: regime, "
                              "compare_to: regime, extra: true|false}}")
        if not isinstance(spec.get("overrides", []), list):
            raise ConfigError(f"{p}: regimes.{name}.overrides must be a list of section.key=value")
        if not isinstance(spec.get("extra", False), bool):
            raise ConfigError(f"{p}: regimes.{name}.extra must be true or false")
        regimes.append(Regime(str(name), [str(o) for o in spec.get("overrides", [])], str(spec.get("about", "")),
                              str(spec.get("continues") or ""), str(spec.get("compare_to") or ""),
                              bool(spec.get("extra", False))))
    exp = Experiment(name=str(doc.get("name") or p.stem), base=str(doc.get("base") or ""),
                     overrides=[str(o) for o in doc.get("overrides") or []], regimes=regimes,
                     compare_to=str(doc.get("compare_to") or ""), about=str(doc.get("about") or ""), path=str(p),
                     roles=claims.Roles.parse(doc["claims"], [r.name for r in regimes], f"{p}: claims")
                     if doc.get("claims") is not None else None)
    for where, target in [("compare_to", exp.compare_to), *((f"regimes.{r.name}.compare_to", r.compare_to)
                                                            for r in regimes)]:
        if target and target not in {r.name for r in regimes}:
            raise ConfigError(f"{p}: {where}: {target!r} is not one of the regimes")
    for r in regimes:
        try:
            exp.config(r)
        except ConfigError as exc:
            raise ConfigError(f"{p}: regime {r.name}: {exc}") from exc
    for r in regimes:
        if r.continues:
            check_continuation(exp, r)
    return exp


# What a continuing regime may set differently from the regime it continues: settings that act only
# after the source's run has ended (the real phase of sim-to-real: its budget, its rollouts' temperature,
# how it picks its tasks).
AFTER_THE_SOURCE = {"learner": ("s2r_real_transitions", "s2r_max_updates", "s2r_temperature", "s2r_selection")}


def check_continuation(exp: Experiment, regime: Regime) -> None:
    """`regime.continues` names another regime that does not itself continue one, and whose settings
    equal this regime's except those in AFTER_THE_SOURCE: only then is its run this regime's first part."""
    where = f"{exp.path}: regimes.{regime.name}.continues"
    source = next((r for r in exp.regimes if r.name == regime.continues), None)
    if source is None or source is regime:
        raise ConfigError(f"{where}: {regime.continues!r} is not another regime of {exp.name}")
    if source.continues:
        raise ConfigError(f"{where}: {source.name} itself continues {source.continues}; continue that one")

    def shape(r: Regime) -> dict:
        d = exp.config(r).to_dict()
        for section, names in AFTER_THE_SOURCE.items():
            for n in names:
                d[section].pop(n)
        return d

    mine, theirs = shape(regime), shape(source)
    differ = sorted(f"{s}.{k}" for s in mine for k in mine[s] if mine[s][k] != theirs.get(s, {}).get(k))
    if differ:
        allowed = ", ".join(f"{s}.{n}" for s, ns in AFTER_THE_SOURCE.items() for n in ns)
        raise ConfigError(f"{where}: {source.name}'s run is not this regime's first part: they differ in "
                          f"{', '.join(differ)} (a continuing regime may only change {allowed})")


def run_dir(exp: Experiment) -> Path:
    """Where the experiment's regimes and results live: `<infra.run_dir of the base config>/<name>`."""
    return Path(load_config(exp.base or None, exp.overrides).infra.run_dir) / exp.name


def train_args(exp: Experiment, regime: Regime) -> list[str]:
    """The preset and overrides a regime's `dreamgym train` child gets: the regime's own, what a continued
    run keeps (continued.json), and the experiment's run directory."""
    return [*exp.config_args(regime), *continued_overrides(run_dir(exp) / regime.name),
            f"infra.run_dir={run_dir(exp)}"]


LOCATIONS = {("infra", "run_dir")}  # where a run wrote, not how it ran: a pooled run may have written elsewhere


def settings_changed(exp: Experiment, regime: Regime, where: Path | None = None) -> list[str]:
    """The settings (`section.key`) in which a regime's run differs from what the experiment file sets for
    it now: an edited regime is run again, not reported with its old run's figures. [] when they match,
    or when the run left no config.yaml; a setting that only one of the two knows (one added to the code
    since the run) is not compared. `where`: another run directory of the experiment (`--pool`)."""
    out = (where or run_dir(exp)) / regime.name
    path = out / "config.yaml"
    if not path.exists():
        return []
    ran = yaml.safe_load(path.read_text()) or {}
    base, *overrides = [*exp.config_args(regime), *continued_overrides(out)]
    now = yaml.safe_load(dump(load_config(base or None, overrides)))
    return sorted(f"{s}.{k}" for s, keys in now.items() for k, v in keys.items()
                  if isinstance(ran.get(s), dict) and k in ran[s] and ran[s][k] != v and (s, k) not in LOCATIONS)


def reevaluates(changed: list[str], last: Path | None) -> bool:
    """The one rule --list and start_regime apply to a run whose settings `changed` since it ran: when every
    changed setting only acts once training has ended (`evaluation.*`) and it has a checkpoint `last`, it
    resumes from there rather than starting again (a finished run's phases are done, so only its evaluations
    run again; a stopped one trains on where it stopped)."""
    return bool(changed) and last is not None and all(name.startswith("evaluation.") for name in changed)


def listed_state(exp: Experiment, regime: Regime) -> str:
    """What `--list` says of a regime with no finished run under its current settings: 're-eval' when it ran
    and only its evaluation settings changed since, with a checkpoint to evaluate (start_regime evaluates it
    again, no retraining); 'changed' when it ran under other settings (it starts again); else 'to run'."""
    out = run_dir(exp) / regime.name
    if not (out / "summary.json").exists() or not (changed := settings_changed(exp, regime)):
        return "to run"
    return "re-eval" if reevaluates(changed, checkpoint.latest(out)) else "changed"


def finished(exp: Experiment, regime: Regime, where: Path | None = None) -> dict | None:
    """The summary of a regime's finished run, if its settings are still the regime's (settings_changed);
    `where`: another run directory of the experiment (`--pool`)."""
    path = (where or run_dir(exp)) / regime.name / "summary.json"
    if not path.exists() or settings_changed(exp, regime, where):
        return None
    summary = json.loads(path.read_text())
    return summary if summary.get("heldout_after") is not None else None


REPEAT = re.compile(r"^(.+)\.r(\d+)$")  # a repeat's run name: <regime>.r<i>, i >= 2


def repeat(regime: Regime, i: int) -> Regime:
    """The i-th run of a regime (1: the regime itself), with run seed i-1 (`infra.run_seed`: its own action
    sampling and curriculum draws, the same data and caches); a continuing regime's i-th run continues its
    source's i-th."""
    if i == 1:
        return regime
    return dataclasses.replace(regime, name=f"{regime.name}.r{i}", overrides=[*regime.overrides, f"infra.run_seed={i - 1}"],
                               continues=f"{regime.continues}.r{i}" if regime.continues else "")


def identical_repeats(exp: Experiment, regime: Regime) -> bool:
    """True when a regime's repeats would reproduce its first run: no RL update (the warm start is cached by
    content, so a repeat loads the same weights) and greedy evaluation (run_seed then draws nothing)."""
    cfg = exp.config(regime)
    return cfg.learner.total_updates == 0 and cfg.evaluation.temperature == 0


def split_run_name(run_name: str) -> tuple[str, int]:
    """A run name's regime and repeat: ('dreamgym_grpo', 2) for `dreamgym_grpo.r2`, (name, 1) for a regime's own."""
    m = REPEAT.match(run_name)
    return (m.group(1), int(m.group(2))) if m else (run_name, 1)


def regime_named(exp: Experiment, name: str) -> Regime:
    """A regime, or one of its repeats, by run name."""
    base, i = split_run_name(name)
    return repeat(next(r for r in exp.regimes if r.name == base), i)


def runs_of(exp: Experiment, regime: Regime, pool: list[Path] | tuple[Path, ...] = ()) -> list[dict]:
    """The summaries of a regime's finished runs: the regime's own, then its repeats' in order, each with
    the `run_seed` it ran with (run i: i-1), which a missing run would otherwise shift; then those in each
    `pool` directory (other machines' or sittings' run directories of this experiment, `--pool`), in the
    same order, each marked with the directory it came from (`sitting`)."""
    out, seen = [], set()
    for where in [None, *pool]:
        found = [(1, regime)]
        for path in (where or run_dir(exp)).glob(f"{regime.name}.r*"):
            base, i = split_run_name(path.name)
            if base == regime.name and i > 1:
                found.append((i, repeat(regime, i)))
        for i, r in sorted(found, key=lambda x: x[0]):
            if (s := finished(exp, r, where)) is None:
                continue
            if (same := json.dumps(s, sort_keys=True)) in seen:  # a copy of a run already counted (timings differ run to run)
                log.warning("%s: %s repeats a run already counted; counted once", where, r.name)
                continue
            seen.add(same)
            out.append({**s, "run_seed": i - 1, **({"sitting": str(where)} if where else {})})
    return out


def run_regime(exp: Experiment, regime: Regime, console: Console, resume: bool = False) -> dict:
    """One regime as a `dreamgym train` child process (`--resume`: from its latest checkpoint); its summary.
    Output goes to <regime>/train.log."""
    out = run_dir(exp) / regime.name
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "infra.cli", "train", *train_args(exp, regime), "--name", regime.name,
           *(["--resume"] if resume else [])]
    console.print(f"[bold]{regime.name}[/]: {regime.about or ''}")
    console.print(f"  {' '.join(cmd[1:])}", markup=False, highlight=False)
    t0 = time.time()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TERM": "dumb", "COLUMNS": "120"}
    with open(out / "train.log", "ab") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise RuntimeError(f"regime {regime.name} failed (exit {rc}); see {out / 'train.log'}")
    summary = finished(exp, regime)
    if summary is None:
        raise RuntimeError(f"regime {regime.name} wrote no held-out evaluation; see {out / 'train.log'}")
    console.print(f"  done in {time.time() - t0:.0f} s: held-out success "
                  f"{summary['heldout_after']['success_rate']:.3f}")
    return summary


ANCHORS = ("random", "expert")


def run_anchors(exp: Experiment, console: Console) -> dict[str, dict]:
    """The scripted choosers on the same held-out games (cached in <experiment>/anchors/<policy>.json)."""
    out = run_dir(exp) / "anchors"
    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for policy in ANCHORS:
        path = out / f"{policy}.json"
        if not path.exists():
            cmd = [sys.executable, "-m", "infra.cli", "eval", *exp.config_args(Regime("anchor")), "--policy", policy,
                   "--out", str(path)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if proc.returncode != 0:
                console.print(f"[yellow]anchor {policy} failed (exit {proc.returncode}): {proc.stderr[-400:]}[/]")
                continue
        reports[policy] = json.loads(path.read_text())
    return reports


def write_results(exp: Experiment, summaries: dict[str, list[dict]], anchors: dict[str, dict] | None = None) -> dict:
    res = results(exp, summaries, anchors)
    out = run_dir(exp)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(markdown(res))
    if res["regimes"]:
        plot(res, out / "success_vs_real.png")
    return res


def start_regime(exp: Experiment, regime: Regime, console: Console, rerun: set[str]) -> dict:
    """Run one regime to its end. One stopped after a learner checkpoint continues from it; a rerun, or one
    that died before its first, starts clean (a run dir holds its buffer, weights and Redis). A regime that
    `continues` another starts from that one's finished run (run first if it has not finished)."""
    old = run_dir(exp) / regime.name
    changed = settings_changed(exp, regime) if old.exists() else []
    last = checkpoint.latest(old) if old.exists() and base_name(regime.name) not in rerun else None
    if reevaluates(changed, last):
        console.print(f"{regime.name}: only its evaluation settings changed since it ran ({', '.join(changed)}): "
                      f"evaluating its weights again, not retraining")
    elif changed:
        console.print(f"[yellow]{regime.name}: the experiment file changed its settings since it ran "
                      f"({', '.join(changed)}): starting it again[/]")
        last = None
    if last is not None:
        console.print(f"{regime.name}: resuming from {last}")
    elif old.exists():
        old.rename(old.with_name(f"{regime.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"))
    if last is None and regime.continues:
        source = regime_named(exp, regime.continues)
        done = finished(exp, source)
        if done is None:
            console.print(f"{regime.name} continues {source.name}, which has not finished: running it first")
            done = start_regime(exp, source, console, rerun=set())
        last = fork_run(run_dir(exp) / source.name, old, prefix(exp, source), prefix(exp, regime))
        # The source's phase ends where its run ended, even where a time budget cut it short of its
        # updates (a source that made none resumes its phase as configured: 0 would mean no RL at all).
        updates, planned = done["updates"], exp.config(source).learner.total_updates
        cut = [f"learner.total_updates={updates}"] if 0 < updates < planned else []
        (old / CONTINUED).write_text(json.dumps({"source": source.name, "checkpoint": str(last),
                                                 "overrides": cut}, indent=1))
        console.print(f"{regime.name}: continuing {source.name}'s finished run ({updates} updates) from {last}")
    return run_regime(exp, regime, console, resume=last is not None)


CONTINUED = "continued.json"  # in a continuing regime's run dir: what it continued and the overrides that keeps


def continued_overrides(out: Path) -> list[str]:
    path = out / CONTINUED
    return json.loads(path.read_text())["overrides"] if path.exists() else []


def prefix(exp: Experiment, regime: Regime) -> str:
    """The Redis key prefix of a regime's run."""
    return run_prefix(exp.config(regime).infra.stream_prefix, regime.name)


def base_name(run_name: str) -> str:
    """The regime a run belongs to: `dreamgym_grpo` for `dreamgym_grpo.r2`."""
    return split_run_name(run_name)[0]


def selected(exp: Experiment, only: list[str], everything: bool = False) -> list[Regime]:
    """The regimes a run takes on, in file order: those named in `only` (extra ones included), else the
    table's (every regime not marked `extra`; with `everything`, the extra ones too)."""
    if only:
        return [r for r in exp.regimes if r.name in only]
    return [r for r in exp.regimes if everything or not r.extra]


def unpaired(exp: Experiment, chosen: list[Regime]) -> dict[str, str]:
    """The chosen regimes whose baseline (`compare_to`) is neither chosen nor finished, each with that
    baseline: their rows would have no paired difference until the baseline runs too."""
    names = {r.name for r in chosen}
    out = {}
    for r in chosen:
        vs = r.compare_to or exp.compare_to
        if vs and vs != r.name and vs not in names and not runs_of(exp, regime_named(exp, vs)):
            out[r.name] = vs
    return out


# --- the `dreamgym experiment` command ------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="a shipped experiment's name (textworld_cpu, miniwob_cpu, textworld_gpu) or an "
                                   "experiment file, e.g. configs/experiments/textworld_cpu.yaml")
    p.add_argument("--only", default="", help="comma-separated regimes to run, extra ones included (default: every "
                                              "regime of the table, in file order)")
    p.add_argument("--all", action="store_true", help="run the extra regimes too (those marked `extra: true`)")
    p.add_argument("--repeats", type=int, default=1, help="train each selected regime this many times, as <regime>, "
                   "<regime>.r2, ... (default 1); the results take the mean of a regime's finished runs, with "
                   "intervals over runs and tasks; a regime without an RL update, evaluated greedily (base, sft), "
                   "runs once, as its repeats would be identical")
    p.add_argument("--rerun", default="", help="comma-separated regimes to run again even if finished")
    p.add_argument("--list", action="store_true",
                   help="list the regimes and their status, run nothing: done (×K with repeats), to run, changed (its "
                   "settings changed since it ran: it starts again) or re-eval (only evaluation.* changed: its last "
                   "checkpoint is evaluated again)")
    p.add_argument("--report", action="store_true", help="only rewrite results.json/.md and the plot from finished regimes")
    p.add_argument("--pool", nargs="+", action="extend", default=[], metavar="DIR",
                   help="run directories of this experiment from other machines "
                   "or sittings (copies of their runs/<experiment>; of each run it reads summary.json, config.yaml and, for "
                   "a regime that continues another, continued.json): their finished runs whose settings are this file's join this directory's in the "
                   "results and the claims, each as a run of its own (listed by where it ran under 'Runs by seed'). "
                   "A run is compared with its baseline's runs from every directory, not paired with its own "
                   "machine's. Nothing is run or resumed from them")


def run(args: argparse.Namespace) -> int:
    exp = load_experiment(args.experiment)
    console = Console()
    names = {r.name for r in exp.regimes}
    only = [x for x in args.only.split(",") if x]
    rerun = {x for x in args.rerun.split(",") if x}
    for x in [*only, *rerun]:
        if x not in names:
            raise ConfigError(f"--only/--rerun: {x!r} is not a regime of {exp.name} ({', '.join(sorted(names))})")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}")
    chosen = selected(exp, only, args.all)
    pool = [Path(x) for arg in args.pool for x in arg.split(",") if x]  # `--pool a b`, `--pool a,b`, a shell glob
    for where in pool:
        if not where.is_dir():
            raise ConfigError(f"--pool: {where} is not a directory (a copy of another machine's runs/{exp.name})")
    once = [r.name for r in chosen if args.repeats > 1 and identical_repeats(exp, r)]
    todo = [repeat(r, i) for i in range(1, args.repeats + 1) for r in chosen if i == 1 or r.name not in once]
    if args.list:
        for r in exp.regimes:
            done = len(runs_of(exp, r))
            state = "done" if done == 1 else f"done ×{done}" if done else listed_state(exp, r)
            console.print(f"{r.name:>28}  {state:9}  {'extra  ' if r.extra else ''}{r.about}",
                          markup=False, highlight=False)
        return 0
    t0 = time.time()
    for name, vs in unpaired(exp, chosen).items():
        console.print(f"[yellow]{name} is compared to {vs}, which has not run: its row will have no paired "
                      f"difference until it does (add {vs} to --only)[/]")
    if not args.report:
        if once:
            console.print(f"[dim]{', '.join(once)}: no RL update and greedy evaluation, so a repeat would reproduce "
                          "the first run: run once[/]")
        for i, r in enumerate(todo, 1):
            if finished(exp, r) and base_name(r.name) not in rerun:
                console.print(f"[dim]{r.name}: finished earlier, skipped ({i}/{len(todo)})[/]")
                continue
            console.rule(f"regime {i}/{len(todo)}: {r.name}")
            start_regime(exp, r, console, rerun)
    summaries = {r.name: runs for r in exp.regimes if (runs := runs_of(exp, r, pool))}
    res = write_results(exp, summaries, run_anchors(exp, console))
    print_table(res, console)
    console.print(f"results: {run_dir(exp) / 'results.md'} ({time.time() - t0:.0f} s)")
    return 0
