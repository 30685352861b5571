"""The choice policy against the real embedded engine and the real SmolLM2.

The behaviour log-prob a worker records (engine, renormalised over the labels) must
equal what the learner recomputes with `choice_logprobs`, also when the engine
batches concurrent requests, and a published weight version must reach the engine.
"""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch

from actors.policy import LABELS, Policy, PolicyError, build_choice_prompt, label_token_ids, renormalise
from learner.choice_logprobs import choice_logprobs
from infra.schema import Step, Task

TASK = Task("t1", "take the coin and put it in the box")
STATES = [
    ("Room: Kitchen. You see a table with a coin.\nInventory: nothing\nActions:\n[1] go north\n[2] take coin\n[3] open box",
     ["go north", "take coin", "open box"]),
    ("Room: Hall. A door leads east.\nInventory: a coin\nActions:\n[1] go east\n[2] drop coin",
     ["go east", "drop coin"]),
    ("Room: Study. There is a closed box.\nInventory: a coin\nActions:\n[1] open box\n[2] go west\n[3] look\n[4] inventory",
     ["open box", "go west", "look", "inventory"]),
]


@pytest.fixture(scope="module")
def tok():
    from infra.engine.models import load_tokenizer

    return load_tokenizer("smollm2")


def test_labels_are_single_tokens_and_prompt_lists_options(tok):
    assert label_token_ids(tok, 3) == [81, 82, 83]  # 'a', 'b', 'c'
    assert len(set(label_token_ids(tok, len(LABELS)))) == len(LABELS)
    history = [Step(state="", action="look"), "inventory"]
    prompt, labels = build_choice_prompt(tok, TASK, STATES[0][0], STATES[0][1], history)
    assert "a) go north\nb) take coin\nc) open box" in prompt
    assert "Previous actions: look; inventory" in prompt and "[1] go north" not in prompt
    assert prompt.endswith("<|im_start|>assistant\n") and labels == [81, 82, 83]
    with pytest.raises(ValueError):
        build_choice_prompt(tok, TASK, STATES[0][0], [])


def test_prompt_drops_a_repeated_goal_and_names_web_elements(tok):
    task = Task("w", 'Click on the "Ok" button.')
    state = 'Task: Click on the  "Ok" button.\nActions:\n[4] div \'lorem\'\n[6] button \'Ok\'\n[7] input_text #name'
    prompt, _ = build_choice_prompt(tok, task, state, ["click [4]", "click [6]", 'type [7] "bob"'])
    assert prompt.count('Click on the "Ok" button.') == 1  # the state's goal line repeats the instruction
    assert "b) click [6] (button 'Ok')" in prompt and 'c) type [7] "bob" (input_text #name)' in prompt
    # A state that does not parse is shown as it is.
    prompt, _ = build_choice_prompt(tok, task, "just text", ["wait"])
    assert "State:\njust text" in prompt and "a) wait" in prompt
    with pytest.raises(ValueError):
        label_token_ids(tok, len(LABELS) + 1)


def test_renormalise():
    lp = renormalise([math.log(0.2), math.log(0.2)])
    assert [math.exp(v) for v in lp] == pytest.approx([0.5, 0.5])
    hot = renormalise([0.0, -1.0], temperature=0.5)
    assert math.exp(hot[0]) == pytest.approx(1 / (1 + math.exp(-2)))


@pytest.mark.slow
@pytest.mark.model
def test_choice_logprobs_batch_equals_one_by_one(smollm2):
    model, tok = smollm2
    prompts, labels = zip(*(build_choice_prompt(tok, TASK, s, c) for s, c in STATES))
    chosen = [lab[-1] for lab in labels]
    with torch.no_grad():
        batch = choice_logprobs(model, tok, list(prompts), list(labels), chosen)
        single = torch.cat([choice_logprobs(model, tok, [p], [lab], [c]) for p, lab, c in zip(prompts, labels, chosen)])
        ids = tok(prompts[0], add_special_tokens=False, return_tensors="pt").input_ids
        direct = torch.log_softmax(model(ids).logits[0, -1, labels[0]], -1)[-1]
    assert torch.allclose(batch, single, atol=1e-4)
    assert float(single[0]) == pytest.approx(float(direct), abs=1e-5)

    # The learner's forward runs duplicate prompts once and indexes back: same numbers.
    from learner.policy_model import PolicyModel

    pm = PolicyModel(model=model, tokenizer=tok)
    dup = [0, 1, 0, 2, 0]
    with torch.no_grad():
        got, _ = pm.forward_choice([prompts[i] for i in dup], [labels[i] for i in dup], [chosen[i] for i in dup])
    model.eval()
    assert torch.allclose(got, single[dup], atol=1e-4)
    with pytest.raises(ValueError):
        choice_logprobs(model, tok, [prompts[0]], [labels[0]], [12345])


def test_a_padded_batchs_gradients_stay_finite_where_an_empty_attention_row_is_nan(tok, monkeypatch):
    """CUDA's bf16 attention kernels answer a query row with no key to attend to with NaN (the
    2026-11-28 H200 lease: a bf16 GRPO update's gradient norm was NaN). No loss reads a left-padding
    row, but 0 x NaN in the backward pass would still reach every weight: so no row may be empty."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         pad_token_id=tok.pad_token_id, attn_implementation="sdpa"))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    empty_rows = []

    def cuda_like(q, k, v, attn_mask=None, **kw):  # an empty row gives NaN, as those kernels do
        out = sdpa(q, k, v, attn_mask=attn_mask, **kw)
        if attn_mask is None or attn_mask.dtype != torch.bool:
            return out
        empty = ~attn_mask.any(-1)  # [b, 1, q]
        empty_rows.append(int(empty.sum()))
        return out.masked_fill(empty[..., None], float("nan"))

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", cuda_like)
    prompts, labels = zip(*(build_choice_prompt(tok, TASK, s, c) for s, c in STATES))  # three lengths: padding
    logp = choice_logprobs(model, tok, list(prompts), list(labels), [lab[0] for lab in labels])
    logp.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert empty_rows and sum(empty_rows) == 0


class _NoLogprobEngine:
    """An engine answer without token_ids_logprobs (e.g. a server that ignores the parameter)."""

    async def generate(self, prompt, **kw):
        from infra.engine.client import GenerateResult

        return GenerateResult("a", [81], [-0.1], None, 0, "length", 10, {})


async def test_engine_without_label_logprobs_is_a_typed_error(tok):
    with pytest.raises(PolicyError):
        await Policy(_NoLogprobEngine(), tok).act(TASK, STATES[0][0], STATES[0][1])


@pytest.mark.slow
@pytest.mark.model
async def test_engine_logprob_equals_learner_recompute_and_weights_publish(smollm2, tmp_path):
    from infra.engine.client import EngineClient
    from infra.engine.server import start_embedded_engine
    from learner.policy_model import PolicyModel
    from learner.weights import WeightPublisher

    model, tok = smollm2
    engine = await start_embedded_engine(loaded=(model, tok), max_batch_size=8, weights_roots=[str(tmp_path)])
    try:
        async with EngineClient([engine.url], role="policy") as client:
            policy = Policy(client, tok, temperature=1.0, seed=0)
            # Concurrent requests: the engine batches (and pads) them.
            decisions = await asyncio.gather(*(policy.act(TASK, s, c, ["look"]) for s, c in STATES * 2))
            for d, (s, c) in zip(decisions, STATES * 2):
                assert d.action == c[d.index] and d.weight_version == 0
                assert d.action_token_ids == [d.choice_token_ids[d.index]]
                assert sum(d.probs) == pytest.approx(1.0)
                with torch.no_grad():
                    mine = choice_logprobs(model, tok, [d.prompt], [d.choice_token_ids], d.action_token_ids)
                assert d.logprobs[0] == pytest.approx(float(mine[0]), abs=1e-4)
            greedy = await Policy(client, tok, temperature=0.0).act(TASK, *STATES[2])
            assert greedy.index == max(range(len(greedy.probs)), key=greedy.probs.__getitem__)

            # Train-side model with a non-zero LoRA delta, published as v1: the engine now
            # serves exactly the learner's (merged) weights.
            trained = PolicyModel(lora_rank=4, model=copy.deepcopy(model), tokenizer=tok)
            with torch.no_grad():
                for n, p in trained.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.02)
            pub = WeightPublisher(tmp_path, client, keep=1)
            await pub.publish(trained, 1)
            d = await policy.act(TASK, *STATES[0])
            assert d.weight_version == 1
            with torch.no_grad():
                learner_lp, _ = trained.forward_choice([d.prompt], [d.choice_token_ids], d.action_token_ids)
                base_lp = choice_logprobs(model, tok, [d.prompt], [d.choice_token_ids], d.action_token_ids)
            assert d.logprobs[0] == pytest.approx(float(learner_lp[0]), abs=1e-4)
            assert abs(float(learner_lp[0]) - float(base_lp[0])) > 1e-4  # the delta really moved it
            await pub.publish(trained, 2)
            assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v2"]
    finally:
        await engine.stop()
