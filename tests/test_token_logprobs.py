"""Generate mode on the learner's side (issue 60): token in, token out, trained token by token.

Checked here, each against a slow obvious version or the real engine:
- the chats: `build_sequences` lays out ids, mask and value positions as a plain loop over
  the design's contract does (new chat at `new_chat`, prompt ids masked out, reply ids in);
  malformed chats and a batch mixing modes are refused before any forward;
- the log-probs: `sequence_logprobs` (one forward per chat, a group's common prefix once)
  equals one forward per trained token;
- the update: `accumulate_gradients` on generate-mode rows (GRPO with both aggregations, the
  KL, importance-corrected rows; PPO with per-step GAE broadcast to tokens and the value loss
  per step), whole and in micro-batches, has the gradient of a per-token Python loop of the
  clipped surrogate (the loss to 1e-6; the gradients to 1e-6 + 1e-5 relative, fp32 sums
  taken in another order);
- the real embedded engine: a multi-turn chat generated turn by turn with `input_ids` and
  `return_logprob` (two episodes at once, so the engine batches them; one restarting its
  chat): each call's input_ids + output_ids is a prefix of the learner's sequence, the mask
  covers exactly the sampled ids, and the engine's log-probs equal the learner's recompute
  to 1e-4 in fp32 (the tiny model; SmolLM2 under the slow marker);
- one real `apply_update` moves the weights and each sampled token's log-prob the way of its
  advantage.
"""

from __future__ import annotations

import asyncio
import copy
import math
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from infra.config import LearnerConfig
from infra.engine.models import load_tokenizer
from infra.schema import Status, Step, Task, Trajectory
from learner.advantages import gae, group_advantages
from learner.policy_model import PolicyModel
from learner.token_logprobs import (TokenSequence, build_sequences, check_chat, sequence_logprobs, token_logprobs,
                                    trained_indices)
from learner.update import (Unit, accumulate_gradients, apply_update, chunks_of, fixed_inputs, plan, rows_of,
                            trainable_steps)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    tok = load_tokenizer("smollm2")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval(), tok


def gen_step(prompt: list[int], reply: list[int], lps: list[float], new_chat: bool, mask: list[int] | None = None,
             reward: float = 0.0) -> Step:
    return Step(state="s", action="a", reward=reward, prompt_token_ids=list(prompt), action_token_ids=list(reply),
                logprobs=list(lps), loss_mask=list(mask) if mask is not None else [1] * len(reply), new_chat=new_chat,
                reply="r", policy_prompt="chat text (never tokenised by the learner)")


# ---------------------------------------------------------------- the chats, against a plain loop

def slow_sequences(steps: list[Step]) -> list[tuple[list[int], list[int], list[int]]]:
    """(ids, mask, value positions) per chat, written out from the design's words."""
    out = []
    for s in steps:
        if s.new_chat:
            out.append(([], [], []))
        ids, mask, vpos = out[-1]
        for t in s.prompt_token_ids:
            ids.append(t)
            mask.append(0)
        first = len(ids)
        any_trained = False
        for j, t in enumerate(s.action_token_ids):
            ids.append(t)
            m = s.loss_mask[j] if s.loss_mask else 1
            mask.append(m)
            any_trained = any_trained or m == 1
        if any_trained:
            vpos.append(first - 1)
    return out


def random_chat(rng: random.Random, turns: int, restart_at: int | None = None, vocab: int = 1000,
                masked_step: int | None = None) -> list[Step]:
    steps = []
    for t in range(turns):
        new = t == 0 or t == restart_at
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(6, 12) if new else rng.randint(2, 5))]
        reply = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        mask = [1] * len(reply)
        if t == masked_step:
            mask[0] = 0
        steps.append(gen_step(prompt, reply, [-rng.uniform(0.1, 8.0) for _ in reply], new, mask,
                              reward=1.0 if t == turns - 1 and rng.random() < 0.5 else 0.0))
    return steps


def test_sequences_are_the_chat_laid_out_as_the_design_says():
    rng = random.Random(0)
    for k in range(30):
        steps = random_chat(rng, rng.randint(1, 6), restart_at=rng.choice([None, 2, 3]),
                            masked_step=rng.choice([None, 0, 1]))
        got = build_sequences(steps)
        want = slow_sequences(steps)
        assert [(q.ids, q.mask, q.value_positions) for q in got] == want
        assert [i for q in got for i in q.steps] == [i for i, s in enumerate(steps) if trained_indices(s)]
        assert sum(sum(q.mask) for q in got) == sum(len(trained_indices(s)) for s in steps)
    restarted = build_sequences(random_chat(random.Random(1), 5, restart_at=3))
    assert len(restarted) == 2 and [q.steps for q in restarted] == [[0, 1, 2], [3, 4]]


def test_malformed_chats_are_refused_and_set_aside():
    ok = [gen_step([5, 6, 7], [8, 9], [-1.0, -2.0], True), gen_step([10], [11], [-0.5], False)]
    check_chat(ok)
    bad = {
        "first step does not open a chat": [gen_step([5], [8], [-1.0], False)],
        "opens a chat without prompt ids": [gen_step([], [8], [-1.0], True)],
        "2 log-probs for 1 sampled": [gen_step([5], [8], [-1.0, -2.0], True)],
        "loss-mask entries": [gen_step([5], [8, 9], [-1.0, -2.0], True, mask=[1])],
        "choice-mode labels": [ok[0], Step(state="s", action="a", prompt_token_ids=[3], action_token_ids=[4],
                                            logprobs=[-1.0], loss_mask=[1], choice_token_ids=[4, 5])],
    }
    for words, steps in bad.items():
        with pytest.raises(ValueError, match=words.split()[0]):
            check_chat(steps)
        traj = Trajectory(task_id="t", group_id="g", steps=steps)
        assert trainable_steps(traj) == []  # the batcher sets it aside as broken
        with pytest.raises(ValueError):
            plan([Unit([traj], [1.0], [False])], LearnerConfig())
    with pytest.raises(IndexError, match="beyond the policy's vocabulary"):
        check_chat([gen_step([5, 50_000], [8], [-1.0], True)], vocab=49_152)
    traj = Trajectory(task_id="t", group_id="g", steps=ok)
    assert trainable_steps(traj) == ok
    masked = Trajectory(task_id="t", group_id="g", steps=[ok[0], gen_step([10], [11], [-0.5], False, mask=[0])])
    assert trainable_steps(masked) == [ok[0]]  # a step with no trained token is in the chat, not a row's step


def test_a_batch_mixing_generate_and_label_mode_is_refused():
    gen = Trajectory(task_id="t", group_id="g", steps=[gen_step([5, 6], [8], [-1.0], True)])
    label = Trajectory(task_id="t", group_id="g", steps=[Step(state="s", action="a", policy_prompt="p",
                                                              action_token_ids=[4], logprobs=[-1.0], loss_mask=[1],
                                                              choice_token_ids=[4, 5])])
    with pytest.raises(ValueError, match="mixes generate-mode"):
        plan([Unit([gen, label], [1.0, -1.0], [False, False])], LearnerConfig())


# ---------------------------------------------------------------- log-probs, against one forward per token

def slow_token_logprob(model, ids: list[int], p: int, temperature: float = 1.0) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([ids[:p]])).logits[0, -1]
    return torch.log_softmax(logits.float() / temperature, -1)[ids[p]]


def slow_hidden(model, ids: list[int], upto: int) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids[:upto + 1]]), output_hidden_states=True).hidden_states[-1][0, -1]


@pytest.mark.parametrize("share_prefix", [True, False])
def test_sequence_logprobs_equal_one_forward_per_token(tiny, share_prefix):
    model, _ = tiny
    rng = random.Random(3)
    common = [rng.randrange(1000) for _ in range(40)]  # a GRPO group's shared first turn: past SHARE_MIN_TOKENS
    trajs = []
    for k in range(3):
        steps = random_chat(rng, 3, restart_at=2 if k == 1 else None, masked_step=1 if k == 2 else None)
        steps[0].prompt_token_ids = common + steps[0].prompt_token_ids[:2 + k]
        trajs.append(steps)
    seqs = [q for steps in trajs for q in build_sequences(steps)]
    with torch.no_grad():
        got, hidden, tokens = sequence_logprobs(model, seqs, want_hidden=True, share_prefix=share_prefix)
        want = [slow_token_logprob(model, q.ids, p) for q in seqs for p in q.trained_positions]
        want_h = [slow_hidden(model, q.ids, v) for q in seqs for v in q.value_positions]
    assert got.shape == (len(want),) and hidden.shape[0] == len(want_h)
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden, torch.stack(want_h), rtol=0, atol=1e-5)
    total = sum(len(q.ids) for q in seqs)
    assert tokens < total if share_prefix else tokens == total  # the common prefix ran once


# ---------------------------------------------------------------- the token-level update, against a loop

def generate_units(model, tok, algo: str, seed: int = 0) -> list[Unit]:
    """Two groups of three generate-mode trajectories (1-3 turns, one restarting its chat, one with a
    masked token); behaviour log-probs = the model's own plus noise, so ratios sit away from 1."""
    rng = random.Random(seed)
    out = []
    for g in range(2):
        trajs = []
        first = [rng.randrange(len(tok)) for _ in range(36)]  # the group's shared first prompt
        for i in range(3):
            n = 1 + (g + i) % 3
            steps = random_chat(rng, n, restart_at=2 if n == 3 else None, vocab=len(tok),
                                masked_step=0 if (g, i) == (1, 1) else None)
            steps[0].prompt_token_ids = first + steps[0].prompt_token_ids
            for t, s in enumerate(steps):
                s.reward = float(i % 2) if t == n - 1 else 0.1 * t
            with torch.no_grad():
                lps = token_logprobs(model, steps)
            for s, mine in zip(steps, lps):
                noisy = iter(x + rng.uniform(-0.4, 0.4) for x in mine)
                s.logprobs = [min(0.0, next(noisy)) if j in trained_indices(s) else -3.0
                              for j in range(len(s.action_token_ids))]
            trajs.append(Trajectory(task_id=f"t{g}", group_id=f"g{g}", steps=steps, status=Status.FAILURE))
        adv = group_advantages([t.total_reward for t in trajs]) if algo == "grpo" else None
        out.append(Unit(trajs, adv, [i == 1 for i in range(3)]))  # one importance-corrected member each
    return out


def slow_loss(policy: PolicyModel, cfg: LearnerConfig, units: list[Unit]) -> torch.Tensor:
    """The token-level GRPO/PPO loss of the whole batch, one token at a time, as the issue words it;
    with learner.logprob_temperature T the policy is softmax(logits / T): its log-probs, its old ones
    (its own, no grad: the engine's are at 1) and the reference's, while a corrected trajectory's IS
    weight compares log-probs at 1 with the engine's."""
    lm, ref_lm, temp = policy.lm, policy._ref, cfg.logprob_temperature
    surr_rows, kl_rows, vl_terms = [], [], []
    for u in units:
        for ti, traj in enumerate(u.trajs):
            steps = [s for s in traj.steps if trained_indices(s)]
            seqs = build_sequences(traj.steps)
            where = {}  # step index -> (sequence, position of each trained token, value position)
            for q in seqs:
                for si, v in zip(q.steps, q.value_positions):
                    first = v + 1
                    where[si] = (q, [first + j for j in trained_indices(traj.steps[si])], v)
            values = []
            for si in sorted(where):
                q, _, v = where[si]
                values.append(policy.value_head(slow_hidden(lm, q.ids, v)).squeeze(-1)
                              if policy.value_head is not None else torch.zeros(()))
            if cfg.algo == "ppo":
                v0 = [float(x.detach()) for x in values]
                a, ret = gae([s.reward for s in steps], v0, cfg.gamma, cfg.gae_lambda)
            surr, kls = [], []
            for k, si in enumerate(sorted(where)):
                q, positions, _ = where[si]
                s = traj.steps[si]
                for j, p in zip(trained_indices(s), positions):
                    lp = slow_token_logprob(lm, q.ids, p, temp)
                    mu = s.logprobs[j]
                    if u.corrected[ti]:
                        old = float(lp.detach())
                        isw = min(cfg.is_cap, math.exp(float(slow_token_logprob(lm, q.ids, p)) - mu))
                    else:
                        old, isw = (mu if temp == 1.0 else float(lp.detach())), 1.0
                    adv = u.advantages[ti] if cfg.algo == "grpo" else a[k]
                    ratio = torch.exp(lp - old)
                    surr.append(torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
                                * isw)
                    if cfg.kl_coef > 0:
                        with torch.no_grad():
                            ref = slow_token_logprob(ref_lm, q.ids, p, temp)
                        kls.append(torch.exp(ref - lp) - (ref - lp) - 1)
                if cfg.algo == "ppo":
                    vl_terms.append(0.5 * (values[k] - ret[k]) ** 2)  # old value = value: the clip is inactive
            surr_rows.append(surr)
            kl_rows.append(kls)
    if cfg.aggregate == "sequence":
        pl = -sum(sum(r) / len(r) for r in surr_rows) / len(surr_rows)
        kl = sum(sum(r) / len(r) for r in kl_rows) / len(kl_rows) if cfg.kl_coef > 0 else 0.0
    else:
        pl = -sum(x for r in surr_rows for x in r) / sum(len(r) for r in surr_rows)
        kl = sum(x for r in kl_rows for x in r) / sum(len(r) for r in kl_rows) if cfg.kl_coef > 0 else 0.0
    loss = pl + cfg.kl_coef * kl
    if cfg.algo == "ppo":
        loss = loss + cfg.value_coef * sum(vl_terms) / len(vl_terms)
    return loss


def fresh_policy(model, tok, cfg: LearnerConfig) -> PolicyModel:
    policy = PolicyModel(model=copy.deepcopy(model), tokenizer=tok, value_head=cfg.algo == "ppo")
    torch.manual_seed(1)
    if policy.value_head is not None:  # a non-zero head, so the value loss has a gradient everywhere
        torch.nn.init.normal_(policy.value_head.weight, std=0.1)
    if cfg.kl_coef > 0:  # a reference away from the policy, so the KL and its gradient are not zero
        policy.snapshot_reference()
        with torch.no_grad():
            for p in policy.lm.parameters():
                p.add_(torch.randn_like(p) * 0.02)
    policy.train()
    return policy


@pytest.mark.parametrize("algo,aggregate,kl,micro_batch,temp", [  # the whole-batch cases are slow: 15-30 s each here
    pytest.param("grpo", "sequence", 0.0, 64, 1.0, marks=pytest.mark.slow), ("grpo", "sequence", 0.0, 2, 1.0),
    pytest.param("grpo", "token", 0.1, 64, 1.0, marks=pytest.mark.slow), ("grpo", "token", 0.1, 1, 1.0),
    pytest.param("ppo", "token", 0.0, 64, 1.0, marks=pytest.mark.slow), ("ppo", "sequence", 0.0, 2, 1.0),
    ("grpo", "sequence", 0.1, 2, 1.5), pytest.param("ppo", "token", 0.0, 2, 0.7, marks=pytest.mark.slow)])
def test_the_token_level_update_has_the_gradient_of_a_per_token_loop(tiny, algo, aggregate, kl, micro_batch, temp):
    model, tok = tiny
    cfg = LearnerConfig(algo=algo, aggregate=aggregate, kl_coef=kl, staleness_mode="importance",
                        micro_batch=micro_batch, clip_eps=0.1, logprob_temperature=temp)
    batch = generate_units(model, tok, algo)
    policy = fresh_policy(model, tok, cfg)
    rows = rows_of(batch)
    chunks = chunks_of(rows, cfg.micro_batch)
    assert len(chunks) == 1 if micro_batch == 64 else len(chunks) >= 4
    fixed = fixed_inputs(policy, cfg, rows, chunks)
    assert [len(o) for o in fixed.old] == [sum(len(trained_indices(s)) for s in r.steps) for r in rows]
    out = accumulate_gradients(policy, cfg, rows, chunks, fixed)
    got = {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}

    ref = fresh_policy(model, tok, cfg)
    loss = slow_loss(ref, cfg, batch)
    loss.backward()
    want = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    assert out["loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
    if temp == 1.0:
        assert 0.0 < out["clip"] < 1.0  # some tokens' ratios were clipped, some were not
    else:  # every old log-prob is the policy's own at T: the first step's ratios are all 1
        assert out["clip"] == 0.0
    if kl:
        assert out["kl"] > 1e-4
    assert got.keys() == want.keys() and len(got) > 10
    assert max(float(g.abs().max()) for g in got.values()) > 1e-4  # a real gradient, not zeros
    for name, g in got.items():  # fp32 sums in another order: the tied embedding's entries reach 0.3
        torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_ppo_broadcasts_each_steps_gae_to_its_tokens(tiny):
    model, tok = tiny
    cfg = LearnerConfig(algo="ppo", gamma=0.9, gae_lambda=0.8)
    batch = generate_units(model, tok, "ppo")
    policy = fresh_policy(model, tok, cfg)
    rows = rows_of(batch)
    fixed = fixed_inputs(policy, cfg, rows, chunks_of(rows, cfg.micro_batch))
    for r, adv in zip(rows, fixed.adv):
        with torch.no_grad():
            _, values = policy.forward_tokens(build_sequences(r.traj.steps))
        a, ret = gae([s.reward for s in r.steps], values.tolist(), 0.9, 0.8)
        want = [(a[k], ret[k], values[k].item()) for k, s in enumerate(r.steps) for _ in trained_indices(s)]
        assert len(adv) == len(want)
        for x, y in zip(adv, want):
            assert x == pytest.approx(y, abs=1e-5)


@pytest.mark.parametrize("rule", ["outcome", "never_positive"])
def test_an_invalid_replys_tokens_never_get_a_positive_advantage_when_asked(tiny, rule):
    model, tok = tiny
    cfg = LearnerConfig(algo="grpo", invalid_advantage=rule)
    batch = generate_units(model, tok, "grpo")
    for u in batch:  # the first step of every trajectory wrote an invalid reply
        for t in u.trajs:
            t.steps[0].valid = False
    rows = rows_of(batch)
    fixed = fixed_inputs(fresh_policy(model, tok, cfg), cfg, rows, chunks_of(rows, cfg.micro_batch))
    signs, invalid_in_winners = set(), 0
    for r, adv in zip(rows, fixed.adv):
        want = [(0.0 if rule == "never_positive" and not s.valid and r.advantage > 0 else r.advantage)
                for s in r.steps for _ in trained_indices(s)]
        assert [a for a, _, _ in adv] == pytest.approx(want)
        signs.add(r.advantage > 0)
        invalid_in_winners += sum(1 for s in r.steps if not s.valid and r.advantage > 0)
    assert signs == {True, False} and invalid_in_winners > 0  # both kinds of trajectory, and the rule had work


def test_one_update_moves_each_sampled_token_the_way_of_its_advantage(tiny):
    model, tok = tiny
    cfg = LearnerConfig(algo="grpo", aggregate="token", lr=1e-3, micro_batch=4)
    rng = random.Random(7)
    trajs = []
    for i in range(4):  # each trajectory samples its own tokens, so their moves do not cancel
        prompt = [rng.randrange(1000) for _ in range(10)]
        steps = [gen_step(prompt, [2000 + 10 * i + k for k in range(3)], [0.0] * 3, True, reward=float(i % 2)),
                 gen_step([rng.randrange(1000) for _ in range(3)], [3000 + 10 * i + k for k in range(2)], [0.0] * 2,
                          False)]
        trajs.append(Trajectory(task_id="t", group_id="g", steps=steps))
    policy = PolicyModel(model=copy.deepcopy(model), tokenizer=tok)
    with torch.no_grad():
        for t in trajs:
            for s, lps in zip(t.steps, token_logprobs(policy.lm, t.steps)):
                s.logprobs = lps  # on-policy: the ratio starts at 1
    adv = group_advantages([t.total_reward for t in trajs])
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    opt = torch.optim.SGD(policy.trainable_parameters(), lr=0.5)
    stats = apply_update(policy, opt, cfg, [Unit(trajs, adv, [False] * 4)], version=0)
    assert stats.action_tokens == 4 * 5 and stats.steps == 8 and stats.tokens > 0
    assert max(float((p.detach() - before[n]).abs().max()) for n, p in policy.named_parameters()) > 1e-4
    with torch.no_grad():
        for t, a in zip(trajs, adv):
            after = [x for lps in token_logprobs(policy.lm, t.steps) for x in lps]
            old = [x for s in t.steps for x in s.logprobs]
            moved = [y - x for x, y in zip(old, after)]
            assert all(m * a > 0 for m in moved), (a, moved)


# ---------------------------------------------------------------- the real engine

def chat_delta(tok, user: str, closing: str) -> str:
    """The template's text between one assistant reply and the next (the design's rule, written here
    again so this test does not lean on the worker's code)."""
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    head = tok.apply_chat_template(base, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(base + [{"role": "assistant", "content": "A"}, {"role": "user", "content": user}],
                                   tokenize=False, add_generation_prompt=True)
    assert full.startswith(head + "A")
    delta = full[len(head) + 1:]
    return delta[len(closing):] if closing and delta.startswith(closing) else delta


async def play_chat(client, tok, key: str, turns: int, restart_at: int | None) -> tuple[list[Step], list[list[int]]]:
    """One episode generated turn by turn through the engine; (its Steps, each call's input_ids + output_ids)."""
    steps, seen, chat = [], [], []
    for t in range(turns):
        obs = f"Room {t} of episode {key}. You see a coin and a box. Available: take coin, open box."
        if t == 0 or t == restart_at:
            text = tok.apply_chat_template([{"role": "system", "content": "Think, then act."},
                                            {"role": "user", "content": obs}], tokenize=False,
                                           add_generation_prompt=True)
            prompt, chat, new = tok.encode(text, add_special_tokens=False), [], True
        else:
            last = chat[-1]
            closing = tok.decode([last]) if last in tok.all_special_ids else ""
            prompt, new = tok.encode(chat_delta(tok, obs, closing), add_special_tokens=False), False
        ids = chat + prompt
        res = await client.generate(input_ids=ids, return_logprob=True, affinity_key=key,
                                    sampling_params={"temperature": 1.0, "max_new_tokens": 8})
        assert len(res.output_ids) == len(res.output_logprobs) > 0
        steps.append(Step(state=obs, action="", prompt_token_ids=prompt, new_chat=new,
                          action_token_ids=list(res.output_ids), logprobs=list(res.output_logprobs),
                          loss_mask=[1] * len(res.output_ids), reply=tok.decode(res.output_ids)))
        chat = ids + list(res.output_ids)
        seen.append(chat)
    return steps, seen


async def _engine_equals_learner(model, tok, via_policy: bool):
    from infra.engine.client import EngineClient
    from infra.engine.server import start_embedded_engine

    engine = await start_embedded_engine(loaded=(model, tok), max_batch_size=8)
    try:
        async with EngineClient([engine.url], role="policy") as client:
            played = await asyncio.gather(play_chat(client, tok, "ep0", 4, None), play_chat(client, tok, "ep1", 4, 2))
    finally:
        await engine.stop()
    policy = PolicyModel(model=copy.deepcopy(model), tokenizer=tok) if via_policy else None
    worst = 0.0
    for steps, seen in played:
        seqs = build_sequences(steps)
        assert len(seqs) == (1 if not any(s.new_chat for s in steps[1:]) else 2)
        k = 0
        for q in seqs:  # each call's input_ids + output_ids is a prefix of its chat, turn by turn
            for si in q.steps:
                assert q.ids[:len(seen[si])] == seen[si]
                k += 1
            assert q.ids == seen[q.steps[-1]]
            generated = [p for si in q.steps for p in range(len(seen[si]) - len(steps[si].action_token_ids),
                                                            len(seen[si]))]
            assert q.trained_positions == generated  # the mask covers exactly the sampled ids
        assert k == len(steps)
        with torch.no_grad():
            mine = policy.forward_tokens(seqs)[0] if via_policy else sequence_logprobs(model, seqs)[0]
        engine_lps = [x for s in steps for x in s.logprobs]
        assert len(mine) == len(engine_lps)
        worst = max(worst, max(abs(a - b) for a, b in zip(mine.tolist(), engine_lps)))
    assert worst <= 1e-4, worst
    return worst


async def test_engine_logprobs_equal_the_learners_token_recompute(tiny):
    model, tok = tiny
    await _engine_equals_learner(model, tok, via_policy=True)


@pytest.mark.slow
@pytest.mark.model
async def test_engine_logprobs_equal_the_learners_token_recompute_smollm2(smollm2):
    model, tok = smollm2
    await _engine_equals_learner(model, tok, via_policy=False)


# ---------------------------------------------------------------- FSDP ranks (learner/fsdp.py)

FSDP_CASES = [("grpo", "sequence", 0.0), ("grpo", "token", 0.1), ("ppo", "token", 0.0)]


def _fsdp_cfg(algo: str, aggregate: str, kl: float) -> LearnerConfig:
    return LearnerConfig(algo=algo, aggregate=aggregate, kl_coef=kl, staleness_mode="importance", micro_batch=3,
                         clip_eps=0.1)


def _fsdp_policy(policy: PolicyModel, cfg: LearnerConfig) -> PolicyModel:
    if policy.value_head is not None:
        torch.manual_seed(1)
        torch.nn.init.normal_(policy.value_head.weight, std=0.1)
    if cfg.kl_coef > 0:
        policy.snapshot_reference()
    return policy


def _generate_accumulate_on_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from infra.engine.models import load_model
    from learner.fsdp import shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, tok = load_model(model_dir)
    got = []
    for algo, aggregate, kl in FSDP_CASES:
        cfg = _fsdp_cfg(algo, aggregate, kl)
        policy = _fsdp_policy(PolicyModel(model_dir, value_head=algo == "ppo"), cfg)
        share = shard(policy, world, "cpu")
        policy.train()
        rows = rows_of(generate_units(model, tok, algo))
        chunks = chunks_of(rows, cfg.micro_batch)
        accumulate_gradients(policy, cfg, rows, chunks, fixed_inputs(policy, cfg, rows, chunks, share), share)
        got.append({n: p.grad.full_tensor() for n, p in policy.named_parameters() if p.grad is not None})
    if rank == 0:
        torch.save(got, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_fsdp_ranks_accumulate_the_single_process_token_gradients(tiny, tmp_path):
    """Generate-mode micro-batches dealt to two gloo ranks (one runs a zero-weighted stand-in):
    the summed gradients are the single process's."""
    import socket

    import torch.multiprocessing as mp

    model, tok = tiny
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "grads.pt"
    mp.spawn(_generate_accumulate_on_rank, args=(2, port, str(model_dir), str(out)), nprocs=2)
    got = torch.load(out)
    assert len(chunks_of(rows_of(generate_units(model, tok, "grpo")), 3)) % 2 == 1  # rank 1 ran a stand-in
    for (algo, aggregate, kl), grads in zip(FSDP_CASES, got):
        cfg = _fsdp_cfg(algo, aggregate, kl)
        policy = _fsdp_policy(PolicyModel(model=copy.deepcopy(model), tokenizer=tok, value_head=algo == "ppo"), cfg)
        policy.train()
        rows = rows_of(generate_units(model, tok, algo))
        chunks = chunks_of(rows, cfg.micro_batch)
        accumulate_gradients(policy, cfg, rows, chunks, fixed_inputs(policy, cfg, rows, chunks))
        want = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
        assert grads.keys() == want.keys() and len(want) > 10
        for name, g in want.items():
            torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-5, msg=f"{algo} {aggregate} {kl} {name}")


# ---------------------------------------------------------------- through `dreamgym train`

@pytest.mark.slow
@pytest.mark.parametrize("temp", [1.0, 1.5])
async def test_dreamgym_train_trains_the_replies_the_workers_sampled(tiny_run, redis_url, temp):
    """The driver's `train` in generate mode on real TextWorld games (PPO, which keeps the tiny model's
    all-invalid, equal-reward groups that GRPO would filter): one update, and the tokens it trained are
    exactly the reply tokens of the trajectories the workers pushed; also with rollouts sampled at 1.5
    and the learner training that tempered policy (learner.logprob_temperature)."""
    import redis.asyncio as aioredis

    from infra.config import load_config
    from infra.run.driver import train
    from infra.schema import decode_as
    from infra.streams import DATA_FIELD, run_prefix, trajectories_stream

    cfg = load_config(None, [*tiny_run, "actors.action_mode=generate", "actors.multi_turn=true",
                             "actors.max_reply_tokens=6", "actors.max_steps=2", "learner.algo=ppo",
                             "learner.total_updates=1", "learner.warm_start_steps=0", "learner.checkpoint_every=5",
                             f"actors.temperature={temp}", f"learner.logprob_temperature={temp}"])
    summary = await train(cfg, "gen-ppo", evaluate=False)
    assert summary["updates"] == 1
    row = summary["history"][0]
    client = aioredis.Redis.from_url(redis_url)
    try:
        entries = await client.xrange(trajectories_stream(run_prefix(cfg.infra.stream_prefix, "gen-ppo")))
    finally:
        await client.aclose()
    trajs = [decode_as(fields[DATA_FIELD], Trajectory) for _, fields in entries]
    assert trajs and all(t.steps and t.steps[0].new_chat and not t.steps[0].choice_token_ids for t in trajs)
    for t in trajs:
        build_sequences(t.steps)  # well-made chats
    per_traj = [sum(len(s.action_token_ids) for s in t.steps) for t in trajs]
    assert row["action_tokens"] in {sum(per_traj[:k]) for k in range(1, len(per_traj) + 1)}  # the first k pushed
    assert row["tokens"] > row["action_tokens"] > 0
    # the update's row says how many of the steps it trained named no legal action (the tiny model: most)
    k = next(k for k in range(1, len(per_traj) + 1) if sum(per_traj[:k]) == row["action_tokens"])
    steps = [s for t in trajs[:k] for s in t.steps]
    assert row["invalid_share"] == pytest.approx(sum(1 for s in steps if s.invalid_reason) / len(steps))
    assert 0.0 <= row["clip_fraction"] <= 1.0
