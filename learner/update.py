"""One GRPO/PPO update: the maths over a batch of training units, the policy and its optimizer.

Owns what one update computes, given units that learner/batching.py assembled and
filtered, and nothing about streams, acks, versions or checkpoints:

1. fixed inputs per trainable step: the old log-prob (the behaviour log-prob the
   worker recorded, or the current policy's "proximal" one for an importance-corrected
   trajectory, with its truncated IS weight, learner/staleness.py; in generate mode with
   `learner.logprob_temperature` != 1 the proximal one for every trajectory, read at that
   temperature, as verl trains the tempered policy that sampled) and the advantage
   (the trajectory's group-relative advantage for GRPO, learner/advantages.py; GAE over
   the value head's estimates for PPO);
2. for each of `epochs_per_batch` epochs and each of its `minibatches` mini-batches
   (whole units, `minibatch_bounds`; the fixed inputs of step 1 are not recomputed
   between them, so later mini-batches see ratios away from 1 and the clip works as
   in PPO): forward/backward over micro-batches of at most `micro_batch` steps (whole
   trajectories) and, with `micro_batch_tokens`, at most that many tokens (a label/score-mode
   trajectory cut between steps where it does not fit: memory bounded whatever the environment's
   prompts and candidates, `micro_batches`), each loss scaled by its share of the mini-batch so the
   accumulated gradient equals the unchunked one (tests/test_update.py checks it to
   1e-6), then clipping and one optimizer step;
   a non-finite loss or gradient raises before the step, non-finite weights after
   the last one (learner/guard.py: the learner undoes the update).
   A multi-turn trajectory is one packed sequence, one forward (learner/policy_model.py).

With `learner.num_gpus > 1` every FSDP rank runs this same update (learner/fsdp.py) with
a `share`: which of the micro-batches it runs (the others run them; it runs a zero-weighted
stand-in where it has fewer, so every rank makes the same forward/backward calls) and a
sum over ranks. The losses keep their share of the whole (mini-)batch and the ranks' gradients
are summed, so the reduced gradient is the single-process one; the old log-probs, the loss
terms and the non-finite checks are summed over ranks too, so every rank decides alike.

Only the tokens the policy wrote train. In label and score mode a step has one: its label
(or its chosen candidate as a whole), trainable when it carries the label, its behaviour
log-prob, the label set and the prompt; the policy is read at the step's sampling temperature
(`Step.temperature`), so a rollout sampled hotter trains the tempered policy that sampled it. In generate mode (issue 60) a step has as many as
the engine sampled for its reply (`loss_mask` 1), read from the trajectory's chats rebuilt
from their token ids (learner/token_logprobs.py): everything in step 1 is then per token,
the old log-prob, the truncated IS weight and the advantage (GRPO: the trajectory's on every
token; PPO: GAE over the steps' values, each step's advantage and return on each of its
tokens), and the clipped surrogate, its aggregation and the KL run over the same [rows,
tokens] tables as the one-token modes, so those give the numbers they always gave. The value
loss is per step (one value per step in every mode). A batch is in one mode (`plan` refuses a
mix). The losses are learner/losses.py. Departure from the paper: none here; see
learner/learner.py.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from actors.score_mode import split_choices
from infra import metrics
from infra.config import LearnerConfig
from infra.schema import Step, Trajectory
from learner.advantages import gae, step_advantages
from learner.guard import check_gradient, check_loss, check_weights
from learner.losses import policy_loss, value_loss
from learner.staleness import staleness, truncated_is_weight
from learner.token_logprobs import (TokenSequence, behaviour_logprobs, build_sequences, check_chat, is_generate_chat,
                                    trained_indices)


@dataclass
class Unit:
    """A batch unit: one GRPO group (or one PPO trajectory), as the update consumes it."""

    trajs: list[Trajectory]
    advantages: list[float] | None  # GRPO: one per trajectory; PPO: None (GAE at update time)
    corrected: list[bool]  # per trajectory: importance-corrected (too stale for the plain ratio)
    entry_ids: list[bytes] = field(default_factory=list)  # stream entries to ack once trained (learner/batching.py)


@dataclass
class UpdateStats:
    version: int
    loss: float
    policy_loss: float
    kl: float
    value_loss: float
    clip_fraction: float
    mean_reward: float
    success_rate: float
    trajectories: int
    steps: int
    groups: int
    mean_staleness: float
    seconds: float
    discarded: dict = field(default_factory=dict)  # outcome -> count since the previous update
    tokens: int = 0  # tokens through the model in the trained forward/backward passes (all epochs)
    action_tokens: int = 0  # tokens trained in the batch (one per step in label/score mode; the reply tokens in generate)
    resident_mb: float = 0.0  # the learner process's resident memory after the update, freed pages returned
    invalid_share: float | None = None  # generate mode: share of the trained steps whose reply named no legal action
    passes: int = 0  # forward/backward passes (all epochs and mini-batches): micro-batches, more under a token budget


@dataclass
class Row:
    """One trajectory's trainable steps and how they are weighted."""

    steps: list[Step]
    advantage: float | None
    corrected: bool
    traj: Trajectory
    share: float = 1.0  # its part of the trajectory's trained tokens (< 1: a piece, `micro_batches`)
    first: int = 0  # a piece's first step among the trajectory's trainable steps


@dataclass
class FixedInputs:
    """Per row, per trained token (one per step in label/score mode): old log-prob, importance weight,
    (advantage, return, value); in generate mode a step's (advantage, return, value) is on each of its tokens."""

    old: list[list[float]]
    isw: list[list[float]]
    adv: list[list[tuple[float, float, float]]]


class Share(Protocol):
    """One data-parallel rank's part of an update (learner/fsdp.RankShare); None: the whole update here."""

    def runs(self, chunks: Sequence[Sequence[int]]) -> list[tuple[Sequence[int], bool]]:
        """(micro-batch, counted) per forward this rank makes: its own micro-batches, then stand-ins
        (counted False: run with zero weight) until it makes as many calls as every other rank."""
        ...

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the ranks (a CPU tensor back)."""
        ...

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank."""
        ...


def _runs(chunks: Sequence[Sequence[int]], share: Share | None) -> list[tuple[Sequence[int], bool]]:
    return share.runs(chunks) if share is not None else [(c, True) for c in chunks]


def trainable_steps(traj: Trajectory) -> list[Step]:
    """Steps with a token that trains: a choice label with its behaviour log-prob, mask 1; in generate
    mode a step with a sampled token of mask 1, of a trajectory whose chats are well made
    (`token_logprobs.check_chat`; none of a trajectory that is not: the batcher sets it aside)."""
    if is_generate_chat(traj.steps):
        try:
            check_chat(traj.steps)
        except ValueError:
            return []
        return [s for s in traj.steps if trained_indices(s)]
    return [s for s in traj.steps if s.action_token_ids and s.logprobs and s.choice_token_ids and s.policy_prompt
            and (not s.loss_mask or int(s.loss_mask[0]) == 1)]


def is_generate(row: Row) -> bool:
    return is_generate_chat(row.traj.steps)


def step_tokens(row: Row) -> list[int]:
    """Trained tokens of each of the row's steps: 1 each in label/score mode."""
    if is_generate(row):
        return [len(trained_indices(s)) for s in row.steps]
    return [1] * len(row.steps)


def row_tokens(row: Row) -> int:
    return sum(step_tokens(row))


def sequences_of(rows: Sequence[Row]) -> list[TokenSequence]:
    """Generate mode: the rows' chats, in row order (learner/token_logprobs.py)."""
    return [q for r in rows if r.steps for q in build_sequences(r.traj.steps)]


def rows_of(units: Sequence[Unit]) -> list[Row]:
    return [Row(trainable_steps(t), u.advantages[i] if u.advantages is not None else None, u.corrected[i], t)
            for u in units for i, t in enumerate(u.trajs)]


def chunks_of(rows: Sequence[Row], micro_batch: int) -> list[list[int]]:
    """Row indices per micro-batch: at most `micro_batch` steps each (a longer trajectory goes alone)."""
    chunks: list[list[int]] = []
    cur: list[int] = []
    n = 0
    for i, r in enumerate(rows):
        if cur and n + len(r.steps) > micro_batch:
            chunks.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += len(r.steps)
    if cur:
        chunks.append(cur)
    return chunks


def step_costs(policy: Any, rows: Sequence[Row]) -> list[list[int]]:
    """Tokens each step's forward runs through the policy, which a micro-batch's activations grow with:
    its prompt's and its candidates' (score mode) or 1 label (label mode); a generate-mode trajectory's
    chats all on its first step (one packed sequence, never cut)."""
    out = []
    for r in rows:
        if is_generate(r):
            out.append([sum(len(q.ids) for q in sequences_of([r]))] + [0] * (len(r.steps) - 1))
            continue
        out.append([len(policy.tokenizer(s.policy_prompt, add_special_tokens=False)["input_ids"])
                    + (len(s.choice_token_ids) if s.choice_lengths else 1) for s in r.steps])
    return out


def micro_batches(rows: Sequence[Row], micro_batch: int, budget: int = 0,
                  costs: Sequence[Sequence[int]] | None = None) -> tuple[list[Row], list[list[int]], list[int]]:
    """An update's forward/backward passes: (pieces, the pieces' indices per pass, each piece's row).

    Without a token `budget` the pieces are the rows, whole, at most `micro_batch` steps a pass
    (`chunks_of`). With one (`learner.micro_batch_tokens`), a pass also runs at most `budget` tokens
    (`costs`: `step_costs`), and a label/score-mode trajectory that does not fit is cut between steps:
    each piece is a Row of some of its steps that weighs its `share` of the trajectory in a
    'sequence' loss (learner/losses.py), so the accumulated gradient is the uncut one. A
    generate-mode trajectory (one packed sequence) goes whole, alone if it is over the budget; so
    does a single step over it."""
    if not budget:
        return list(rows), chunks_of(rows, micro_batch), list(range(len(rows)))
    assert costs is not None, "a token budget needs the steps' costs"
    pieces: list[Row] = []
    origin: list[int] = []
    chunks: list[list[int]] = []
    cur: list[int] = []
    n = tok = 0  # steps and tokens in the pass being filled

    def close() -> None:
        nonlocal cur, n, tok
        if cur:
            chunks.append(cur)
        cur, n, tok = [], 0, 0

    def add(i: int, a: int, b: int, t: int) -> None:
        nonlocal n, tok
        r = rows[i]
        whole = a == 0 and b == len(r.steps)
        pieces.append(r if whole else Row(r.steps[a:b], r.advantage, r.corrected, r.traj, (b - a) / len(r.steps), a))
        origin.append(i)
        cur.append(len(pieces) - 1)
        n, tok = n + b - a, tok + t

    for i, r in enumerate(rows):
        c = costs[i]
        if is_generate(r) or not r.steps:
            if cur and (n + len(r.steps) > micro_batch or tok + sum(c) > budget):
                close()
            add(i, 0, len(r.steps), sum(c))
            continue
        a = 0
        while a < len(r.steps):
            b, t = a, 0
            while b < len(r.steps) and n + b - a < micro_batch and tok + t + c[b] <= budget:
                t, b = t + c[b], b + 1
            if b == a and cur:  # nothing more fits this pass
                close()
                continue
            if b == a:  # one step over the budget runs alone
                b, t = a + 1, c[a]
            add(i, a, b, t)
            a = b
    close()
    return pieces, chunks, origin


def piece_inputs(fixed: FixedInputs, pieces: Sequence[Row], origin: Sequence[int]) -> FixedInputs:
    """The rows' fixed inputs cut as `micro_batches` cut the rows (a piece: its steps' tokens, one a step)."""
    out = FixedInputs([], [], [])
    for p, i in zip(pieces, origin):
        a, b = p.first, p.first + row_tokens(p)
        out.old.append(fixed.old[i][a:b])
        out.isw.append(fixed.isw[i][a:b])
        out.adv.append(fixed.adv[i][a:b])
    return out


def minibatch_bounds(units: Sequence[Unit], n: int) -> list[tuple[int, int]]:
    """Row ranges [start, end) of `n` mini-batches of whole units, as equal in units as can be
    (fewer when there are fewer units); rows are in `rows_of` order."""
    n = max(1, min(n, len(units)))
    sizes = [len(u.trajs) for u in units]
    bounds, row, k = [], 0, 0
    for i in range(n):
        take = len(units) // n + (1 if i < len(units) % n else 0)
        end = row + sum(sizes[k:k + take])
        bounds.append((row, end))
        row, k = end, k + take
    return bounds


def choice_args(steps: Sequence[Step]) -> tuple[list[str], list, list]:
    """(prompts, choices, chosen) for `forward_choice`: label ids and the chosen label, or, in score
    mode (`choice_lengths`), the candidates' token lists and the chosen candidate's index."""
    prompts, choices, chosen = [], [], []
    for s in steps:
        prompts.append(s.policy_prompt)
        if s.choice_lengths:
            cands = split_choices(s.choice_token_ids, s.choice_lengths)
            if list(s.action_token_ids) not in cands:
                raise ValueError("score-mode step: its action tokens are not one of its candidates")
            choices.append(cands)
            chosen.append(cands.index(list(s.action_token_ids)))
        else:
            choices.append(s.choice_token_ids)
            chosen.append(s.action_token_ids[0])
    if len({bool(s.choice_lengths) for s in steps}) > 1:
        raise ValueError("a batch mixes label-mode and score-mode steps")
    return prompts, choices, chosen


def choice_temperatures(steps: Sequence[Step]) -> list[float] | None:
    """Label and score mode: each step's sampling temperature, the one its behaviour log-prob is at
    (Step.temperature), so the policy is read at it and an update's first ratio is 1 whatever the
    rollout temperature (learner.s2r_temperature's real phase samples hotter than the DreamGym phase
    before it, so one setting could not fit both); None when every step sampled at 1."""
    temps = [float(s.temperature) for s in steps]
    return temps if any(t != 1.0 for t in temps) else None


def _generate_rows(rows: Sequence[Row]) -> bool:
    return any(is_generate(r) for r in rows if r.steps)


def _forward(policy: Any, rows: Sequence[Row], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of every trained token [T], value of every step [S] or None), rows in order; generate
    mode's log-probs at `temperature` (learner.logprob_temperature)."""
    if _generate_rows(rows):
        return policy.forward_tokens(sequences_of(rows), temperature)
    steps = [s for r in rows for s in r.steps]
    return policy.forward_choice(*choice_args(steps), temperatures=choice_temperatures(steps))


def _reference(policy: Any, rows: Sequence[Row], temperature: float = 1.0) -> torch.Tensor:
    if _generate_rows(rows):
        return policy.reference_token_logprobs(sequences_of(rows), temperature)
    steps = [s for r in rows for s in r.steps]
    return policy.reference_logprobs(*choice_args(steps), temperatures=choice_temperatures(steps))


def _pad(sizes: Sequence[int], flat: torch.Tensor) -> torch.Tensor:
    """[sum(sizes)] -> [rows, largest size], zero-padded."""
    out = flat.new_zeros((len(sizes), max(sizes)))
    k = 0
    for i, n in enumerate(sizes):
        out[i, :n] = flat[k:k + n]
        k += n
    return out


def proximal(policy: Any, rows: Sequence[Row], chunks: Sequence[Sequence[int]],
             share: Share | None = None, temperature: float = 1.0) -> tuple[list[float], list[float]]:
    """The current policy's log-prob of every trained token (generate mode: at `temperature`) and value
    (0 without a value head) of every step, each in row order, no grad."""
    tok = list(itertools.accumulate((row_tokens(r) for r in rows), initial=0))
    stp = list(itertools.accumulate((len(r.steps) for r in rows), initial=0))
    out = torch.zeros(tok[-1] + stp[-1], dtype=torch.float64)  # the log-probs, then the values
    for idx, counted in _runs(chunks, share):
        with torch.no_grad():
            lp, v = _forward(policy, [rows[i] for i in idx], temperature)
        if counted:
            lp = lp.double().cpu()
            v = v.double().cpu() if v is not None else None
            k = j = 0
            for i in idx:
                n, m = row_tokens(rows[i]), len(rows[i].steps)
                out[tok[i]:tok[i] + n] = lp[k:k + n]
                if v is not None:
                    out[tok[-1] + stp[i]:tok[-1] + stp[i] + m] = v[j:j + m]
                k, j = k + n, j + m
    if share is not None:
        out = share.sum(out)
    return out[:tok[-1]].tolist(), out[tok[-1]:].tolist()


def fixed_inputs(policy: Any, cfg: LearnerConfig, rows: Sequence[Row], chunks: Sequence[Sequence[int]],
                 share: Share | None = None, pieces: Sequence[Row] | None = None) -> FixedInputs:
    """Old log-probs, importance weights and advantages of every row, computed once before the epochs;
    `chunks` index `pieces` (`micro_batches`: the rows in order, some cut; default the rows themselves).

    With `learner.logprob_temperature` T != 1 (generate mode) the update trains the tempered policy:
    every row's old log-probs are the current policy's at T (the engine's are at 1, so they cannot
    be), and a corrected row's truncated IS weight compares the current policy's log-probs at 1 with
    the engine's, as without T."""
    fixed = FixedInputs([], [], [])
    temp = cfg.logprob_temperature
    lp = vals = lp1 = None
    corrected = any(r.corrected for r in rows)
    if corrected or cfg.algo == "ppo" or temp != 1.0:
        run = pieces if pieces is not None else rows  # in row order, so their tokens and steps are the rows'
        lp, vals = proximal(policy, run, chunks, share, temp)
        lp1 = proximal(policy, run, chunks, share)[0] if temp != 1.0 and corrected else lp
    k = j = 0  # the row's first token, its first step
    for r in rows:
        n, m, per_step = row_tokens(r), len(r.steps), step_tokens(r)
        mu = behaviour_logprobs(r.steps) if is_generate(r) else [float(s.logprobs[0]) for s in r.steps]
        if r.corrected:
            fixed.old.append(lp[k:k + n])
            fixed.isw.append([truncated_is_weight(p, b, cfg.is_cap) for p, b in zip(lp1[k:k + n], mu)])
        else:
            fixed.old.append(lp[k:k + n] if temp != 1.0 else mu)
            fixed.isw.append([1.0] * n)
        if cfg.algo == "ppo":
            a, ret = gae([float(s.reward) for s in r.steps], vals[j:j + m], cfg.gamma, cfg.gae_lambda)
            fixed.adv.append([t for t, c in zip(zip(a, ret, vals[j:j + m]), per_step) for _ in range(c)])
        else:
            a = step_advantages(r.advantage, [bool(s.valid) for s in r.steps], cfg.invalid_advantage == "never_positive")
            fixed.adv.append([(x, 0.0, 0.0) for x, c in zip(a, per_step) for _ in range(c)])
        k, j = k + n, j + m
    return fixed


def _first_tokens(row: Row) -> list[int]:
    """Index of each step's first trained token within the row's tokens."""
    return list(itertools.accumulate(step_tokens(row), initial=0))[:-1]


def accumulate_gradients(policy: Any, cfg: LearnerConfig, rows: Sequence[Row], chunks: Sequence[Sequence[int]],
                         fixed: FixedInputs, share: Share | None = None) -> dict[str, float]:
    """One epoch's backward passes over every micro-batch (this rank's, with a `share`), gradients
    summed into `.grad`; the loss terms (of the whole batch: summed over ranks). `rows` may be
    `micro_batches`' pieces, with `piece_inputs`: a piece counts as its share of a trajectory."""
    total_rows = sum(r.share for r in rows if r.steps)
    total_tokens = sum(row_tokens(r) for r in rows)
    total_steps = sum(len(r.steps) for r in rows)
    sums = {"loss": 0.0, "pl": 0.0, "kl": 0.0, "vl": 0.0, "clip": 0.0, "tokens": 0}
    for idx, counted in _runs(chunks, share):
        part = [rows[i] for i in idx]
        logp_flat, v_flat = _forward(policy, part, cfg.logprob_temperature)
        tokens = int(getattr(policy, "last_tokens", 0))
        sizes = [row_tokens(r) for r in part]
        logp = _pad(sizes, logp_flat)
        mask = _pad(sizes, torch.ones_like(logp_flat))

        def table(src: list, j: int | None = None) -> torch.Tensor:
            flat = [x if j is None else x[j] for i in idx for x in src[i]]
            return _pad(sizes, torch.tensor(flat, dtype=logp.dtype, device=logp.device))

        ref = _pad(sizes, _reference(policy, part, cfg.logprob_temperature)) if cfg.kl_coef > 0 else None
        cut = any(r.share != 1.0 for r in part)
        out = policy_loss(logp, table(fixed.old), table(fixed.adv, 0), mask, cfg.clip_eps, ref, cfg.kl_coef,
                          table(fixed.isw), cfg.aggregate,
                          torch.tensor([r.share for r in part], dtype=logp.dtype, device=logp.device) if cut else None)
        w = len(logp_flat) / total_tokens
        scale = (sum(1 for r in part if r.steps) / total_rows) if cfg.aggregate == "sequence" else w
        loss = out.loss * scale
        vl = torch.zeros((), device=logp.device)
        w_steps = len(v_flat) / total_steps if v_flat is not None else 0.0
        if cfg.algo == "ppo" and v_flat is not None:  # per step: each step's return and old value, once
            steps = [len(r.steps) for r in part]

            def step_table(j: int) -> torch.Tensor:
                flat = [fixed.adv[i][k][j] for i in idx for k in _first_tokens(rows[i])]
                return _pad(steps, torch.tensor(flat, dtype=logp.dtype, device=logp.device))

            vl = value_loss(_pad(steps, v_flat), step_table(1), _pad(steps, torch.ones_like(v_flat)), step_table(2),
                            cfg.clip_eps)
            loss = loss + cfg.value_coef * vl * w_steps
        if not counted:  # a stand-in: the same collectives as a real micro-batch, no gradient
            (loss * 0.0).backward()
            continue
        loss.backward()
        sums["tokens"] += tokens
        sums["loss"] += float(loss.detach())
        sums["pl"] += float(out.policy_loss) * scale
        sums["kl"] += float(out.kl) * scale
        sums["vl"] += float(vl.detach()) * w_steps
        sums["clip"] += float(out.clip_fraction) * w
    if share is not None:
        total = share.sum(torch.tensor(list(sums.values()), dtype=torch.float64)).tolist()
        sums = {k: (int(v) if k == "tokens" else v) for k, v in zip(sums, total)}
    return sums


def new_optimizer(policy: Any, cfg: LearnerConfig) -> torch.optim.Optimizer:
    """The learner's AdamW over the trainable parameters (on every FSDP rank, over its shards)."""
    return torch.optim.AdamW(policy.trainable_parameters(), lr=cfg.lr, weight_decay=0.0)


def export_rewards(trajs: Sequence[Trajectory]) -> None:
    """Mean and (population) variance of the batch's episode rewards, per environment kind."""
    by_kind: dict[str, list[float]] = {}
    for t in trajs:
        by_kind.setdefault(t.env_kind.value, []).append(float(t.total_reward))
    for kind, rewards in by_kind.items():
        mean = sum(rewards) / len(rewards)
        metrics.LEARNER_REWARD_MEAN.labels(env_kind=kind).set(mean)
        metrics.LEARNER_REWARD_VARIANCE.labels(env_kind=kind).set(sum((r - mean) ** 2 for r in rewards) / len(rewards))


def plan(units: Sequence[Unit], cfg: LearnerConfig,
         vocab: int | None = None) -> tuple[list[Row], list[tuple[int, int]]]:
    """The update's rows and the row ranges of its mini-batches (those with a trainable step).

    Raises the ValueError a micro-batch's `choice_args` would (a score-mode step whose action is not
    one of its candidates, a micro-batch mixing label and score mode), or one for a batch mixing
    generate-mode trajectories with label/score ones or a generate-mode trajectory whose chats are
    not well made (`token_logprobs.check_chat`: a log-prob per sampled id, a first step opening a
    chat with its prompt ids), before any forward pass, and with `vocab` the IndexError of a token
    id beyond it (the schema lets any uint32 through): with FSDP ranks (learner/fsdp.py) no rank
    may fail alone between two collectives."""
    rows = rows_of(units)
    bounds = [(a, b) for a, b in minibatch_bounds(units, cfg.minibatches) if any(r.steps for r in rows[a:b])]
    generate = [is_generate(r) for r in rows]
    if any(generate) and not all(generate):
        raise ValueError("a batch mixes generate-mode trajectories with label/score-mode ones")
    if any(generate):
        for r in rows:
            check_chat(r.traj.steps, vocab)
        return rows, bounds
    parts = [rows] + [rows[a:b] for a, b in bounds]
    for part in parts:
        for idx in chunks_of(part, cfg.micro_batch):
            choice_args([s for i in idx for s in part[i].steps])
    if cfg.micro_batch_tokens:  # a token budget's passes meet other steps than chunks_of's: all must fit together
        choice_args([s for r in rows for s in r.steps])
    if vocab is not None:
        top = max((int(t) for r in rows for s in r.steps for t in (*s.choice_token_ids, *s.action_token_ids)),
                  default=0)
        if top >= vocab:
            raise IndexError(f"token id {top} is beyond the policy's vocabulary of {vocab}")
    return rows, bounds


def apply_update(policy: Any, optimizer: torch.optim.Optimizer, cfg: LearnerConfig, units: Sequence[Unit],
                 version: int, share: Share | None = None) -> UpdateStats:
    """Train `policy` on `units` (the learner is at weight `version`); the stats of this update.
    `share`: this FSDP rank's part (learner/fsdp.py; every rank calls this with the same units)."""
    rows, bounds = plan(units, cfg)
    policy.train()
    budget = cfg.micro_batch_tokens
    costs = step_costs(policy, rows) if budget else None
    pieces, chunks, _ = micro_batches(rows, cfg.micro_batch, budget, costs)
    fixed = fixed_inputs(policy, cfg, rows, chunks, share, pieces)
    sums = dict.fromkeys(("loss", "pl", "kl", "vl", "clip"), 0.0)
    params = policy.trainable_parameters()
    tokens = passes = 0
    steps = cfg.epochs_per_batch * len(bounds)
    for _ in range(cfg.epochs_per_batch):
        for a, b in bounds:
            pieces, chunks, origin = micro_batches(rows[a:b], cfg.micro_batch, budget, costs[a:b] if costs else None)
            optimizer.zero_grad(set_to_none=True)
            out = accumulate_gradients(policy, cfg, pieces, chunks, piece_inputs(
                FixedInputs(fixed.old[a:b], fixed.isw[a:b], fixed.adv[a:b]), pieces, origin), share)
            tokens += int(out.pop("tokens", 0))
            passes += len(chunks)
            check_loss(out["loss"])  # before the step: a NaN never reaches the weights (learner/guard.py)
            check_gradient(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            for k, v in out.items():
                sums[k] += v / steps
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    check_weights(params, share.any if share is not None else None)
    trajs = [r.traj for r in rows]
    mean_reward = sum(t.total_reward for t in trajs) / len(trajs)
    lags = [staleness(t.policy_version, version) for t in trajs]
    metrics.LEARNER_LOSS.set(sums["loss"])
    metrics.LEARNER_KL.set(sums["kl"])
    metrics.LEARNER_CLIP_FRACTION.set(sums["clip"])
    metrics.LEARNER_MEAN_REWARD.set(mean_reward)
    export_rewards(trajs)
    metrics.LEARNER_TOKENS.inc(tokens)
    return UpdateStats(version=version, loss=sums["loss"], policy_loss=sums["pl"], kl=sums["kl"],
                       value_loss=sums["vl"], clip_fraction=sums["clip"], mean_reward=mean_reward,
                       success_rate=sum(1 for t in trajs if t.success) / len(trajs), trajectories=len(trajs),
                       steps=sum(len(r.steps) for r in rows), groups=len(units),
                       mean_staleness=sum(lags) / len(lags), seconds=0.0, tokens=tokens,
                       action_tokens=sum(row_tokens(r) for r in rows), invalid_share=invalid_share(rows),
                       passes=passes)


def invalid_share(rows: Sequence[Row]) -> float | None:
    """The share of the rows' steps whose reply named no legal action (a format drifting shows here, update by
    update); None outside generate mode, where no step carries a reply."""
    steps = [s for r in rows for s in r.steps]
    if not any(s.reply for s in steps):
        return None
    return sum(1 for s in steps if s.invalid_reason) / len(steps)
