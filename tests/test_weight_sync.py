"""learner.weight_sync=distributed: versions broadcast over a process group into the embedded engine.

The learner's end (learner/weight_sync.py) against the embedded engine's (infra/engine/weight_group.py),
both real: the engine's served weights must equal the learner's bit for bit after each version, the
version it reports must be the one published, and a refused or broken transfer must fail the publish
without hanging the learner. Request shapes against SGLang's are pinned in tests/test_engine_contract.py.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import pytest
import torch
from safetensors.torch import load_file

from infra.engine.client import EngineClient, EngineError
from infra.engine.models import load_model
from infra.engine.server import start_embedded_engine
from learner.policy_model import PolicyModel
from learner.weight_sync import DistributedSync, hf_state


def assert_served_equals(engine_model: torch.nn.Module, policy: PolicyModel) -> None:
    served, learned = engine_model.state_dict(), policy.lm.state_dict()
    assert served.keys() == learned.keys()
    for name, t in learned.items():
        assert torch.equal(served[name], t), f"{name} differs"


async def test_versions_broadcast_into_the_embedded_engine_bit_for_bit(tiny_dir):
    policy = PolicyModel(str(tiny_dir))
    engine = await start_embedded_engine(str(tiny_dir), loaded=load_model(str(tiny_dir)), max_batch_size=2)
    try:
        async with EngineClient([engine.url], role="policy", timeout_s=60) as client:
            sync = DistributedSync(client, backend="gloo", timeout_s=60)
            for version in (1, 2):
                with torch.no_grad():
                    for p in policy.lm.parameters():
                        p.add_(torch.randn_like(p) * 0.01)  # an "update": every weight moves
                assert not torch.equal(engine.batcher.model.state_dict()["model.norm.weight"],
                                       policy.lm.state_dict()["model.norm.weight"])
                await sync.send(policy, version)
                assert engine.batcher.weight_version == version
                assert (await client.model_info())["weight_version"] == version
                assert_served_equals(engine.batcher.model, policy)
                out = await client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2,
                                                                                  "temperature": 0.0})
                assert out.weight_version == version
            sync.close()
    finally:
        await engine.stop()


def test_a_tied_weight_is_sent_once(tiny_dir):
    policy = PolicyModel(str(tiny_dir))
    state = hf_state(policy)
    assert "model.embed_tokens.weight" in state and "lm_head.weight" not in state  # tie_word_embeddings
    assert len(state) == len(policy.lm.state_dict()) - 1
    assert hf_state(policy, "bfloat16")["model.norm.weight"].dtype == torch.bfloat16


async def test_a_refused_update_fails_the_publish_and_the_next_one_forms_a_new_group(tiny_dir):
    policy = PolicyModel(str(tiny_dir))
    engine = await start_embedded_engine(str(tiny_dir), loaded=load_model(str(tiny_dir)), max_batch_size=2)
    try:
        async with EngineClient([engine.url], role="policy", timeout_s=60) as client:
            sync = DistributedSync(client, backend="gloo", timeout_s=20)
            await sync.send(policy, 1)
            first = sync.group.group_name
            engine.app.weight_group.group_name = "another"  # the engine no longer knows this group: it refuses
            with pytest.raises(EngineError, match="no weight-update group"):
                await asyncio.wait_for(sync.send(policy, 2), 15)  # refused before any tensor: no hang
            assert sync.group is None and engine.batcher.weight_version == 1
            with torch.no_grad():
                policy.lm.model.norm.weight.add_(1.0)
            await sync.send(policy, 3)  # a new group, as after an engine restart
            assert sync.group.group_name != first and engine.batcher.weight_version == 3
            assert_served_equals(engine.batcher.model, policy)
            sync.close()
    finally:
        await engine.stop()


async def test_the_embedded_engine_refuses_nccl_and_malformed_updates(tiny_dir):
    engine = await start_embedded_engine(str(tiny_dir), loaded=load_model(str(tiny_dir)), max_batch_size=2)
    try:
        async with aiohttp.ClientSession() as s:
            init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
                    "group_name": "g", "backend": "nccl"}
            async with s.post(engine.url + "/init_weights_update_group", json=init) as r:
                assert r.status == 400 and "gloo" in (await r.json())["error"]["message"]
            async with s.post(engine.url + "/init_weights_update_group", json={**init, "backend": "gloo",
                                                                               "rank_offset": 0}) as r:
                assert r.status == 400  # rank 0 is the sender's
            upd = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]], "group_name": "g"}
            async with s.post(engine.url + "/update_weights_from_distributed", json=upd) as r:
                assert r.status == 400 and "init_weights_update_group" in (await r.json())["error"]["message"]
            async with s.post(engine.url + "/update_weights_from_distributed", json={**upd, "dtypes": []}) as r:
                assert r.status == 400
        assert engine.batcher.weight_version == 0
    finally:
        await engine.stop()


@pytest.mark.slow
def test_dreamgym_train_publishes_each_version_over_the_group(tiny_run, tmp_path, monkeypatch):
    """`dreamgym train learner.weight_sync=distributed` (tiny model, real TextWorld, the embedded policy
    engine in the driver): after each version the engine serves exactly the learner's weights, reports
    that version, and only the last version is written to the run directory (for `--checkpoint runs/<name>`)."""
    from infra import cli
    from infra.engine import weight_group
    from learner import weight_sync
    from learner.weights import published_versions, resolve_model

    sent, served = {}, {}
    send, update = weight_sync.DistributedSync.send, weight_group.WeightGroupRoutes.update

    async def recording_send(self, policy, version):
        sent[version] = {k: v.detach().clone() for k, v in policy.lm.state_dict().items()}
        await send(self, policy, version)

    async def recording_update(self, request):
        response = await update(self, request)
        b = self.engine.batcher
        served[b.weight_version] = {k: v.detach().clone() for k, v in b.model.state_dict().items()}
        return response

    monkeypatch.setattr(weight_sync.DistributedSync, "send", recording_send)
    monkeypatch.setattr(weight_group.WeightGroupRoutes, "update", recording_update)
    assert cli.main(["train", *tiny_run, "learner.weight_sync=distributed", "learner.total_updates=2",
                     "learner.checkpoint_every=1", "--name", "ws", "--no-eval"]) == 0
    assert sorted(sent) == sorted(served) == [1, 2]
    for version in sent:
        assert sent[version].keys() == served[version].keys()
        for name, t in sent[version].items():
            assert torch.equal(served[version][name], t), f"v{version} {name}"
    assert not torch.equal(sent[1]["model.norm.weight"], sent[2]["model.norm.weight"])  # each version moved
    run = tmp_path / "runs" / "ws"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["updates"] == 2 and summary["weight_version"] == 2
    assert published_versions(run) == [2]  # nothing per version; the last one when training ends
    final = load_file(next((run / "weights" / "v2").glob("*.safetensors")))
    assert torch.equal(final["model.norm.weight"], sent[2]["model.norm.weight"])
    assert resolve_model(run).endswith("v2")
    shutil.rmtree(run / "weights" / "v2")  # as if the run had died before its final save
    with pytest.raises(FileNotFoundError, match="up to v2 over a process group"):
        resolve_model(run)  # never the policy it started from
