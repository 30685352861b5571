"""Services: the engines `dreamgym train` embeds, on real parts (the tiny random Llama, a real Redis).

`engines.mexp_replicas` starts that many Mexp engines sharing one loaded model, and the client
spreads episodes over them; `engine_threads` gives a role's engines every core for a block (a
held-out evaluation) and their own count back after it.
"""

from __future__ import annotations

import asyncio
import os

from infra.config import load_config
from infra.run.services import Services


async def test_mexp_replicas_share_the_model_and_each_serves_episodes(tiny_run, tiny_dir):
    cfg = load_config(None, [*tiny_run, "engines.mexp_replicas=2"])
    async with Services(cfg, "replicas") as svc:
        await svc.start_engines(str(tiny_dir), str(tiny_dir))
        mexp, policy = svc.embedded["mexp"], svc.embedded["policy"]
        assert len(mexp) == 2 and len(svc.mexp.urls) == 2 and len(policy) == 1
        assert mexp[0].batcher.model is mexp[1].batcher.model  # loaded once
        sp = {"max_new_tokens": 2, "temperature": 0.0}
        # requests at once go to the least busy engine: both serve
        await asyncio.gather(*(svc.mexp.generate(f"State: room {i}\nAction: look\nNext state:", sampling_params=sp)
                               for i in range(8)))
        assert [h.batcher.requests_total for h in mexp] == [4, 4]
        for _ in range(3):  # an episode's requests stay on one engine (its prefix cache)
            await svc.mexp.generate("State: a room\nAction: look\nNext state:", affinity_key="episode-1",
                                    sampling_params=sp)
        assert sorted(h.batcher.requests_total for h in mexp) == [4, 7]


async def test_an_evaluation_runs_the_policy_engine_on_every_core_then_gives_them_back(tiny_run, tiny_dir):
    """Services.engine_threads, around `dreamgym train`'s held-out evaluations (evaluation.engine_threads)."""
    cfg = load_config(None, [*tiny_run, "engines.threads=1"])
    async with Services(cfg, "threads") as svc:
        await svc.start_engines(None, str(tiny_dir))
        (policy,) = svc.embedded["policy"]
        b = policy.batcher
        for threads, during in ((-1, len(os.sched_getaffinity(0))), (0, 1), (3, 3)):
            with svc.engine_threads("policy", threads):
                b.submit_score([[1, 2, 3, 4]], 2).result(timeout=60)
                assert b.scorer.threads_in_force == during
            b.submit_score([[1, 2, 3, 4]], 2).result(timeout=60)
            assert b.scorer.threads_in_force == 1
        with svc.engine_threads("mexp", -1):  # no Mexp engine in this run: nothing to change
            pass
