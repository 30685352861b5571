"""Prompt-lookup drafts for the embedded engine's speculative decoding (greedy requests only).

Owns proposing draft tokens for a sequence and counting how many of them the model accepts.
An Mexp reply is mostly a copy of the current state in its prompt (the next state changes a
line or two of it), so the tokens that followed the reply's last n-gram where that n-gram last
occurred in prompt + reply are a good guess of what comes next ("prompt lookup decoding";
SGLang and vLLM ship it as n-gram speculative decoding). The batcher (infra/engine/batcher.py)
feeds every row's next token and its k drafts in one forward of k + 1 positions and keeps the
longest run of drafts that the model's own greedy choices agree with, then the model's next
token: the output is the greedy output, token for token, whatever the drafts were.

It pays where a forward costs about the same for 1 and k + 1 tokens a row: a GPU's host-bound
eager decode step (72-83 ms at any batch from 1 to 256, ../shared/FACTS.md), or a CPU with few
rows. On a CPU with a full batch the k extra positions cost compute the accepted tokens may not
repay: `engines.speculative_tokens` is off by default (docs/performance.md has the figures).
"""

from __future__ import annotations

from typing import Sequence

NGRAM_SIZES = (3, 2)  # the longest match first; a single token matches too often to be a good guess


class NgramIndex:
    """For one growing sequence: where each n-gram last occurred with a token after it."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.seq: list[int] = []
        self._follower: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its last occurrence
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.seq)

    def extend(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            self.seq.append(tok)
            last = len(self.seq) - 1  # the new token follows the n-grams that end just before it
            for n in NGRAM_SIZES:
                if last >= n:
                    self._follower[tuple(self.seq[last - n:last])] = last

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the sequence's last n-gram."""
        if k <= 0:
            return []
        for n in NGRAM_SIZES:
            if len(self.seq) > n:
                at = self._follower.get(tuple(self.seq[-n:]))
                if at is not None:
                    return self.seq[at:at + k]
        return []


def accepted(greedy: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts equal the model's greedy choice at their position (greedy[i] is the
    model's choice for the position of drafts[i])."""
    j = 0
    while j < len(drafts) and greedy[j] == drafts[j]:
        j += 1
    return j
