"""Score mode: the policy scores each candidate's text by its log-likelihood.

Against the real embedded engine and the real SmolLM2: the engine's prefill log-probs
(SGLang's `logprob_start_len`) equal a plain full-sequence forward; the behaviour
log-prob a worker records equals the learner's recomputation, through the Step that
crosses the wire; the schema carries and checks score-mode steps; a supervised step
on the expert's candidate raises its probability.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from actors.episode import record
from actors.envs.base import StepResult
from actors.policy import Policy, score_turn, split_choices
from infra import schema
from infra.config import ConfigError, load_config
from infra.engine.models import load_tokenizer
from infra.engine.scoring import continuation_logprobs
from infra.schema import Step, Task
from learner.policy_model import scored_logprobs
from learner.update import choice_args, choice_temperatures

TASK = Task("t1", "take the coin and put it in the box")
STATES = [
    ("Room: Kitchen. You see a table with a coin.\nInventory: nothing\nActions:\n[1] go north\n[2] take coin\n[3] open box",
     ["go north", "take coin", "open box"]),
    ("Room: Study. There is a closed box.\nInventory: a coin\nActions:\n[1] open box\n[2] go west\n[3] put coin in box",
     ["open box", "go west", "put coin in box"]),
]


@pytest.mark.model
def test_continuation_logprobs_equal_a_full_forward(smollm2):
    model, tok = smollm2
    turn = score_turn(tok, TASK, *STATES[0], history=["look"])
    with torch.no_grad():
        got, _ = continuation_logprobs(model, turn.prefix, turn.continuations)
        for cont, lp in zip(turn.continuations, got):
            full = model(input_ids=torch.tensor([turn.prefix + cont])).logits[0].log_softmax(-1)
            n = len(turn.prefix)
            ref = full[n - 1:n + len(cont) - 1].gather(-1, torch.tensor(cont)[:, None])[:, 0]
            assert torch.allclose(lp, ref, atol=1e-4)
    assert "Possible actions: go north; take coin; open box" in turn.prompt
    assert all(c[-1] == tok.eos_token_id for c in turn.continuations)


def test_a_web_action_is_scored_with_its_elements_text():
    # "click [7]" alone would leave the policy scoring the digits of a ref; the continuation names the
    # element as the prompt lists it, and a TextWorld command is scored as itself
    tok = load_tokenizer()
    page = ("Task: Click on the Submit button.\nItems:\n[5] label 'Name'\n[6] input_text #name\n[7] button 'Submit'",
            ["click [5]", 'type [6] "Kenda"', "click [7]"])
    turn = score_turn(tok, Task("w1", "Click on the Submit button."), *page)
    shown = ["click [5] (label 'Name')", 'type [6] "Kenda" (input_text #name)', "click [7] (button 'Submit')"]
    assert "Possible actions: " + "; ".join(shown) in turn.prompt
    assert [tok.decode(c[:-1]) for c in turn.continuations] == shown
    words = score_turn(tok, TASK, *STATES[0])
    assert [tok.decode(c[:-1]) for c in words.continuations] == STATES[0][1]


@pytest.mark.slow
@pytest.mark.model
async def test_engine_score_equals_learner_recompute_through_the_wire(smollm2):
    from infra.engine.client import EngineClient
    from infra.engine.server import start_embedded_engine
    from learner.policy_model import PolicyModel

    model, tok = smollm2
    engine = await start_embedded_engine(loaded=(model, tok), max_batch_size=8)
    try:
        async with EngineClient([engine.url], role="policy") as client:
            # sampled at 1 and hotter (sim-to-real's real phase, learner.s2r_temperature): the learner reads each
            # step at the temperature it was sampled at, so an update's first ratio is 1 either way
            hot = Policy(client, tok, temperature=1.5, seed=1, action_mode="score")
            policy = Policy(client, tok, temperature=1.0, seed=0, action_mode="score")
            decisions = await asyncio.gather(*(policy.act(TASK, s, c, ["look"]) for s, c in STATES),
                                             *(hot.act(TASK, s, c, ["look"]) for s, c in STATES))
            assert [d.temperature for d in decisions] == [1.0] * len(STATES) + [1.5] * len(STATES)
            steps = []
            for d, (s, c) in zip(decisions, STATES * 2):
                assert d.action == c[d.index] and sum(d.probs) == pytest.approx(1.0)
                assert split_choices(d.choice_token_ids, d.choice_lengths)[d.index] == d.action_token_ids
                step = record(s, d.action, StepResult("next", 0.0, False, {}), d, "env-facts")
                steps.append(schema.decode(schema.encode(step)))  # what the learner reads off the stream
            assert steps[0].loss_mask == [1] and len(steps[0].logprobs) == 1
            learner = PolicyModel(model=model, tokenizer=tok)
            with torch.no_grad():
                mine, _ = learner.forward_choice(*choice_args(steps), temperatures=choice_temperatures(steps))
            assert [s.temperature for s in steps] == [d.temperature for d in decisions]
            for d, lp in zip(decisions, mine):
                assert d.logprobs[0] == pytest.approx(float(lp), abs=1e-4)
            greedy = await Policy(client, tok, temperature=0.0, action_mode="score").act(TASK, *STATES[1])
            assert greedy.index == max(range(len(greedy.probs)), key=greedy.probs.__getitem__)
    finally:
        await engine.stop()


@pytest.mark.model
def test_a_supervised_step_raises_the_expert_candidates_probability(smollm2):
    import copy

    from learner.policy_sft import ChoiceExample, train_on_examples

    from learner.policy_model import PolicyModel

    base, tok = smollm2

    policy = PolicyModel(model=copy.deepcopy(base), tokenizer=tok)
    turn = score_turn(tok, TASK, *STATES[1])
    example = ChoiceExample(turn.prompt, turn.continuations, 2)  # "put coin in box"
    with torch.no_grad():
        before = float(scored_logprobs(policy.lm, tok, [turn.prompt], [turn.continuations], [2])[0][0])
    losses = train_on_examples(policy, [example], steps=3, lr=1e-4, batch_size=1)
    with torch.no_grad():
        after = float(scored_logprobs(policy.lm, tok, [turn.prompt], [turn.continuations], [2])[0][0])
    assert losses[0] == pytest.approx(-before, abs=1e-4)
    assert after > before + 0.1


def test_schema_checks_score_mode_steps():
    ok = Step("s", "take coin", policy_prompt="p", action_token_ids=[5, 6], logprobs=[-0.5], loss_mask=[1],
              choice_token_ids=[1, 2, 5, 6], choice_lengths=[2, 2])
    assert schema.decode(schema.encode(ok)).choice_lengths == [2, 2]
    for bad in ({"choice_lengths": [2, 1]}, {"choice_lengths": [0, 4]}, {"logprobs": [-0.5, -0.1]},
                {"choice_lengths": [2, "2"]}):
        fields = {**ok.__dict__, **bad}
        with pytest.raises(schema.SchemaError):
            schema.decode(schema.encode(Step(**fields)))
    steps = [schema.decode(schema.encode(ok))]
    prompts, choices, chosen = choice_args(steps)
    assert choices == [[[1, 2], [5, 6]]] and chosen == [1]


def test_score_mode_needs_per_step_prompts():
    with pytest.raises(ConfigError, match="actors.action_mode"):
        load_config(None, ["actors.action_mode=score", "actors.multi_turn=true"])
    assert load_config(None, ["actors.action_mode=score", "actors.multi_turn=false"]).actors.action_mode == "score"
