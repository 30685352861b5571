"""Losses: the clipped surrogate (PPO Eq. 2 / GRPO Eq. 3 objective), the k3 KL
penalty to a reference policy, and PPO's value loss.

Pure functions on padded [rows, tokens] tensors: a row is one trajectory, a column
one action token (in choice mode one token per step), `mask` 1 where a token
trains. Nothing here knows about models or streams.

Aggregation: "sequence" (the GRPO paper: mean over a trajectory's tokens, then over
trajectories) or "token" (one mean over every masked token, as DAPO). Rows with no
masked token are ignored by both. `is_weights` multiplies each token's surrogate
(truncated importance weights for stale trajectories; see learner/staleness.py).
The KL term uses Schulman's k3 estimator exp(ref - logp) - (ref - logp) - 1,
unbiased and non-negative, as GRPO does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLossOut:
    loss: torch.Tensor  # scalar to minimise (policy + kl_coef * kl)
    policy_loss: torch.Tensor
    kl: torch.Tensor  # aggregated k3 KL (0 when no reference)
    clip_fraction: torch.Tensor  # share of masked tokens whose ratio was clipped
    approx_kl_behaviour: torch.Tensor  # mean (old - new) log-prob over masked tokens


def masked_aggregate(x: torch.Tensor, mask: torch.Tensor, aggregate: str = "sequence",
                     row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of x over masked entries, per `aggregate` ("sequence" or "token"). "sequence" with
    `row_weights` [rows]: each row's mean times its weight, then the mean over rows (a piece of a
    trajectory split across micro-batches weighs its share of the trajectory's tokens)."""
    mask = mask.to(x.dtype)
    if aggregate == "token":
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    if aggregate == "sequence":
        per_row = mask.sum(-1)
        has = per_row > 0
        if not bool(has.any()):
            return (x * mask).sum()  # zero, still attached to the graph
        row_mean = (x * mask).sum(-1) / per_row.clamp(min=1.0)
        if row_weights is not None:
            row_mean = row_mean * row_weights.to(x.dtype)
        return row_mean[has].mean()
    raise ValueError(f"aggregate must be 'sequence' or 'token', got {aggregate!r}")


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_eps: float = 0.2, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                is_weights: torch.Tensor | None = None, aggregate: str = "sequence",
                row_weights: torch.Tensor | None = None) -> PolicyLossOut:
    """-E[min(r A, clip(r, 1-eps, 1+eps) A)] (+ kl_coef * KL), r = exp(logp - old_logp); `row_weights`
    as in `masked_aggregate`, on both terms."""
    old_logp, advantages = old_logp.detach(), advantages.detach()
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    if is_weights is not None:
        surrogate = surrogate * is_weights.detach()
    pl = -masked_aggregate(surrogate, mask, aggregate, row_weights)
    m = mask.to(logp.dtype)
    with torch.no_grad():
        was_clipped = ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)).to(logp.dtype)
        clip_frac = (was_clipped * m).sum() / m.sum().clamp(min=1.0)
        approx = ((old_logp - logp) * m).sum() / m.sum().clamp(min=1.0)
    if ref_logp is not None:
        kl = masked_aggregate(k3_kl(logp, ref_logp.detach()), mask, aggregate, row_weights)
    else:
        kl = torch.zeros((), dtype=logp.dtype, device=logp.device)
    loss = pl + kl_coef * kl if ref_logp is not None and kl_coef > 0 else pl
    return PolicyLossOut(loss, pl.detach(), kl.detach(), clip_frac, approx)


def value_loss(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, old_values: torch.Tensor | None = None,
               clip_eps: float | None = None, aggregate: str = "token") -> torch.Tensor:
    """0.5 * (V - R)^2 over masked entries; with old_values and clip_eps, PPO's clipped form (max of both)."""
    returns = returns.detach()
    err = (values - returns) ** 2
    if old_values is not None and clip_eps is not None:
        old_values = old_values.detach()
        v_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
        err = torch.maximum(err, (v_clipped - returns) ** 2)
    return 0.5 * masked_aggregate(err, mask, aggregate)
