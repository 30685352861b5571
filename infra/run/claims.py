"""The paper's central claims, checked on the mean of each regime's repeated runs.

Owns the four statements an experiment's table is built to test (paper Table 1 and Table 2;
issue 14's targets), read from the held-out results of the regimes that an experiment file
names for each role under `claims:`:

1. DreamGym, with no online real transition, beats SFT by at least 10 points on held-out real
   success, with a paired 95 % interval above 0. Checked again (1b) on the paper-faithful DreamGym
   regime where the file names one (`dreamgym_faithful`, e.g. `no_replay`: every synthetic step asked
   of Mexp, none replayed from the offline data), so the replay's share of the gain is visible.
2. DreamGym reaches at least 0.9x real-environment RL's held-out success.
3. Sim-to-real beats real-environment RL while using at most 10 % of the real transitions that
   real-environment RL used.
4. Each ablation scores below full DreamGym.

Repeats decide (issue 64, part 4). A claim is judged on the mean over each regime's runs
(`dreamgym experiment --repeats K`), with an interval that resamples runs and tasks
(actors/confidence.compare_runs), the interval over tasks alone, and each run's success with their
spread. A claim is `met` or `not met` only when every regime it compares has at least
`repeats_needed` runs (3 unless the file's `claims:` says otherwise); with fewer it is `undecided`,
with the figures so far. A regime whose repeats would reproduce its first run (no RL update and a
greedy evaluation: base, SFT; experiment.identical_repeats) counts as repeated with one run. A claim
whose regimes have not run is `not run`. Runs pooled from other machines' run directories
(`dreamgym experiment --pool`) count as runs; each side's runs are resampled apart, so a run is compared
with all of its baseline's runs, not paired with its own machine's (wider, not narrower, than
pairing). Each comes with the figures that decide it, so a collection's `results.md` says what it
showed instead of a reader working it out across rows. Nothing here runs a regime.

How many repeats: runs of one regime have differed by up to 56 points on the CPU preset
(dreamgym_grpo: 0.917 and 0.354, docs/experiments.md); its six runs on the recipe of footnotes 22-26
have a standard deviation of 18 points. The runs part of the interval on a mean of n runs is then about
±1.96 x 18 / sqrt(n) points: ±20 at n = 3, ±16 at 5, ±10 at 13 (`runs_to_resolve`). So 3 runs are the
floor below which no claim is called; a gap of 20 points (claim 1 at its recent size) needs 4-5 runs
before its interval can clear 0, and a gap under 10 points (claims 2-4 as measured) needs 13 or more,
more than a 2-core machine runs: there those claims stay undecided or point estimates.

Readings the issue leaves open: "beats" and "below" (claims 3 and 4) are the paired point estimate,
with the interval beside it, since only claim 1 asks for an interval; sim-to-real's share is taken
against the real transitions real RL actually used, not its budget (real RL stops at its update
count, often well inside its budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Collection, Sequence

from actors.confidence import PairedDifference, compare_runs, paired_bootstrap, per_task_success
from infra.config import ConfigError

MET, NOT_MET, NOT_RUN, UNDECIDED = "met", "not met", "not run", "undecided"
SFT_MARGIN = 0.10  # claim 1: points above SFT, as a fraction
REAL_RATIO = 0.9  # claim 2: DreamGym's success over real RL's
S2R_SHARE = 0.10  # claim 3: sim-to-real's real transitions over real RL's
REPEATS_NEEDED = 3  # runs per regime before a claim is called (`claims: repeats_needed`)
RUN_SD = 0.18  # dreamgym_grpo's run-to-run standard deviation on the CPU preset (six runs, footnotes 22-26)


def runs_to_resolve(gap: float, sd: float = RUN_SD, z: float = 1.96) -> int:
    """Runs whose mean puts a gap of `gap` outside the runs part of a 95 % interval, at a run-to-run
    standard deviation `sd` (the tasks part adds to it): the n with z * sd / sqrt(n) <= gap."""
    if gap <= 0:
        raise ValueError(f"gap must be positive, got {gap}")
    return max(1, math.ceil((z * sd / gap) ** 2))


@dataclass(frozen=True)
class Roles:
    """Which regime of an experiment plays each part in the claims (`claims:` in its file), and how many runs
    per regime a claim needs before it is called."""

    sft: str = ""
    dreamgym: str = ""
    real: str = ""
    s2r: str = ""
    ablations: tuple[str, ...] = field(default_factory=tuple)
    dreamgym_faithful: str = ""  # DreamGym as in the paper: every synthetic step asked of Mexp (no replay)
    repeats_needed: int = REPEATS_NEEDED

    @classmethod
    def parse(cls, doc: Any, regimes: Sequence[str], where: str) -> "Roles":
        """The roles of an experiment file's `claims:` mapping; every name must be one of `regimes`."""
        singles = ("sft", "dreamgym", "real", "s2r", "dreamgym_faithful")
        if not isinstance(doc, dict) or set(doc) - {*singles, "ablations", "repeats_needed"}:
            raise ConfigError(f"{where}: expected a mapping of {', '.join(singles)} to a regime, ablations to "
                              "a list of regimes and repeats_needed to a number of runs")
        ablations = doc.get("ablations") or []
        if not isinstance(ablations, list):
            raise ConfigError(f"{where}.ablations must be a list of regimes")
        needed = doc.get("repeats_needed", REPEATS_NEEDED)
        if not isinstance(needed, int) or isinstance(needed, bool) or needed < 1:
            raise ConfigError(f"{where}.repeats_needed must be a whole number of runs, at least 1; got {needed!r}")
        roles = cls(**{k: str(doc.get(k) or "") for k in singles}, ablations=tuple(str(a) for a in ablations),
                    repeats_needed=needed)
        for name in [*(getattr(roles, k) for k in singles), *roles.ablations]:
            if name and name not in regimes:
                raise ConfigError(f"{where}: {name!r} is not one of the regimes")
        return roles


def _per_task(runs: list[dict]) -> list[list[dict]]:
    return [r["heldout_after"].get("per_task", []) for r in runs]


def _paired(a: list[dict], b: list[dict]) -> PairedDifference:
    """Side a's mean over its runs minus side b's, on the same held-out tasks, with an interval that resamples
    each side's runs and the shared tasks (one run a side: the paired bootstrap over tasks)."""
    return compare_runs(_per_task(a), _per_task(b))


def _over_tasks(a: list[dict], b: list[dict]) -> PairedDifference:
    """The same difference with an interval over tasks alone: each task's success averaged over a side's runs."""
    def means(runs: list[dict]) -> dict[str, float]:
        each = [per_task_success(p) for p in _per_task(runs)]
        common = set.intersection(*(set(e) for e in each))
        return {t: sum(e[t] for e in each) / len(each) for t in common}

    ma, mb = means(a), means(b)
    common = sorted(set(ma) & set(mb))
    return paired_bootstrap([ma[t] for t in common], [mb[t] for t in common])


def _rates(runs: list[dict]) -> list[float]:
    return [r["heldout_after"]["success_rate"] for r in runs]


def _rate(runs: list[dict]) -> float:
    return sum(_rates(runs)) / len(runs)


def _online_real(runs: list[dict]) -> float:
    """Online real transitions a regime used, the mean over its runs (exact counts, infra/budget.py)."""
    return sum(r.get("transitions", {}).get("online_real", 0) for r in runs) / len(runs)


def _pts(d: PairedDifference) -> str:
    return f"{100 * d.diff:+.1f} [{100 * d.ci_low:+.1f}, {100 * d.ci_high:+.1f}] pts"


def _named(name: str, runs: list[dict]) -> str:
    """'dg 0.650 (3 runs: 75.0, 55.0, 65.0; spread 20.0 pts)': the mean, each run and their spread."""
    if len(runs) == 1:
        return f"{name} {_rate(runs):.3f}"
    rates = _rates(runs)
    return (f"{name} {_rate(runs):.3f} ({len(runs)} runs: {', '.join(f'{100 * x:.1f}' for x in rates)}; "
            f"spread {100 * (max(rates) - min(rates)):.1f} pts)")


def _versus(a_name: str, a: list[dict], b_name: str, b: list[dict]) -> tuple[PairedDifference, str, dict]:
    """a against b: the difference of their means (interval over runs and tasks), its text, and its figures
    (the interval over tasks alone too, and each side's runs)."""
    d, t = _paired(a, b), _over_tasks(a, b)
    text = f"{_named(a_name, a)} vs {_named(b_name, b)}: {_pts(d)}"
    if len(a) > 1 or len(b) > 1:
        text += f" over runs and tasks ([{100 * t.ci_low:+.1f}, {100 * t.ci_high:+.1f}] over tasks alone)"
    figures = {"diff": d.diff, "ci_low": d.ci_low, "ci_high": d.ci_high, "tasks_ci_low": t.ci_low,
               "tasks_ci_high": t.ci_high, "runs": {a_name: _rates(a), b_name: _rates(b)}}
    return d, text, figures


def run_sd(*sides: list[dict]) -> float | None:
    """The largest run-to-run standard deviation of held-out success among the sides with two runs or more."""
    sds = [math.sqrt(sum((x - m) ** 2 for x in r) / (len(r) - 1))
           for side in sides if len(r := _rates(side)) > 1 for m in [sum(r) / len(r)]]
    return max(sds) if sds else None


def needed_for(gap: float, floor: int, *sides: list[dict]) -> str:
    """'; a 7.5-pt gap needs 23 runs at a run-to-run SD of 18.0 pts (the CPU preset's)': the runs a regime that
    would resolve it (`runs_to_resolve`, never below `floor`), at the spread measured among `sides`' runs."""
    measured = run_sd(*sides)
    sd, where = (measured, "measured here") if measured else (RUN_SD, "the CPU preset's")
    n = max(floor, runs_to_resolve(abs(gap), sd))
    return f"; a {100 * abs(gap):.1f}-pt gap needs {n} run{'s' * (n > 1)} at a run-to-run SD of {100 * sd:.1f} pts ({where})"


def _needs(*roles: tuple[str, list[dict]]) -> str:
    """Why a claim is not run: the regimes it compares that have no finished run (or no regime named)."""
    return "needs " + " and ".join(name or "a regime named for it" for name, runs in roles if not runs)


def _claim(n: int | str, text: str, status: str, detail: str, **figures: Any) -> dict:
    return {"target": n, "claim": text, "status": status, "detail": detail, **figures}


def check(roles: Roles, summaries: dict[str, list[dict]], identical: Collection[str] = ()) -> list[dict]:
    """The claims on the finished runs in `summaries` (regime name -> its runs' summaries), each judged on the
    mean of its regimes' runs once every one has `roles.repeats_needed` of them (`identical`: regimes whose
    repeats would reproduce their first run, so one is enough)."""
    def of(name: str) -> list[dict]:
        return (summaries.get(name) or []) if name else []

    k = roles.repeats_needed

    def short(*names: str) -> list[tuple[str, int]]:
        return [(n, len(of(n))) for n in names if of(n) and n not in identical and len(of(n)) < k]

    def decided(status: str, detail: str, *names: str, gap: float | None = None) -> tuple[str, str]:
        """`status`, or undecided (saying why) where a regime compared has fewer than k runs; then, for a
        difference `gap`, how many runs would resolve it at the run-to-run spread (`needed_for`)."""
        few = short(*names)
        if not few or status == NOT_RUN:
            return status, detail
        return UNDECIDED, (f"needs >= {k} runs per regime (has {min(n for _, n in few)}): "
                           + ", ".join(f"{name} {n} run{'s' * (n > 1)}" for name, n in few)
                           + (needed_for(gap, k, *(of(n) for n in names)) if gap else "")
                           + f"; so far {status}: {detail}")

    dg, sft, real, s2r = of(roles.dreamgym), of(roles.sft), of(roles.real), of(roles.s2r)
    out = []

    def claim_1(target: int | str, name: str, runs: list[dict], what: str) -> dict:
        text = f"{name or 'DreamGym'}{what}, no online real transition, >= {roles.sft or 'SFT'} + " \
               f"{100 * SFT_MARGIN:.0f} pts, paired interval above 0"
        if not (runs and sft):
            return _claim(target, text, NOT_RUN, _needs((name, runs), (roles.sft, sft)))
        d, vs, figures = _versus(name, runs, roles.sft, sft)
        online = _online_real(runs)
        ok = d.diff >= SFT_MARGIN - 1e-9 and d.ci_low > 0 and online == 0
        status, detail = decided(MET if ok else NOT_MET, f"{vs}; {online:.0f} online real transitions",
                                 name, roles.sft, gap=d.diff)
        return _claim(target, text, status, detail, **figures)

    out.append(claim_1(1, roles.dreamgym, dg, ""))
    if roles.dreamgym_faithful:
        out.append(claim_1("1b", roles.dreamgym_faithful, of(roles.dreamgym_faithful),
                           " (as in the paper: every synthetic step asked of Mexp, none replayed)"))

    text = f"{roles.dreamgym or 'DreamGym'} >= {REAL_RATIO}x {roles.real or 'real-environment RL'}"
    if not (dg and real):
        out.append(_claim(2, text, NOT_RUN, _needs((roles.dreamgym, dg), (roles.real, real))))
    else:
        ratio = _rate(dg) / _rate(real) if _rate(real) > 0 else float("inf")
        d, vs, figures = _versus(roles.dreamgym, dg, roles.real, real)
        status, detail = decided(MET if ratio >= REAL_RATIO - 1e-9 else NOT_MET,
                                 f"{ratio:.3f}x; paired {vs}", roles.dreamgym, roles.real, gap=d.diff)
        out.append(_claim(2, text, status, detail, ratio=ratio, **figures))

    text = f"{roles.s2r or 'sim-to-real'} > {roles.real or 'real-environment RL'} with <= " \
           f"{100 * S2R_SHARE:.0f} % of its real transitions"
    if not (s2r and real):
        out.append(_claim(3, text, NOT_RUN, _needs((roles.s2r, s2r), (roles.real, real))))
    else:
        d, vs, figures = _versus(roles.s2r, s2r, roles.real, real)
        mine, theirs = _online_real(s2r), _online_real(real)
        share = mine / theirs if theirs > 0 else float("inf")
        ok = d.diff > 0 and share <= S2R_SHARE + 1e-9
        interval = ("interval above 0" if d.ci_low > 0 else "point estimate only") if d.diff > 0 else \
            "level" if d.diff == 0 else "below"
        status, detail = decided(MET if ok else NOT_MET,
                                 f"{vs} ({interval}); {mine:.0f} real transitions, {100 * share:.1f} % of "
                                 f"{roles.real}'s {theirs:.0f}", roles.s2r, roles.real, gap=d.diff)
        out.append(_claim(3, text, status, detail, share=share, **figures))

    text = f"each ablation ({', '.join(roles.ablations) or 'none named'}) below {roles.dreamgym or 'DreamGym'}"
    ran = [a for a in roles.ablations if of(a)]
    if not (dg and ran):
        out.append(_claim(4, text, NOT_RUN, _needs((roles.dreamgym, dg), *((a, of(a)) for a in roles.ablations))
                          if roles.ablations else "the experiment names no ablation"))
    else:
        compared = {a: _versus(a, of(a), roles.dreamgym, dg) for a in ran}
        diffs = {a: c[0] for a, c in compared.items()}
        above = [a for a in ran if diffs[a].diff >= 0]
        missing = [a for a in roles.ablations if a not in ran]
        detail = "; ".join(c[1] for c in compared.values()) + (f"; not run: {', '.join(missing)}" if missing else "") \
            + (f"; not below: {', '.join(above)}" if above else "")
        # one ablation level with or above the full regime on enough runs of both misses the claim already
        if [a for a in above if not short(a, roles.dreamgym)]:
            status = NOT_MET
        else:
            status, detail = decided(NOT_RUN if missing else NOT_MET if above else MET, detail,
                                     roles.dreamgym, *ran)
        out.append(_claim(4, text, status, detail,
                          diffs={a: {"diff": x.diff, "ci_low": x.ci_low, "ci_high": x.ci_high}
                                 for a, x in diffs.items()}))
    return out


def markdown_lines(claims: list[dict]) -> list[str]:
    """The claims as results.md's section."""
    if not claims:
        return []
    return ["", "## The paper's claims on this collection", "",
            "Each claim is judged on the mean of its regimes' runs, with intervals over runs and tasks; it is "
            "called (met or not met) only once every regime it compares has the runs the experiment asks for "
            "(`claims: repeats_needed`), else undecided.", "",
            *(f"{c['target']}. **{c['status']}**: {c['claim']}. {c['detail']}." for c in claims)]
