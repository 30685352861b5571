"""The running batch's KV cache: preallocated rows x columns, written in place, never re-concatenated.

Owns the memory layout the batcher decodes over. One tensor
`kv[layer, key|value, row, kv_head, column, head_dim]` holds every running sequence:
a row per sequence (rows 0..n-1 are live), and columns shared by all rows, so one
decode step writes one column for the whole batch. Sequences are right-aligned on
column `end` (left-padded); `mask[row, column]` says which cells hold a real token
and `pos[row]` is the position the row's next token takes, so the padding changes
nothing a sequence computes.

It stands in for transformers' `Cache` in a model's forward: attention layers call
`update(keys, values, layer_idx)`, which copies the new keys and values into the
window the batcher opened (`window`) and returns views of the columns to attend
over. No tensor grows per step: columns are allocated in doublings (a new buffer
only when `end` reaches the capacity, or when a joining prompt is longer than the
columns before `end`), and rows leave by moving the last rows down.

Departure from HF's StaticCache: the views cover only the live columns
`[lo, end)`, not the whole capacity, so attention costs what the batch holds.

Also owns the name a model's forward gives its KV cache: transformers 5.24 renamed the argument
and the output field `past_key_values` to `cache` (the old name warns until 5.40, which drops it),
and an older release would swallow `cache=` unread into its `**kwargs`. `cache_arg` / `returned_cache`
pass and read it under the installed release's name, for the engine and the learner alike.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import torch
from packaging.version import Version

# transformers >= 5.24 names a forward's KV cache `cache`; earlier releases `past_key_values`
CACHE_ARG = "cache" if Version(version("transformers")).release[:2] >= (5, 24) else "past_key_values"


def cache_arg(cache: Any) -> dict[str, Any]:
    """The keyword that hands `cache` to a model's forward, e.g. `model(ids, **cache_arg(kv))`."""
    return {CACHE_ARG: cache}


def returned_cache(out: Any) -> Any:
    """The KV cache a forward returned (`use_cache=True`)."""
    return getattr(out, CACHE_ARG)


def kv_geometry(model: Any) -> tuple[int, int, int, torch.dtype]:
    """(layers, kv_heads, head_dim, dtype) of a causal LM's KV cache, from its config and parameters."""
    cfg = model.config
    heads = cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    try:
        dtype = next(model.parameters()).dtype
    except (AttributeError, StopIteration):
        dtype = torch.float32
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, dim, dtype


def kv_bytes_per_token(model: Any) -> int:
    """Bytes one token's keys and values take over all of `model`'s layers."""
    layers, kv_heads, dim, dtype = kv_geometry(model)
    return layers * 2 * kv_heads * dim * torch.empty((), dtype=dtype).element_size()


class SlotCache:
    """KV for up to `rows` sequences; see the module docstring for the layout."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, rows: int, dtype: torch.dtype,
                 device: torch.device, cols: int = 256):
        self.shape = (layers, 2, rows, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.rows = rows
        self.kv = torch.zeros((layers, 2, rows, kv_heads, cols, head_dim), dtype=dtype, device=device)
        self.mask = torch.zeros((rows, cols), dtype=torch.bool, device=device)
        self.pos = torch.zeros(rows, dtype=torch.long, device=device)
        self._cols = cols
        self.n = 0  # live rows
        self.start = 0  # first column any live row uses
        self.end = 0  # one past the last written column
        self._win = (0, 0, 0, 0, 0)  # rows r0:r1, write columns c0:c1, attend from lo

    @property
    def cols(self) -> int:
        return self._cols

    @property
    def bytes_per_token(self) -> int:
        layers, two, _, heads, dim = self.shape
        return layers * two * heads * dim * self.kv.element_size()

    # --- the model's side ---
    def window(self, r0: int, r1: int, c0: int, c1: int, lo: int) -> None:
        """The next forward covers rows r0:r1, writes columns c0:c1 and attends over lo:c1."""
        self._win = (r0, r1, c0, c1, lo)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        r0, r1, c0, c1, lo = self._win
        layer = self.kv[layer_idx]
        layer[0, r0:r1, :, c0:c1].copy_(key_states)
        layer[1, r0:r1, :, c0:c1].copy_(value_states)
        return layer[0, r0:r1, :, lo:c1], layer[1, r0:r1, :, lo:c1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.end - self.start

    # --- the batcher's side ---
    def reset(self) -> None:
        self.n = self.start = self.end = 0

    def make_room(self, longest: int, extra_cols: int = 1) -> None:
        """Let new rows hold `longest` columns ending at `end`, with `extra_cols` free after `end`."""
        if self.n == 0:  # nothing to keep: start the columns afresh
            if longest + extra_cols > self.cols:
                self.kv = self.mask = None  # free before allocating the larger buffer
                self.kv = torch.zeros(self.shape[:4] + (max(longest + extra_cols, 2 * self._cols),) + self.shape[4:],
                                      dtype=self.dtype, device=self.device)
                self.mask = torch.zeros((self.rows, self.kv.shape[4]), dtype=torch.bool, device=self.device)
            self._cols = self.kv.shape[4]
            self.start = self.end = longest
            return
        shift = max(0, longest - self.end)
        need = self.end + shift + extra_cols
        if shift or need > self.cols:
            self._relayout(max(need, 2 * self.cols if need > self.cols else self.cols), shift)

    def ensure_free_column(self, count: int = 1) -> None:
        """Room for `count` more columns at `end` (the next decode step: 1, or 1 + drafts)."""
        if self.end + count > self.cols:
            if self.start >= self.cols // 2 and self.end - self.start + count <= self.cols:
                self._relayout(self.cols, -self.start)  # compact: most of the buffer is dead columns
            else:
                self._relayout(max(2 * self.cols, self.end - self.start + count), 0)

    def _relayout(self, cols: int, shift: int) -> None:
        """The live content moved by `shift` columns, into a new buffer of `cols` columns; in place when
        the size stays, so the buffer keeps its address (the decode step's CUDA graphs hold it)."""
        s, e = self.start, self.end
        if cols == self.cols:
            live, live_mask = self.kv[:, :, :self.n, :, s:e].clone(), self.mask[:self.n, s:e].clone()
            self.mask.zero_()
            self.kv[:, :, :self.n, :, s + shift:e + shift] = live
            self.mask[:self.n, s + shift:e + shift] = live_mask
            self.start, self.end = s + shift, e + shift
            return
        kv = torch.zeros(self.kv.shape[:4] + (cols,) + self.kv.shape[5:], dtype=self.dtype, device=self.device)
        mask = torch.zeros((self.rows, cols), dtype=torch.bool, device=self.device)
        if self.n and e > s:
            kv[:, :, :self.n, :, s + shift:e + shift] = self.kv[:, :, :self.n, :, s:e]
            mask[:self.n, s + shift:e + shift] = self.mask[:self.n, s:e]
        self.kv, self.mask, self._cols = kv, mask, cols
        self.start, self.end = s + shift, e + shift

    def put(self, row: int, start: int, pieces: list[torch.Tensor], count: int) -> None:
        """Copy the first `count` positions of the concatenated `pieces` into `row` from column `start`."""
        col = start
        for piece in pieces:
            if count <= 0:
                break
            k = min(count, piece.shape[-2])
            self.kv[:, :, row, :, col:col + k].copy_(piece[..., :k, :])
            col, count = col + k, count - k

    def live_columns(self, row: int, end: int) -> torch.Tensor:
        """The columns before `end` that hold `row`'s tokens, in order (rejected drafts leave holes)."""
        return self.mask[row, :end].nonzero()[:, 0]

    def take(self, row: int, columns: torch.Tensor) -> torch.Tensor:
        """A copy of `row`'s KV in `columns`, `[layers, 2, kv_heads, len(columns), head_dim]`."""
        return self.kv[:, :, row].index_select(3, columns)

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the live rows `keep` (ascending), moved down to rows 0..len(keep)-1."""
        s, e = self.start, self.end
        for dst, src in enumerate(keep):
            if dst != src:
                self.kv[:, :, dst, :, s:e] = self.kv[:, :, src, :, s:e]
                self.mask[dst, s:e] = self.mask[src, s:e]
                self.pos[dst] = self.pos[src]
        self.n = len(keep)
        if self.n == 0:
            self.reset()
            return
        used = self.mask[:self.n, s:e].any(dim=0)
        self.start = s + int(used.to(torch.uint8).argmax())  # first column any row still uses
