"""The embedded engine's plain decode step as CUDA graphs, one per batch-size bucket.

Owns `DecodeGraphs`: what the batcher calls instead of an eager forward for a decode step that
feeds one token per row (no speculative drafts). On a GPU a 135M model's eager step is bound by
kernel launches, about 80 ms at any batch on the H100 (../shared/FACTS.md), where the same step
replayed as a CUDA graph took 5.5 ms at batch 64 (../shared/bench/gpu_decode_diag.py).

A graph replays fixed shapes and addresses, so the step it captures departs from the eager
one (`Batcher._decode_step`) in three ways, none of which changes what a live row computes:
- rows are padded up to a bucket (1, 2, 4, ... up to the batch size); a padding row feeds the
  pad token, attends to the one column it writes (no empty softmax row: bf16 kernels answer NaN
  there, infra/engine/padding.py), and its logits are dropped;
- attention covers every column of the slot cache's buffer, not only the live window, with the
  cache's own mask saying which cells hold a token;
- the new keys and values are written at a column held in a device tensor (`index_copy_`), not
  by slicing with Python integers that the capture would freeze.

Every input a replay reads is copied into static buffers first (token ids, positions, the mask,
the column), and the captured function reads only them, so `mode='eager'` runs the very same
function without capturing it: that is how the CPU tests check this step against the batcher's
(token for token, log-probs within 1e-4). Graphs are kept per bucket for one cache buffer and
one model: a new buffer (the slot cache grew) or a weight swap drops them, and they are captured
again when next used. A capture that fails logs once and turns the graphs off; the eager step
goes on serving.
"""

from __future__ import annotations

import logging

import torch

from infra.engine.kv import SlotCache, cache_arg
from infra.metrics import EngineServerMetrics

log = logging.getLogger(__name__)

def buckets(max_rows: int) -> list[int]:
    """Batch sizes a graph is captured for: powers of two below `max_rows`, and `max_rows` itself."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    return out + [max_rows]


class _ColumnWriter:
    """Stands in for transformers' Cache in the captured forward: writes the step's keys and values
    at column `col` (a device tensor) of rows 0..rows-1 and attends over the whole buffer."""

    def __init__(self, slots: SlotCache, rows: int, col: torch.Tensor):
        self.slots, self.rows, self.col = slots, rows, col

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.slots.kv[layer_idx]
        keys, values = layer[0, :self.rows], layer[1, :self.rows]
        keys.index_copy_(2, self.col, key_states)
        values.index_copy_(2, self.col, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.slots.cols


class DecodeGraphs:
    """One decode step per batch-size bucket over a `SlotCache`, replayed as a CUDA graph ('cuda')
    or run eagerly from the same static buffers ('eager', the CPU tests' mode)."""

    def __init__(self, model, pad_id: int, max_rows: int, mode: str, metrics: EngineServerMetrics):
        if mode not in ("eager", "cuda"):
            raise ValueError(f"decode graph mode must be 'eager' or 'cuda', got {mode!r}")
        self.model, self.pad_id, self.mode = model, pad_id, mode
        self.buckets = buckets(max_rows)
        self.enabled = True
        self.metrics = metrics  # engine_decode_graph_steps_total and _captures_total
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket: (graph, its logits)
        self._kv: torch.Tensor | None = None  # the cache buffer the graphs write (held: its address stays theirs)
        self._pool = None

    def reset(self, model) -> None:
        """Serve `model` (the weights were swapped): every graph is captured again."""
        self.model, self._graphs, self._kv = model, {}, None

    def step(self, slots: SlotCache, next_ids: torch.Tensor, n: int) -> torch.Tensor | None:
        """Logits [n, vocab] (float) of one decode step that writes column `slots.end`, whose mask
        cells the caller has set; None when the graphs are off (the caller runs the eager step)."""
        if not self.enabled:
            return None
        rows = next(b for b in self.buckets if b >= n)
        self._bind(slots)
        end = slots.end
        self.ids[:n, 0].copy_(next_ids)
        self.ids[n:rows].fill_(self.pad_id)
        self.pos[:n, 0].copy_(slots.pos[:n])
        self.pos[n:rows].zero_()
        self.mask[:n, 0, 0].copy_(slots.mask[:n])
        self.mask[n:rows].zero_()
        self.mask[n:rows, 0, 0, end] = True
        self.col.fill_(end)
        if self.mode == "eager":
            logits = self._forward(slots, rows)
        else:
            if rows not in self._graphs:
                try:
                    self._graphs[rows] = self._capture(slots, rows)
                except Exception:
                    log.exception("capturing the decode step as a CUDA graph failed; the engine decodes eagerly from now on")
                    self.enabled, self._graphs = False, {}
                    return None
            graph, logits = self._graphs[rows]
            graph.replay()
        self.metrics.graph_steps.inc()
        return logits[:n]

    def _bind(self, slots: SlotCache) -> None:
        """Static buffers sized for this cache buffer; a new buffer drops the graphs."""
        if slots.kv is self._kv:
            return
        self._graphs, self._kv = {}, slots.kv
        rows, dev = slots.rows, slots.device
        self.ids = torch.full((rows, 1), self.pad_id, dtype=torch.long, device=dev)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=dev)
        self.mask = torch.zeros((rows, 1, 1, slots.cols), dtype=torch.bool, device=dev)
        self.col = torch.zeros(1, dtype=torch.long, device=dev)

    def _forward(self, slots: SlotCache, rows: int) -> torch.Tensor:
        """The step itself: reads only the static buffers and the cache buffer, so it can be captured."""
        out = self.model(input_ids=self.ids[:rows], attention_mask=self.mask[:rows], position_ids=self.pos[:rows],
                         use_cache=True, logits_to_keep=1,
                         **cache_arg(_ColumnWriter(slots, rows, self.col)))
        return out.logits[:, -1, :].float()

    def _capture(self, slots: SlotCache, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (this step's inputs: its writes are the right ones), then capture."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=slots.device)
        side.wait_stream(torch.cuda.current_stream(slots.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(slots, rows)
        torch.cuda.current_stream(slots.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the scoring thread may run forwards on the same device meanwhile (infra/engine/scorer.py)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._forward(slots, rows)
        self.metrics.graph_captures.inc()
        log.info("captured the decode step for batch %d over %d columns (%d graphs)", rows, slots.cols, len(self._graphs) + 1)
        return graph, logits
