"""The update maths (learner/update.py): a chunked update is the unchunked one.

Micro-batching splits a batch into forward/backward passes of at most `micro_batch`
prompts and scales each loss by its share; the accumulated gradient must equal the
gradient of one pass over the whole batch (to 1e-6), for GRPO with both loss
aggregations, with the KL penalty, and for PPO with its value head and GAE. A tiny
random-initialised Llama with SmolLM2's real tokenizer keeps it fast; the prompts are
the real choice prompts of actors/policy.py.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors.policy import build_choice_prompt
from infra.config import LearnerConfig
from infra.engine.models import load_tokenizer
from infra.schema import Status, Step, Task, Trajectory
from learner.advantages import group_advantages
from learner.policy_model import PolicyModel
from learner.update import (FixedInputs, Unit, accumulate_gradients, apply_update, chunks_of, fixed_inputs,
                            micro_batches, minibatch_bounds, piece_inputs, proximal, rows_of, step_costs)

ROOMS = ["Kitchen", "Hall", "Study"]
CANDS = ["go north", "take key", "open chest", "look"]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    tok = load_tokenizer("smollm2")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(cfg).eval(), tok


def units(tok, algo: str) -> list[Unit]:
    """Two groups of three trajectories of 1-3 steps (unequal lengths, so chunks cut between rows)."""
    out = []
    for g in range(2):
        task = Task(f"t{g}", f"open the chest in the {ROOMS[g].lower()}")
        trajs = []
        for i in range(3):
            steps, hist = [], []
            n = 1 + (g + i) % 3
            for t in range(n):
                state = f"Room: {ROOMS[(g + t) % 3]}\nActions:\n" + "\n".join(f"[{k + 1}] {c}" for k, c in enumerate(CANDS))
                prompt, labels = build_choice_prompt(tok, task, state, CANDS, hist)
                c = (g + i + t) % len(CANDS)
                steps.append(Step(state=state, action=CANDS[c], reward=float(i % 2) if t == n - 1 else 0.0,
                                  done=t == n - 1, policy_prompt=prompt, action_token_ids=[labels[c]],
                                  logprobs=[-1.2 - 0.1 * t], loss_mask=[1], choice_token_ids=labels))
                hist.append(CANDS[c])
            trajs.append(Trajectory(task_id=task.task_id, group_id=f"g{g}", steps=steps, status=Status.FAILURE,
                                    task=task))
        adv = group_advantages([t.total_reward for t in trajs]) if algo == "grpo" else None
        out.append(Unit(trajs, adv, [i == 1 for i in range(3)]))  # one importance-corrected member each
    return out


def scored(tok, batch: list[Unit]) -> list[Unit]:
    """`batch` in score mode: each step's candidates as token lists, so one forward_choice calls the
    model once per distinct prompt, a different number of times per micro-batch (learner/fsdp.py)."""
    cands = [tok(" " + c, add_special_tokens=False)["input_ids"] for c in CANDS]

    def step(s):
        return dataclasses.replace(s, choice_token_ids=[t for c in cands for t in c],
                                   choice_lengths=[len(c) for c in cands],
                                   action_token_ids=cands[CANDS.index(s.action)])
    return [Unit([dataclasses.replace(t, steps=[step(s) for s in t.steps]) for t in u.trajs], u.advantages, u.corrected)
            for u in batch]


def gradients(model, tok, cfg: LearnerConfig, batch: list[Unit]) -> dict[str, torch.Tensor]:
    policy = PolicyModel(model=copy.deepcopy(model), tokenizer=tok, value_head=cfg.algo == "ppo")
    if policy.value_head is not None:  # a non-zero head, so the value loss has a gradient everywhere
        torch.manual_seed(1)
        torch.nn.init.normal_(policy.value_head.weight, std=0.1)
    policy.train()
    rows = rows_of(batch)
    chunks = chunks_of(rows, cfg.micro_batch)
    accumulate_gradients(policy, cfg, rows, chunks, fixed_inputs(policy, cfg, rows, chunks))
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("algo,aggregate,kl", [("grpo", "sequence", 0.0), ("grpo", "token", 0.1),
                                               ("ppo", "token", 0.0)])
def test_a_chunked_update_has_the_gradients_of_the_unchunked_one(tiny, algo, aggregate, kl):
    model, tok = tiny
    batch = units(tok, algo)
    base = dict(algo=algo, aggregate=aggregate, kl_coef=kl, staleness_mode="importance")
    whole = gradients(model, tok, LearnerConfig(micro_batch=64, **base), batch)
    assert len(chunks_of(rows_of(batch), 64)) == 1
    assert len(chunks_of(rows_of(batch), 2)) >= 4
    chunked = gradients(model, tok, LearnerConfig(micro_batch=2, **base), batch)
    assert whole.keys() == chunked.keys() and len(whole) > 10
    assert max(float(g.abs().max()) for g in whole.values()) > 1e-4  # a real gradient, not zeros
    for name, g in whole.items():
        torch.testing.assert_close(chunked[name], g, rtol=0, atol=1e-6, msg=name)


def cut_gradients(model, tok, cfg: LearnerConfig, batch: list[Unit]) -> dict[str, torch.Tensor]:
    """`gradients` with the passes of a token budget: trajectories cut between steps."""
    policy = PolicyModel(model=copy.deepcopy(model), tokenizer=tok, value_head=cfg.algo == "ppo")
    if policy.value_head is not None:
        torch.manual_seed(1)
        torch.nn.init.normal_(policy.value_head.weight, std=0.1)
    policy.train()
    rows = rows_of(batch)
    pieces, chunks, origin = micro_batches(rows, cfg.micro_batch, cfg.micro_batch_tokens, step_costs(policy, rows))
    fixed = fixed_inputs(policy, cfg, rows, chunks, pieces=pieces)
    accumulate_gradients(policy, cfg, pieces, chunks, piece_inputs(fixed, pieces, origin))
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("algo,aggregate,kl,score", [("grpo", "sequence", 0.1, False), ("grpo", "token", 0.0, False),
                                                     ("ppo", "sequence", 0.0, False), ("grpo", "sequence", 0.1, True)])
def test_a_token_budget_cuts_trajectories_between_steps_with_the_same_gradients(tiny, algo, aggregate, kl, score):
    """learner.micro_batch_tokens bounds a pass's tokens; a trajectory over it is cut into pieces, each
    weighing its share of the trajectory in the 'sequence' loss: the gradient is the uncut one."""
    model, tok = tiny
    batch = scored(tok, units(tok, algo)) if score else units(tok, algo)
    rows = rows_of(batch)
    policy = PolicyModel(model=copy.deepcopy(model), tokenizer=tok)
    costs = step_costs(policy, rows)
    prompt = len(tok(rows[0].steps[0].policy_prompt, add_special_tokens=False)["input_ids"])
    # label mode: the prompt and its label; score mode: the prompt and every candidate's tokens
    assert costs[0][0] == prompt + (len(rows[0].steps[0].choice_token_ids) if score else 1)
    budget = max(c for r in costs for c in r) + 1  # about one step a pass: 3-step trajectories are cut
    pieces, chunks, origin = micro_batches(rows, 64, budget, costs)
    assert any(p.share < 1 for p in pieces) and len(pieces) > len(rows)
    for idx in chunks:  # the budget holds, but for a lone step over it
        assert sum(sum(costs[origin[i]][pieces[i].first:pieces[i].first + len(pieces[i].steps)]) for i in idx) <= budget
    for i, r in enumerate(rows):  # the pieces of a row are its steps, in order, once
        mine = [p for p, o in zip(pieces, origin) if o == i]
        assert [s for p in mine for s in p.steps] == r.steps and sum(p.share for p in mine) == pytest.approx(1.0)
    base = dict(algo=algo, aggregate=aggregate, kl_coef=kl, staleness_mode="importance")
    whole = gradients(model, tok, LearnerConfig(micro_batch=64, **base), batch)
    cut = cut_gradients(model, tok, LearnerConfig(micro_batch=64, micro_batch_tokens=budget, **base), batch)
    assert whole.keys() == cut.keys() and max(float(g.abs().max()) for g in whole.values()) > 1e-4
    for name, g in whole.items():
        torch.testing.assert_close(cut[name], g, rtol=0, atol=1e-6, msg=name)


def test_an_update_under_a_token_budget_moves_the_weights_as_without(tiny):
    """apply_update (what the learner calls) with learner.micro_batch_tokens: the same weights after two
    mini-batch steps as with whole trajectories. SGD, not AdamW: Adam's normalised step turns the float
    noise of a near-zero gradient entry into a full step either way."""
    model, tok = tiny
    batch = units(tok, "grpo")
    after = []
    for budget in (0, 60):
        cfg = LearnerConfig(minibatches=2, lr=1e-2, staleness_mode="importance", micro_batch=64,
                            micro_batch_tokens=budget, kl_coef=0.05)
        policy = PolicyModel(model=copy.deepcopy(model), tokenizer=tok)
        apply_update(policy, torch.optim.SGD(policy.trainable_parameters(), lr=cfg.lr), cfg, batch, version=0)
        after.append(dict(policy.named_parameters()))
    start = dict(model.named_parameters())
    assert max(float((p - start[n.split(".", 1)[1]]).detach().abs().max()) for n, p in after[0].items()) > 1e-5
    rows = rows_of(batch)
    assert len(micro_batches(rows, 64, 60, step_costs(PolicyModel(model=model, tokenizer=tok), rows))[0]) > len(rows)
    for name, p in after[0].items():
        torch.testing.assert_close(after[1][name], p, rtol=0, atol=1e-7, msg=name)


def test_minibatches_split_the_batch_by_whole_units():
    class U:  # only the unit sizes matter
        def __init__(self, n):
            self.trajs = [None] * n
    assert minibatch_bounds([U(4), U(4), U(4), U(4)], 2) == [(0, 8), (8, 16)]
    assert minibatch_bounds([U(3), U(2), U(4)], 2) == [(0, 5), (5, 9)]
    assert minibatch_bounds([U(4), U(4)], 5) == [(0, 4), (4, 8)]  # never more mini-batches than units
    assert minibatch_bounds([U(4)], 1) == [(0, 4)]


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_minibatches_step_on_inputs_fixed_before_the_first(tiny, algo):
    """`learner.minibatches=2` takes one clipped AdamW step per group, with the old log-probs and
    advantages computed once on the starting weights: the same weights as a slow loop that does so."""
    model, tok = tiny
    batch = units(tok, algo)
    cfg = LearnerConfig(algo=algo, minibatches=2, lr=1e-2, staleness_mode="importance", micro_batch=2)

    def fresh():
        policy = PolicyModel(model=copy.deepcopy(model), tokenizer=tok, value_head=algo == "ppo")
        return policy, torch.optim.AdamW(policy.trainable_parameters(), lr=cfg.lr)

    policy, opt = fresh()
    apply_update(policy, opt, cfg, batch, version=0)
    assert {int(s["step"]) for s in opt.state.values()} == {2}  # two optimizer steps

    ref, ref_opt = fresh()
    ref.train()
    rows = rows_of(batch)
    fixed = fixed_inputs(ref, cfg, rows, chunks_of(rows, cfg.micro_batch))  # once, before any step
    n0 = len(batch[0].trajs)
    for a, b in [(0, n0), (n0, len(rows))]:
        ref_opt.zero_grad()
        part = rows[a:b]
        accumulate_gradients(ref, cfg, part, chunks_of(part, cfg.micro_batch),
                             FixedInputs(fixed.old[a:b], fixed.isw[a:b], fixed.adv[a:b]))
        torch.nn.utils.clip_grad_norm_(ref.trainable_parameters(), cfg.max_grad_norm)
        ref_opt.step()
    got, want = dict(policy.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], rtol=0, atol=1e-6, msg=name)
    start = dict(model.named_parameters())
    moved = max(float((p.detach() - start[n.split(".", 1)[1]].detach()).abs().max()) for n, p in got.items() if n.startswith("lm."))
    assert moved > 1e-3  # the steps really moved the weights


def test_a_hot_rollout_is_read_at_the_temperature_it_sampled_at(tiny):
    """Label-mode steps sampled at 1.5 (sim-to-real's real phase, learner.s2r_temperature) carry the
    tempered behaviour log-prob; the learner reads the policy at each step's own temperature, so its
    log-probs before any step are the behaviour ones and an update's first ratio is 1 (read at 1, as
    until 2026-12-05, they differ). The reference: one plain forward per prompt, label logits / T."""
    model, tok = tiny
    batch = units(tok, "grpo")
    steps = [s for u in batch for t in u.trajs for s in t.steps]
    with torch.no_grad():
        for k, s in enumerate(steps):
            s.temperature = 1.5 if k % 2 else 1.0  # a mix: each step is read at its own
            ids = tok(s.policy_prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
            labels = [int(t) for t in s.choice_token_ids]
            row = torch.log_softmax(model(input_ids=ids).logits[0, -1, labels].float() / s.temperature, dim=-1)
            s.logprobs = [float(row[labels.index(s.action_token_ids[0])])]
    policy = PolicyModel(model=copy.deepcopy(model), tokenizer=tok)
    rows = rows_of(batch)
    mine, _ = proximal(policy, rows, chunks_of(rows, 4))
    behaviour = [lp for r in rows for s in r.steps for lp in s.logprobs]
    assert mine == pytest.approx(behaviour, abs=1e-5)
    for s in steps:
        s.temperature = 1.0  # as if every step had sampled at 1: the hot steps now read away from their log-probs
    cold, _ = proximal(policy, rows, chunks_of(rows, 4))
    assert max(abs(a - b) for a, b in zip(cold, behaviour)) > 1e-3
