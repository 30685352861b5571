"""The decode step as CUDA graphs (infra/engine/decode_graph.py): the static step a graph captures,
run eagerly on the CPU from the same static buffers, against the batcher's own step, token for
token, through batches that pad up to a bucket, rows that join and leave, a cache buffer that
grows (graphs dropped, captured again) and one compacted in place (graphs kept); then on CUDA,
where a GPU is lent, the captured graphs themselves."""

from __future__ import annotations

import time

import pytest
import torch

from infra.engine.decode_graph import DecodeGraphs, buckets
from infra.engine.kv import SlotCache
from infra.metrics import EngineServerMetrics

CUDA = torch.cuda.is_available()


def test_buckets_are_powers_of_two_up_to_the_batch_size():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(12) == [1, 2, 4, 8, 12]


def test_compaction_moves_the_live_columns_in_place_so_the_graphs_keep_their_buffer():
    slots = SlotCache(layers=2, kv_heads=1, head_dim=2, rows=2, dtype=torch.float32, device=torch.device("cpu"), cols=8)
    slots.make_room(3)  # an empty cache: columns 0..2 for a 3-token prompt, end at 3
    slots.n, slots.start, slots.end = 2, 5, 8  # two rows whose tokens sit in columns 5..7
    slots.kv[:, :, :2, :, 5:8] = torch.arange(2 * 2 * 2 * 3 * 2, dtype=torch.float32).view(2, 2, 2, 1, 3, 2)
    slots.mask[:2, 5:8] = True
    slots.mask[1, 5] = False  # a hole (a rejected draft) moves with its row
    before, buffer = slots.kv[:, :, :2, :, 5:8].clone(), slots.kv
    slots.ensure_free_column()
    assert slots.kv is buffer and (slots.start, slots.end) == (0, 3)
    assert torch.equal(slots.kv[:, :, :2, :, 0:3], before)
    assert slots.mask[:2, :3].tolist() == [[True, True, True], [False, True, True]]
    assert not slots.mask[:, 3:].any()


def _generate(model, tok, decode_graphs: str, plan: list[tuple[int, int, int]]):
    """Run `plan` — (prompt length, new tokens, tokens of the first request before it joins) — through
    a batcher of 4 rows; returns each request's output ids and log-probs, and the batcher."""
    from infra.engine.batcher import Batcher, GenRequest, SamplingParams

    batcher = Batcher(model, tok, max_batch_size=4, decode_graphs=decode_graphs)
    batcher.start()
    words = "the brass key opens the locked door to the garden north of the hall".split()
    try:
        futures, first = [], None
        for i, (length, new, after) in enumerate(plan):
            ids = tok(" ".join(words[(i + j) % len(words)] for j in range(length)), add_special_tokens=False).input_ids
            params = SamplingParams.from_dict({"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True})
            req = GenRequest(ids[:length], params)
            while first is not None and len(first.output_ids) < after:  # join once the first one is this far
                time.sleep(0.001)
            futures.append(batcher.submit(req))
            first = first or req
        outs = [f.result(300) for f in futures]
        return [o.output_ids for o in outs], [o.output_logprobs for o in outs], batcher
    finally:
        batcher.stop()


# A long first prompt the others join at different points: batches of 1, 2 and 3 rows (buckets 1,
# 2 and 4), rows leaving in the middle, and a first request that outgrows the 256-column buffer.
PLAN = [(240, 40, 0), (5, 20, 5), (9, 20, 10), (3, 10, 15)]
# A row that joins late and outlives the first: the buffer's live columns then start past half, so
# reaching its end compacts it in place.
COMPACT = [(200, 20, 0), (4, 60, 10)]


@pytest.mark.parametrize("plan", [PLAN, COMPACT], ids=["joins-and-growth", "compaction"])
def test_the_static_step_decodes_what_the_eager_step_decodes(tiny_dir, plan):
    from infra.engine.models import load_model

    model, tok = load_model(str(tiny_dir))
    ids_off, lp_off, _ = _generate(model, tok, "off", plan)
    ids_on, lp_on, batcher = _generate(model, tok, "eager", plan)
    assert [len(x) for x in ids_on] == [new for _, new, _ in plan]
    assert ids_on == ids_off
    diff = max(abs(a - b) for x, y in zip(lp_on, lp_off) for a, b in zip(x, y))
    assert diff < 1e-4, diff
    metric = batcher.metrics.registry.get_sample_value
    assert metric("engine_decode_graph_steps_total") == batcher.steps > 0  # every decode step took the static path
    assert metric("engine_decode_graph_captures_total") == 0  # eager: nothing is captured


def test_a_weight_swap_drops_the_graphs(tiny_dir):
    from infra.engine.models import load_model

    model, tok = load_model(str(tiny_dir))
    graphs = DecodeGraphs(model, tok.pad_token_id, 4, "eager", EngineServerMetrics())
    slots = SlotCache(2, 2, 8, 4, torch.float32, torch.device("cpu"))
    graphs._bind(slots)
    graphs._graphs[1] = ("a graph", torch.zeros(1))
    graphs._bind(slots)
    assert 1 in graphs._graphs  # the same buffer keeps them
    other, _ = load_model(str(tiny_dir))
    graphs.reset(other)
    assert graphs.model is other and not graphs._graphs
    with pytest.raises(ValueError, match="'eager' or 'cuda'"):
        DecodeGraphs(model, 0, 4, "off", EngineServerMetrics())


async def test_engines_cuda_graphs_reaches_the_engine_only_on_cuda(tiny_dir):
    """`dreamgym train` and `dreamgym serve` start engines through start_embedded_engine: on a CPU
    the setting changes nothing (no graphs), so the CPU tables' engines are the ones they were."""
    from infra.config import EngineConfig
    from infra.engine.models import load_model
    from infra.engine.server import start_embedded_engine

    handle = await start_embedded_engine(loaded=load_model(str(tiny_dir)), engine_cfg=EngineConfig(cuda_graphs=True))
    try:
        assert handle.batcher.graphs is None
    finally:
        await handle.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graphs_decode_what_the_eager_step_decodes_on_cuda(tiny_dir):
    from infra.engine.models import load_model

    model, tok = load_model(str(tiny_dir), device="cuda")
    ids_off, lp_off, _ = _generate(model, tok, "off", PLAN)
    ids_on, lp_on, batcher = _generate(model, tok, "cuda", PLAN)
    assert ids_on == ids_off
    assert max(abs(a - b) for x, y in zip(lp_on, lp_off) for a, b in zip(x, y)) < 1e-3
    metric = batcher.metrics.registry.get_sample_value
    assert batcher.graphs.enabled and metric("engine_decode_graph_steps_total") == batcher.steps
    assert metric("engine_decode_graph_captures_total") >= 4  # buckets 1, 2 and 4, and again after the growth


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
async def test_an_engine_on_cuda_decodes_with_graphs_by_default(tiny_dir):
    import aiohttp

    from infra.config import EngineConfig
    from infra.engine.models import load_model
    from infra.engine.server import start_embedded_engine

    handle = await start_embedded_engine(loaded=load_model(str(tiny_dir), device="cuda"), engine_cfg=EngineConfig())
    try:
        async with aiohttp.ClientSession() as http:
            body = {"text": ["the brass key", "go north"], "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
            async with http.post(f"{handle.url}/generate", json=body) as r:
                assert r.status == 200
        assert handle.batcher.metrics.registry.get_sample_value("engine_decode_graph_steps_total") > 0
    finally:
        await handle.stop()
