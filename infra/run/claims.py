"""The paper's central claims, checked on one experiment's finished runs.

Owns the four statements an experiment's table is built to test (paper Table 1 and Table 2;
issue 14's targets), read from the held-out results of the regimes that an experiment file
names for each role under `claims:`:

1. DreamGym, with no online real transition, beats SFT by at least 10 points on held-out real
   success, with a paired 95 % interval above 0.
2. DreamGym reaches at least 0.9x real-environment RL's held-out success.
3. Sim-to-real beats real-environment RL while using at most 10 % of the real transitions that
   real-environment RL used.
4. Each ablation scores below full DreamGym.

Each comes out `met`, `not met` or `not run`, with the figures that decide it, so a collection's
`results.md` says what it showed instead of a reader working it out across rows. Nothing here runs
a regime; a regime trained several times (`--repeats`) is pooled as in the table (the mean of its
runs, intervals over runs and tasks, actors/confidence.compare_runs).

Readings the issue leaves open: "beats" and "below" (claims 3 and 4) are the paired point estimate,
with the interval beside it, since only claim 1 asks for an interval; sim-to-real's share is taken
against the real transitions real RL actually used, not its budget (real RL stops at its update
count, often well inside its budget).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from actors.confidence import PairedDifference, compare_runs
from infra.config import ConfigError

MET, NOT_MET, NOT_RUN = "met", "not met", "not run"
SFT_MARGIN = 0.10  # claim 1: points above SFT, as a fraction
REAL_RATIO = 0.9  # claim 2: DreamGym's success over real RL's
S2R_SHARE = 0.10  # claim 3: sim-to-real's real transitions over real RL's


@dataclass(frozen=True)
class Roles:
    """Which regime of an experiment plays each part in the claims (`claims:` in its file)."""

    sft: str = ""
    dreamgym: str = ""
    real: str = ""
    s2r: str = ""
    ablations: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, doc: Any, regimes: Sequence[str], where: str) -> "Roles":
        """The roles of an experiment file's `claims:` mapping; every name must be one of `regimes`."""
        singles = ("sft", "dreamgym", "real", "s2r")
        if not isinstance(doc, dict) or set(doc) - {*singles, "ablations"}:
            raise ConfigError(f"{where}: expected a mapping of {', '.join(singles)} to a regime and ablations to "
                              "a list of regimes")
        ablations = doc.get("ablations") or []
        if not isinstance(ablations, list):
            raise ConfigError(f"{where}.ablations must be a list of regimes")
        roles = cls(**{k: str(doc.get(k) or "") for k in singles}, ablations=tuple(str(a) for a in ablations))
        for name in [*(getattr(roles, k) for k in singles), *roles.ablations]:
            if name and name not in regimes:
                raise ConfigError(f"{where}: {name!r} is not one of the regimes")
        return roles


def _per_task(runs: list[dict]) -> list[list[dict]]:
    return [r["heldout_after"].get("per_task", []) for r in runs]


def _paired(a: list[dict], b: list[dict]) -> PairedDifference:
    """Side a's runs minus side b's on the same held-out tasks (one run a side: the paired bootstrap)."""
    return compare_runs(_per_task(a), _per_task(b))


def _rate(runs: list[dict]) -> float:
    return sum(r["heldout_after"]["success_rate"] for r in runs) / len(runs)


def _online_real(runs: list[dict]) -> float:
    """Online real transitions a regime used, the mean over its runs (exact counts, infra/budget.py)."""
    return sum(r.get("transitions", {}).get("online_real", 0) for r in runs) / len(runs)


def _pts(d: PairedDifference) -> str:
    return f"{100 * d.diff:+.1f} [{100 * d.ci_low:+.1f}, {100 * d.ci_high:+.1f}] pts"


def _named(name: str, runs: list[dict]) -> str:
    return f"{name} {_rate(runs):.3f}" + (f" ({len(runs)} runs)" if len(runs) > 1 else "")


def _needs(*roles: tuple[str, list[dict]]) -> str:
    """Why a claim is not run: the regimes it compares that have no finished run (or no regime named)."""
    return "needs " + " and ".join(name or "a regime named for it" for name, runs in roles if not runs)


def _claim(n: int, text: str, status: str, detail: str, **figures: Any) -> dict:
    return {"target": n, "claim": text, "status": status, "detail": detail, **figures}


def check(roles: Roles, summaries: dict[str, list[dict]]) -> list[dict]:
    """The four claims on the finished runs in `summaries` (regime name -> its runs' summaries)."""
    def of(name: str) -> list[dict]:
        return (summaries.get(name) or []) if name else []

    dg, sft, real, s2r = of(roles.dreamgym), of(roles.sft), of(roles.real), of(roles.s2r)
    out = []

    text = f"{roles.dreamgym or 'DreamGym'}, no online real transition, >= {roles.sft or 'SFT'} + " \
           f"{100 * SFT_MARGIN:.0f} pts, paired interval above 0"
    if not (dg and sft):
        out.append(_claim(1, text, NOT_RUN, _needs((roles.dreamgym, dg), (roles.sft, sft))))
    else:
        d, online = _paired(dg, sft), _online_real(dg)
        ok = d.diff >= SFT_MARGIN - 1e-9 and d.ci_low > 0 and online == 0
        out.append(_claim(1, text, MET if ok else NOT_MET,
                          f"{_named(roles.dreamgym, dg)} vs {_named(roles.sft, sft)}: {_pts(d)}; "
                          f"{online:.0f} online real transitions", diff=d.diff, ci_low=d.ci_low, ci_high=d.ci_high))

    text = f"{roles.dreamgym or 'DreamGym'} >= {REAL_RATIO}x {roles.real or 'real-environment RL'}"
    if not (dg and real):
        out.append(_claim(2, text, NOT_RUN, _needs((roles.dreamgym, dg), (roles.real, real))))
    else:
        ratio = _rate(dg) / _rate(real) if _rate(real) > 0 else float("inf")
        d = _paired(dg, real)
        out.append(_claim(2, text, MET if ratio >= REAL_RATIO - 1e-9 else NOT_MET,
                          f"{_named(roles.dreamgym, dg)} vs {_named(roles.real, real)}: {ratio:.2f}x, paired {_pts(d)}",
                          ratio=ratio, diff=d.diff, ci_low=d.ci_low, ci_high=d.ci_high))

    text = f"{roles.s2r or 'sim-to-real'} > {roles.real or 'real-environment RL'} with <= " \
           f"{100 * S2R_SHARE:.0f} % of its real transitions"
    if not (s2r and real):
        out.append(_claim(3, text, NOT_RUN, _needs((roles.s2r, s2r), (roles.real, real))))
    else:
        d = _paired(s2r, real)
        mine, theirs = _online_real(s2r), _online_real(real)
        share = mine / theirs if theirs > 0 else float("inf")
        ok = d.diff > 0 and share <= S2R_SHARE + 1e-9
        interval = ("interval above 0" if d.ci_low > 0 else "point estimate only") if d.diff > 0 else \
            "level" if d.diff == 0 else "below"
        out.append(_claim(3, text, MET if ok else NOT_MET,
                          f"{_named(roles.s2r, s2r)} vs {_named(roles.real, real)}: {_pts(d)} ({interval}); "
                          f"{mine:.0f} real transitions, {100 * share:.1f} % of {roles.real}'s {theirs:.0f}",
                          diff=d.diff, ci_low=d.ci_low, ci_high=d.ci_high, share=share))

    text = f"each ablation ({', '.join(roles.ablations) or 'none named'}) below {roles.dreamgym or 'DreamGym'}"
    ran = [a for a in roles.ablations if of(a)]
    if not (dg and ran):
        out.append(_claim(4, text, NOT_RUN, _needs((roles.dreamgym, dg), *((a, of(a)) for a in roles.ablations))
                          if roles.ablations else "the experiment names no ablation"))
    else:
        diffs = {a: _paired(of(a), dg) for a in ran}
        above = [a for a in ran if diffs[a].diff >= 0]
        missing = [a for a in roles.ablations if a not in ran]
        status = NOT_MET if above else NOT_RUN if missing else MET
        parts = [f"{_named(a, of(a))}: {_pts(diffs[a])}" for a in ran]
        out.append(_claim(4, text, status, f"vs {_named(roles.dreamgym, dg)}: " + "; ".join(parts)
                          + (f"; not run: {', '.join(missing)}" if missing else "")
                          + (f"; not below: {', '.join(above)}" if above else ""),
                          diffs={a: {"diff": x.diff, "ci_low": x.ci_low, "ci_high": x.ci_high}
                                 for a, x in diffs.items()}))
    return out


def markdown_lines(claims: list[dict]) -> list[str]:
    """The claims as results.md's section."""
    if not claims:
        return []
    return ["", "## The paper's claims on this collection", "",
            *(f"{c['target']}. **{c['status']}**: {c['claim']}. {c['detail']}." for c in claims)]
