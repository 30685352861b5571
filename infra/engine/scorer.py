"""The embedded engine's scoring queue: prefill log-probs of concurrent requests, batched.

Owns answering SGLang-style scoring requests (`max_new_tokens` 0, `return_logprob`,
`logprob_start_len`): a thread beside the decode loop takes every request waiting,
splits each into (shared prefix, continuations) items, and computes them together with
`batched_continuation_logprobs` (infra/engine/scoring.py), in chunks of at most
`batch_tokens` padded tokens (rows x (prefix width + continuation width): the key/value
memory of the continuation pass). A policy in score mode sends one such request per
episode step, so a worker running 32 episodes sends 32 at once.

Measured on an H200 with SmolLM2-135M in bf16 before this queue (each request ran its
own two forwards on a pool thread): 48 concurrent evaluation episodes made about 14
scoring requests a second, because an eager forward costs the same host time for one row
or hundreds. On the 2-core CPU the opposite holds: its forwards are compute-bound, and
one thread batching padded rows made 0.62x the requests/s of requests scored alone on
several threads (`benchmarks/engine_throughput.py --sections scoring`). So on the CPU
(`tree`) a batch runs as one token tree instead (`tree_continuation_logprobs`): the
requests of a GRPO group's episodes share the system prompt, the goal and the room (all
of it at the first step), and those tokens run once: 1.75x the requests/s of requests alone
on 4 threads for 16 concurrent requests in groups of 4 sharing a task, 1.09x for distinct
prompts (`benchmarks/engine_throughput.py --sections scoring --concurrency 16`). With
`batch_tokens` 0 the queue scores each request alone, on `ALONE_THREADS` threads, as the
engine did before.

On the CPU the tree also takes what earlier requests' prompts share with it from a prompt cache
(`cache_bytes`, engines.score_cache_mb; infra/engine/score_cache.py): an episode's next step
repeats most of its last prompt, which a tree of concurrent requests from different games cannot
share.

A chunk that fails (out of memory, a bug) is retried one request at a time, so a bad
request fails alone.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from infra.engine.request import EngineStopped
from infra.engine.score_cache import ScoreCache, cached_tree_logprobs
from infra.engine.scoring import batched_continuation_logprobs, tree_continuation_logprobs

log = logging.getLogger(__name__)

ALONE_THREADS = 4  # threads scoring requests one at a time when batching is off (the CPU's way)
GPU_BATCH_TOKENS = 65536  # the budget `engines.score_batch_tokens: -1` gives a CUDA engine (padded tokens)
CPU_TREE_TOKENS = 8192  # and a CPU engine (prompt tokens of one token tree: its mask is [L, L])


def use_threads(threads: int) -> int:
    """This thread's torch intra-op threads made `threads` (0: leave them); returns the count in force. Torch
    and OpenMP keep the count per thread, so an engine thread applies its own at the top of each round
    (cheap when it is unchanged)."""
    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def batch_budget(setting: int, device: torch.device) -> int:
    """`engines.score_batch_tokens` resolved for an engine on `device`: -1 is the device's own budget."""
    if setting >= 0:
        return setting
    return GPU_BATCH_TOKENS if device.type == "cuda" else CPU_TREE_TOKENS


@dataclass
class ScoreJob:
    """One request: its prompts, the position scoring starts at, and the future of (log-probs, version)."""

    prompts: list[list[int]]
    start: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def items(self) -> tuple[list[tuple[list[int], list[list[int]]]], list[list[int]]]:
        """(the (prefix, continuations) items, and for each item the prompt indices it answers)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(self.prompts):
            groups.setdefault(tuple(p[:self.start]), []).append(i)
        items = [(list(prefix), [self.prompts[i][self.start:] for i in members]) for prefix, members in groups.items()]
        return items, list(groups.values())


class Scorer:
    """Threads that answer queued ScoreJobs: one taking every waiting job in chunks of at most
    `batch_tokens` (padded tokens; with `tree`, prompt tokens of one token tree), or (0)
    ALONE_THREADS taking one job each. `current()` gives (model, weight version)."""

    def __init__(self, current: Callable[[], tuple[Any, int]], batch_tokens: int = 0, tree: bool = False,
                 cache_bytes: int = 0, on_cached: Callable[[int], None] | None = None):
        self.current = current
        self.batch_tokens = batch_tokens
        self.tree = tree
        # the tree's prompt cache (one scoring thread owns it); on_cached(n): n prompt tokens it answered
        self.cache = ScoreCache(cache_bytes) if tree and batch_tokens > 0 and cache_bytes > 0 else None
        self.on_cached = on_cached
        self._pending: list[ScoreJob] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self.threads = 0  # torch threads of each scoring thread (0: as started); Batcher.set_threads
        self.threads_in_force = 0  # as the last scoring round found them
        self.batches = 0  # forward pairs run (a request costs one when it runs alone)
        self.jobs = 0

    def start(self) -> None:
        for i in range(1 if self.batch_tokens > 0 else ALONE_THREADS):
            self._threads.append(threading.Thread(target=self._loop, name=f"engine-scorer-{i}", daemon=True))
            self._threads[-1].start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            pending, self._pending = self._pending, []
            self._cv.notify_all()
        for job in pending:
            _settle(job.future, exception=EngineStopped("engine stopped"))
        for t in self._threads:
            t.join(timeout=30)

    def submit(self, prompts: list[list[int]], start: int) -> concurrent.futures.Future:
        job = ScoreJob(prompts, start)
        with self._cv:
            if self._stopping:
                raise EngineStopped("engine stopped")
            self._pending.append(job)
            self._cv.notify_all()
        return job.future

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._stopping and not self._pending:
                    self._cv.wait()
                if self._stopping:
                    return
                if self.batch_tokens > 0:
                    jobs, self._pending = self._pending, []
                else:
                    jobs = [self._pending.pop(0)]
            self.threads_in_force = use_threads(self.threads)
            try:
                for chunk in self._chunks(jobs):
                    self._run(chunk)
            except Exception as exc:  # a bug here must not leave callers waiting forever
                log.exception("scoring %d requests failed", len(jobs))
                for job in jobs:
                    if not job.future.done():
                        _settle(job.future, exception=exc)

    def _chunks(self, jobs: list[ScoreJob]) -> list[list[ScoreJob]]:
        """Consecutive jobs whose `_size` stays within batch_tokens (a larger job runs alone)."""
        chunks: list[list[ScoreJob]] = []
        size = (0, 0)
        for job in jobs:
            grown = self._size(size, job)
            if chunks and grown[0] * grown[1] <= self.batch_tokens:
                chunks[-1].append(job)
                size = grown
            else:
                chunks.append([job])
                size = self._size((0, 0), job)
        return chunks

    def _size(self, size: tuple[int, int], job: ScoreJob) -> tuple[int, int]:
        """A chunk's size with `job` added, as (rows, width): padded, its rows and widest row; a tree,
        1 and its prompt tokens (each prefix once, then its continuations)."""
        rows, width = size
        if self.tree:
            return 1, width + job.start + sum(len(p) - job.start for p in job.prompts)
        return rows + len(job.prompts), max(width, max(len(p) for p in job.prompts))

    def _run(self, chunk: list[ScoreJob]) -> None:
        chunk = [job for job in chunk if not job.future.cancelled()]  # its caller gave up (a run's end)
        if not chunk:
            return
        model, version = self.current()
        try:
            answers = self._compute(model, version, chunk)
        except Exception as exc:
            if len(chunk) > 1:  # find the request that breaks it: each alone
                log.warning("a batch of %d scoring requests failed (%r); retrying them one by one", len(chunk), exc)
                for job in chunk:
                    self._run([job])
                return
            _settle(chunk[0].future, exception=exc)
            return
        for job, rows in zip(chunk, answers):
            _settle(job.future, result=(rows, version))

    def _compute(self, model: Any, version: int, chunk: list[ScoreJob]) -> list[list[list[float]]]:
        """Per job, per prompt: the log-probs of its tokens from `start` on."""
        items, owners = [], []
        for j, job in enumerate(chunk):
            its, members = job.items()
            items += its
            owners += [(j, m) for m in members]
        if self.cache is not None:
            self.cache.for_version(version)
            before = self.cache.hit_tokens
            lps = cached_tree_logprobs(model, items, self.cache)
            if self.on_cached is not None:
                self.on_cached(self.cache.hit_tokens - before)
        else:
            lps, _ = (tree_continuation_logprobs if self.tree else batched_continuation_logprobs)(model, items)
        out: list[list[list[float]]] = [[[] for _ in job.prompts] for job in chunk]
        for (j, members), per_item in zip(owners, lps):
            for i, lp in zip(members, per_item):
                out[j][i] = lp.tolist()
        with self._cv:  # several threads count when batching is off
            self.batches += 1
            self.jobs += len(chunk)
        return out


def _settle(future: concurrent.futures.Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Answer a job, unless its caller cancelled it meanwhile (then no one is waiting for the answer)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
