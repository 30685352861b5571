"""The attention mask of a left-padded batch, shared by the engine's scoring and the learner's forwards.

Owns `left_padded_mask(real)`. Left padding puts every row's last real token in the same column,
which is the position the engine reads and the learner recomputes. A padding query, though, comes
before every real key: with a plain padding mask its attention row is empty. CUDA's bf16 attention
kernels answer an empty row with NaN, and although no loss reads a padding row, 0 x NaN in the
backward pass reaches every weight (the 2026-11-28 H200 lease: a bf16 update's gradient norm was
NaN; the CPU's kernels answer zeros, so no CPU run saw it). Here a padding query attends to itself.

Imports torch only when called, so a rollout worker that imports actors/policy.py loads no torch.
"""

from __future__ import annotations

from typing import Any


def left_padded_mask(real: Any) -> Any:
    """The boolean attention mask [n, 1, w, w] (True: may attend) of a left-padded batch whose real
    tokens are `real` [n, w] (bool): causal over the real keys, and each padding query on itself."""
    import torch  # the learner's and the engine's side only: workers never load torch

    cols = torch.arange(real.shape[1], device=real.device)
    causal = cols[None, :] <= cols[:, None]
    own = cols[None, :] == cols[:, None]
    return ((real[:, None, :] & causal[None]) | own[None])[:, None]
