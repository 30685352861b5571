"""Mexp SFT: loss masking, a short real run lowers held-out loss, the checkpoint serves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from infra.config import ConfigError, SimulatorConfig, load_config
from infra.engine.models import load_model
from infra.schema import Task
from learner.mexp_sft import (EXAMPLE_DRAW, IGNORE, Encoded, cache_settings, cap_examples, encode_example, resolve_layout,
                              run_sft, sft_data, sft_loss, target_losses)
from simulator.mexp_data import MexpExample, build_examples, load_offline, split_trajectories
from simulator.mexp_output import MexpOutput, parse_mexp_output

sys.path.insert(0, str(Path(__file__).parent))
from textworld_offline import make_offline_dataset  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tw")
    make_offline_dataset(d, n_games=3, families=("tw-simple",), max_steps=6)
    return d


def test_examples_are_the_inference_prompt_and_a_parseable_target(data_dir):
    from infra.engine.models import load_tokenizer

    tok = load_tokenizer()
    trajs = load_offline(data_dir, "textworld")
    train, held = split_trajectories(trajs, 0.34)
    assert train and held and not {t.task_id for t in train} & {t.task_id for t in held}
    from simulator.embedder import Embedder
    from simulator.replay_buffer import EdgeBuffer, seed_buffer

    buf = EdgeBuffer(data_dir / "edge", Embedder(cache_path=data_dir / "emb.sqlite"))
    seed_buffer(buf, train)
    cfg = SimulatorConfig(top_k=2)
    ex = build_examples(train, tok, cfg, buf)
    assert "Similar past transitions" in ex[0].prompt
    neighbours = [e.prompt.partition("Current state:")[0] for e in ex]
    plain = [e.prompt.partition("Current state:")[0] for e in
             build_examples(train, tok, SimulatorConfig(top_k=2, retrieved_todo=False), buf)]
    assert any("to do:" in n for n in neighbours) and not any("to do:" in n for n in plain)  # SFT sees what serving shows
    buf.close()
    assert ex and all(e.prompt.endswith("<think>") for e in ex)
    first = ex[0]
    assert parse_mexp_output("<think>" + first.reasoning_target + first.rest_target).reward == first.truth.reward
    enc = encode_example(tok, first, 4096)
    n_prompt = enc.labels.count(IGNORE)
    assert enc.input_ids[:n_prompt] == tok(first.prompt, add_special_tokens=False)["input_ids"]
    assert enc.labels[-1] == tok.eos_token_id and all(l != IGNORE for l in enc.labels[n_prompt:])
    assert any(enc.reasoning) and not any(enc.reasoning[:n_prompt])
    assert encode_example(tok, first, n_prompt) is None  # too long is skipped, not truncated


def test_the_draw_counts_only_examples_that_fit(data_dir):
    # The length filter runs before sft_max_examples is drawn: asked for as many examples as fit, every one of
    # them is trained on (drawn first, the too-long ones in the draw were skipped after it and fewer trained)
    from infra.engine.models import load_tokenizer

    tok = load_tokenizer()
    cfg = SimulatorConfig(retrieval=False, history_window=1, heldout_frac=0.34, sft_max_heldout=0)
    train, _ = split_trajectories(load_offline(data_dir, "textworld"), 0.34, data_dir, "textworld")
    lengths = sorted(len(encode_example(tok, x, 10 ** 6).input_ids) for x in build_examples(train, tok, cfg, None))
    max_len = lengths[len(lengths) // 2]
    fit = sum(n <= max_len for n in lengths)
    assert 0 < fit < len(lengths)  # some are too long, or the test shows nothing
    data = sft_data(SimulatorConfig(retrieval=False, history_window=1, heldout_frac=0.34, sft_max_heldout=0,
                                    sft_max_len=max_len, sft_max_examples=fit), data_dir, tok)
    assert len(data.train) == fit and all(len(e.input_ids) <= max_len for e in data.train)
    assert cache_settings(SimulatorConfig(), "m", "o", 0)["example_draw"] == EXAMPLE_DRAW == 2  # old caches do not count


@pytest.mark.model
async def test_short_sft_lowers_heldout_loss_and_checkpoint_serves(data_dir, smollm2, tmp_path):
    # Kept tiny for CI (8 sequences of ~500 tokens); retrieval's path is covered by the example-builder test.
    # With the preset's rebalancing on (half the capped examples rewarded, outcome tokens weighted).
    cfg = SimulatorConfig(retrieval=False, history_window=1, sft_max_examples=4, sft_max_heldout=2, sft_epochs=2,
                          sft_batch_size=2, sft_lora_rank=8, sft_lr=3e-3, heldout_frac=0.34, sft_reward_share=0.5,
                          sft_outcome_weight=3.0)
    report = run_sft(cfg, data_dir, tmp_path / "mexp", progress=False)
    before, after = report["before"], report["after"]
    assert after["loss_all"] < before["loss_all"] - 0.05, report
    assert after["loss_state"] < before["loss_state"] and report["heldout_examples"] > 0
    ckpt = Path(report["checkpoint"])
    assert (ckpt / "config.json").exists() and (ckpt / "tokenizer_config.json").exists()
    assert not (ckpt / "adapter_config.json").exists()  # LoRA merged: a plain HF model

    from infra.engine.client import EngineClient
    from infra.engine.server import start_embedded_engine

    model, tok = smollm2
    engine = await start_embedded_engine(loaded=(model, tok), max_batch_size=2, weights_roots=[str(tmp_path)])
    try:
        async with EngineClient([engine.url]) as client:
            await client.update_weights_from_disk(str(ckpt), 1)
            res = await client.generate("<|im_start|>user\nhi<|im_end|>\n", sampling_params={"max_new_tokens": 2})
            assert res.weight_version == 1
    finally:
        await engine.stop()


def _example(i: int, reward: float) -> MexpExample:
    return MexpExample("p", "", "r", MexpOutput("", "s", reward, reward > 0), Task(task_id=f"t{i}", instruction=""),
                       [], "s", f"a{i}", f"e{i}")


def test_capped_examples_take_the_asked_share_of_rewarded_steps():
    pool = [_example(i, 1.0 if i % 10 == 0 else 0.0) for i in range(100)]  # 10 rewarded of 100
    uniform = cap_examples(pool, 40, 0.0, seed=0)
    assert len(uniform) == 40 and len({e.action for e in uniform}) == 40
    balanced = cap_examples(pool, 40, 0.25, seed=0)
    assert len(balanced) == 40 and len({e.action for e in balanced}) == 40
    assert sum(e.truth.reward > 0 for e in balanced) == 10
    scarce = cap_examples(pool, 20, 0.9, seed=0)  # 18 asked, only 10 exist: all of them, the rest unrewarded
    assert sum(e.truth.reward > 0 for e in scarce) == 10 and len(scarce) == 20
    mostly_won = [_example(i, 1.0 if i < 95 else 0.0) for i in range(100)]
    filled = cap_examples(mostly_won, 20, 0.1, seed=0)  # 2 asked but only 5 unrewarded: filled with rewarded
    assert len(filled) == 20 and sum(e.truth.reward <= 0 for e in filled) == 5
    assert cap_examples(pool, 200, 0.5, seed=0) == cap_examples(pool, 200, 0.0, seed=0)  # no cap to apply
    assert [e.action for e in cap_examples(pool, 40, 0.25, seed=1)] != [e.action for e in balanced]
    # The share shapes the checkpoint, so it keys the SFT cache; its default leaves older caches valid.
    assert "sft_reward_share" not in cache_settings(SimulatorConfig(), "m", "o", 0)
    assert cache_settings(SimulatorConfig(sft_reward_share=0.4), "m", "o", 0)["sft_reward_share"] == 0.4
    assert cache_settings(SimulatorConfig(sft_outcome_weight=5.0), "m", "o", 0)["sft_outcome_weight"] == 5.0
    assert "sft_outcome_weight" not in cache_settings(SimulatorConfig(), "m", "o", 0)
    assert "retrieved_todo" not in cache_settings(SimulatorConfig(), "m", "o", 0)  # the keys made before it
    assert cache_settings(SimulatorConfig(retrieved_todo=False), "m", "o", 0)["retrieved_todo"] is False


def test_outcome_weighted_loss_against_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    nll = torch.rand(21, generator=g)
    outcome = torch.rand(21, generator=g) > 0.6
    for weight in (1.0, 5.0):
        num = den = 0.0
        for j in range(21):
            w = weight if outcome[j] else 1.0
            num += w * float(nll[j])
            den += w
        assert abs(float(sft_loss(nll, outcome, weight)) - num / den) < 1e-6
    assert torch.allclose(sft_loss(nll, outcome, 1.0), nll.mean())  # Eq. 5 unweighted


def test_outcome_mask_covers_the_reward_and_done_tokens():
    from infra.engine.models import load_tokenizer

    tok = load_tokenizer()
    for reward, done in ((1.0, True), (0.0, False)):
        ex = _example(0, reward)
        rest = f"<state>\nRoom: hall\n[1] go north\n</state>\n<reward>{reward:g}</reward>\n<done>{str(done).lower()}</done>"
        ex.prompt, ex.reasoning_target, ex.rest_target = "<|im_start|>assistant\n<think>", "moved</think>\n", rest
        enc = encode_example(tok, ex, 4096)
        marked = tok.decode([i for i, o in zip(enc.input_ids, enc.outcome) if o])
        unmarked_target = tok.decode([i for i, o, lab in zip(enc.input_ids, enc.outcome, enc.labels)
                                      if not o and lab != IGNORE])
        assert marked.endswith(f"<reward>{reward:g}</reward>\n<done>{str(done).lower()}</done>" + tok.eos_token)
        assert "reward" not in unmarked_target and "[1] go north" in unmarked_target
        assert not any(enc.outcome[:enc.labels.count(IGNORE)])  # never a prompt token


def test_the_unpadded_layout_gives_the_padded_losses_and_gradients(tiny_dir):
    """simulator.sft_layout: one forward per example with the LM head on the target positions only
    (the CPU's) equals the right-padded batch with logits everywhere, in losses, masks and gradients;
    'auto' is 'unpadded' on the CPU; the layout is not part of the SFT cache key."""
    model, tok = load_model(str(tiny_dir))
    examples = []
    for prompt, reasoning, rest in (("You are in a kitchen. > open the fridge", " the fridge was closed", " The fridge is open. <reward>0</reward>"),
                                    ("A long corridor with three doors, one of them red, and a rug. > go east",
                                     " east leads to the den", " You are in the den. <reward>1</reward><done>1</done>"),
                                    ("Hall. > take key", "", " You take the key.")):
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(reasoning, add_special_tokens=False)["input_ids"] if reasoning else []
        s = tok(rest, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        examples.append(Encoded(p + r + s, [IGNORE] * len(p) + r + s, [False] * len(p) + [True] * len(r) + [False] * len(s),
                                [False] * (len(p) + len(r)) + [i >= len(s) - 3 for i in range(len(s))]))
    assert len({len(e.input_ids) for e in examples}) == 3  # padding happens in the padded layout
    out, grads = {}, {}
    for layout in ("padded", "unpadded"):
        model.zero_grad(set_to_none=True)
        t = target_losses(model, examples, tok.pad_token_id, layout=layout)
        sft_loss(t.nll, t.outcome, 3.0).backward()
        out[layout] = t
        grads[layout] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    a, b = out["padded"], out["unpadded"]
    n_target = sum(len(e.labels) - e.labels.count(IGNORE) for e in examples)
    assert a.nll.shape == b.nll.shape == (n_target,)
    assert torch.equal(a.reasoning, b.reasoning) and torch.equal(a.outcome, b.outcome)
    assert int(a.reasoning.sum()) > 0 and int(a.outcome.sum()) == 9
    assert torch.allclose(a.nll, b.nll, atol=1e-4)
    assert grads["padded"].keys() == grads["unpadded"].keys() and grads["padded"]
    for name, g in grads["padded"].items():
        assert torch.allclose(g, grads["unpadded"][name], atol=1e-5, rtol=1e-3), name
    assert resolve_layout("auto", "cpu") == "unpadded" and resolve_layout("auto", "cuda:0") == "padded"
    assert resolve_layout("padded", "cpu") == "padded"
    assert load_config(None, ["simulator.sft_layout=padded"]).simulator.sft_layout == "padded"
    with pytest.raises(ConfigError, match="sft_layout"):
        load_config(None, ["simulator.sft_layout=packed"])
    assert cache_settings(SimulatorConfig(sft_layout="padded"), "m", "o", 0) == cache_settings(SimulatorConfig(), "m", "o", 0)
