"""Packed multi-turn updates: one forward per trajectory, the same numbers as one per step.

In multi-turn mode (actors/policy.py `choice_turn`) each step's prompt is the episode's
chat so far, so a trajectory's prompts chain and `pack_prompts` turns them into one
sequence read at one position per step. Checked here:
- the chain: each prompt starts with the previous one plus its chosen letter; per-step
  prompts and a chat restarted past `chat_max_chars` do not chain;
- the log-probs: packed == each prompt on its own (a tiny random Llama and the real
  SmolLM2), and == the behaviour log-probs the real embedded engine returned, to 1e-4;
- the update: gradients of `accumulate_gradients` on packed trajectories == those of
  a slow obvious reference (one forward per step, the GRPO loss written out in loops).
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors.policy import LABELS, PolicyDecision, choice_turn
from learner.choice_logprobs import choice_logprobs, pack_prompts
from infra.config import LearnerConfig
from infra.engine.models import load_tokenizer
from infra.schema import Status, Step, Task, Trajectory
from learner.advantages import group_advantages
from learner.policy_model import PolicyModel
from learner.update import Unit, accumulate_gradients, chunks_of, fixed_inputs, rows_of

TASK = Task("t1", "take the coin and put it in the box")
ROOMS = ["Kitchen", "Hall", "Study", "Cellar"]
CANDS = ["go north", "take coin", "open box", "look"]


def state(t: int) -> str:
    return (f"Room: {ROOMS[t % len(ROOMS)]}. A table, a coin.\nInventory: nothing\nActions:\n"
            + "\n".join(f"[{k + 1}] {c}" for k, c in enumerate(CANDS)))


def episode(tok, choices, multi_turn=True, max_chat_chars=12_000, task=TASK):
    """The turns a worker would build for `choices` (candidate indices), as decisions."""
    history: list = []
    for t, c in enumerate(choices):
        turn = choice_turn(tok, task, state(t), CANDS, history, 3, multi_turn, max_chat_chars)
        history.append(PolicyDecision(CANDS[c], c, turn.prompt, [turn.labels[c]], [0.0], turn.labels, 0,
                                      messages=turn.messages))
    return history


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def tiny(tok):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(cfg).eval(), tok


def test_multi_turn_prompts_chain_and_pack_into_one_segment(tok):
    turns = episode(tok, [1, 0, 3, 2])
    for prev, cur in zip(turns, turns[1:]):
        assert cur.prompt.startswith(prev.prompt + LABELS[prev.index] + "<|im_end|>")
        assert cur.prompt.count("Goal:") == 1 and cur.prompt.endswith("<|im_start|>assistant\n")
    assert turns[0].prompt.count("<|im_start|>system") == 1 and "Previous actions" not in turns[-1].prompt
    segs = pack_prompts(tok, [d.prompt for d in turns], [d.action_token_ids[0] for d in turns])
    assert len(segs) == 1 and segs[0].steps == [0, 1, 2, 3]
    ids = tok(turns[-1].prompt, add_special_tokens=False)["input_ids"]
    assert segs[0].ids == ids and segs[0].positions[-1] == len(ids) - 1
    for d, pos, nxt in zip(turns, segs[0].positions, turns[1:]):
        assert pos == len(tok(d.prompt, add_special_tokens=False)["input_ids"]) - 1
        assert ids[pos + 1] == d.action_token_ids[0]  # the chosen label follows each step's prompt

    # Per-step prompts do not chain; a chat past chat_max_chars restarts (a new segment).
    flat = episode(tok, [1, 0, 3, 2], multi_turn=False)
    assert not flat[0].messages and "Previous actions: take coin; go north; look" in flat[3].prompt
    assert len(pack_prompts(tok, [d.prompt for d in flat], [d.action_token_ids[0] for d in flat])) == 4
    short = episode(tok, [1, 0, 3, 2], max_chat_chars=len(turns[1].prompt) - 1)
    assert short[2].prompt.count("Goal:") == 1 and short[2].prompt.startswith("<|im_start|>system")
    assert "Previous actions: take coin; go north" in short[2].prompt
    segs = pack_prompts(tok, [d.prompt for d in short], [d.action_token_ids[0] for d in short])
    assert [s.steps for s in segs] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("share", [False, True])
def test_packed_logprobs_equal_one_forward_per_step(tiny, share):
    model, tok = tiny
    a, b = episode(tok, [1, 0, 3, 2]), episode(tok, [2, 2, 0])  # same task and first state: a shared first turn
    lone = episode(tok, [0], multi_turn=False)
    steps = a + lone + b + lone  # two packed trajectories, a lone prompt twice (deduplicated)
    pm = PolicyModel(model=model, tokenizer=tok)
    pm.share_prefix = share
    with torch.no_grad():
        packed, _ = pm.forward_choice([d.prompt for d in steps], [d.choice_token_ids for d in steps],
                                      [d.action_token_ids[0] for d in steps])
        single = torch.cat([choice_logprobs(model, tok, [d.prompt], [d.choice_token_ids], d.action_token_ids)
                            for d in steps])
    torch.testing.assert_close(packed, single, rtol=0, atol=1e-5)
    # Tokens through the model: each packed trajectory once (their common first turn once when
    # shared), the lone prompt once.
    ids = [tok(d.prompt, add_special_tokens=False)["input_ids"] for d in (a[-1], b[-1], lone[0])]
    first = len(tok(a[0].prompt, add_special_tokens=False)["input_ids"])
    common = next(i for i, (x, y) in enumerate(zip(ids[0], ids[1])) if x != y)
    assert common == first  # they part at the first chosen label
    assert pm.last_tokens == sum(map(len, ids)) - (common if share else 0)
    per_step = sum(len(tok(d.prompt, add_special_tokens=False)["input_ids"]) for d in a + b)
    assert len(ids[0]) + len(ids[1]) < per_step / 2  # packing runs far fewer tokens than one prompt per step


def units(tok, model, n_groups=2, group_size=3) -> list[Unit]:
    """GRPO groups of multi-turn trajectories (1-4 steps), behaviour log-probs slightly off-policy."""
    out = []
    for g in range(n_groups):
        task = Task(f"t{g}", f"open the box in the {ROOMS[g].lower()}")
        trajs = []
        for i in range(group_size):
            n = 1 + (g + 2 * i) % 4
            turns = episode(tok, [(g + i + t) % len(CANDS) for t in range(n)], task=task)
            with torch.no_grad():
                lps = [float(choice_logprobs(model, tok, [d.prompt], [d.choice_token_ids], d.action_token_ids)[0])
                       for d in turns]
            steps = [Step(state=state(t), action=d.action, reward=float(i % 2) if t == n - 1 else 0.0,
                          done=t == n - 1, policy_prompt=d.prompt, action_token_ids=d.action_token_ids,
                          logprobs=[lp - 0.05 * (t + 1) * (-1) ** i], loss_mask=[1], choice_token_ids=d.choice_token_ids)
                     for t, (d, lp) in enumerate(zip(turns, lps))]
            trajs.append(Trajectory(task_id=task.task_id, group_id=f"g{g}", steps=steps, status=Status.FAILURE,
                                    task=task))
        out.append(Unit(trajs, group_advantages([t.total_reward for t in trajs]), [False] * group_size))
    return out


def reference_gradients(model, tok, cfg: LearnerConfig, batch: list[Unit]) -> dict[str, torch.Tensor]:
    """The GRPO loss written out: one forward per step, loops over trajectories and steps."""
    policy = PolicyModel(model=copy.deepcopy(model), tokenizer=tok)
    policy.train()
    ref_model = copy.deepcopy(model).eval()
    per_traj = []
    for u in batch:
        for traj, adv in zip(u.trajs, u.advantages):
            terms = []
            for s in traj.steps:
                logp = choice_logprobs(policy.lm, tok, [s.policy_prompt], [s.choice_token_ids], s.action_token_ids)[0]
                ratio = torch.exp(logp - s.logprobs[0])
                surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
                term = -surrogate
                if cfg.kl_coef > 0:
                    with torch.no_grad():
                        ref = choice_logprobs(ref_model, tok, [s.policy_prompt], [s.choice_token_ids],
                                              s.action_token_ids)[0]
                    term = term + cfg.kl_coef * (torch.exp(ref - logp) - (ref - logp) - 1)
                terms.append(term)
            per_traj.append(terms)
    if cfg.aggregate == "sequence":
        loss = sum(sum(t) / len(t) for t in per_traj) / len(per_traj)
    else:
        loss = sum(sum(t) for t in per_traj) / sum(len(t) for t in per_traj)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}


def packed_gradients(model, tok, cfg: LearnerConfig, batch: list[Unit], share: bool = True) -> tuple[dict, int]:
    policy = PolicyModel(model=copy.deepcopy(model), tokenizer=tok)
    policy.share_prefix = share
    if cfg.kl_coef > 0:
        policy.snapshot_reference()
    policy.train()
    rows = rows_of(batch)
    chunks = chunks_of(rows, cfg.micro_batch)
    sums = accumulate_gradients(policy, cfg, rows, chunks, fixed_inputs(policy, cfg, rows, chunks))
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}, sums["tokens"]


@pytest.mark.parametrize("aggregate,kl,share,micro_batch", [("sequence", 0.0, True, 8), ("token", 0.1, True, 4),
                                                            ("sequence", 0.0, False, 64)])
def test_packed_update_has_the_gradients_of_the_slow_reference(tiny, aggregate, kl, share, micro_batch):
    model, tok = tiny
    batch = units(tok, model)
    cfg = LearnerConfig(micro_batch=micro_batch, aggregate=aggregate, kl_coef=kl, clip_eps=0.03)
    want = reference_gradients(model, tok, cfg, batch)
    got, tokens = packed_gradients(model, tok, cfg, batch, share)
    # At most one sequence per trajectory: at most the trajectories' last prompts, far less than every prompt.
    last = sum(len(tok(t.steps[-1].policy_prompt, add_special_tokens=False)["input_ids"]) for u in batch for t in u.trajs)
    every = sum(len(tok(s.policy_prompt, add_special_tokens=False)["input_ids"]) for u in batch for t in u.trajs
                for s in t.steps)
    assert 0 < tokens <= last < every
    assert want.keys() == got.keys() and len(want) > 10
    assert max(float(g.abs().max()) for g in want.values()) > 1e-4  # a real gradient, not zeros
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.model
async def test_engine_logprobs_equal_the_packed_recompute(smollm2, tmp_path):
    """The real engine serving a multi-turn Policy: every step's behaviour log-prob equals the
    learner's packed recompute over the whole trajectory to 1e-4 (also after a LoRA delta is published)."""
    from actors.policy import Policy
    from infra.engine.client import EngineClient
    from infra.engine.server import start_embedded_engine
    from learner.weights import WeightPublisher

    model, tok = smollm2
    engine = await start_embedded_engine(loaded=(model, tok), max_batch_size=8, weights_roots=[str(tmp_path)])
    try:
        async with EngineClient([engine.url], role="policy") as client:
            policy = Policy(client, tok, temperature=1.0, seed=0, multi_turn=True)

            async def play(key: str, n: int) -> list:
                history: list = []
                for t in range(n):
                    history.append(await policy.act(TASK, state(t), CANDS, history, affinity_key=key))
                return history

            trained = PolicyModel(lora_rank=4, model=copy.deepcopy(model), tokenizer=tok)
            for version in (0, 1):
                if version == 1:  # a non-zero LoRA delta, published: the engine serves the learner's weights
                    with torch.no_grad():
                        for n, p in trained.named_parameters():
                            if "lora_B" in n:
                                p.normal_(0, 0.02)
                    await WeightPublisher(tmp_path, client, keep=1).publish(trained, 1)
                trajs = await asyncio.gather(*(play(f"ep{k}", 3) for k in range(2)))  # concurrent: batched
                steps = [d for traj in trajs for d in traj]
                assert all(d.weight_version == version for d in steps)
                prompts = [d.prompt for d in steps]
                segs = pack_prompts(tok, prompts, [d.action_token_ids[0] for d in steps])
                assert [s.steps for s in segs] == [[0, 1, 2], [3, 4, 5]]
                with torch.no_grad():
                    got, _ = trained.forward_choice(prompts, [d.choice_token_ids for d in steps],
                                                    [d.action_token_ids[0] for d in steps])
                assert [d.logprobs[0] for d in steps] == pytest.approx(got.tolist(), abs=1e-4)
    finally:
        await engine.stop()


@pytest.mark.slow
async def test_dreamgym_train_rolls_out_multi_turn_and_trains_packed(tiny_run, redis_url):
    """`dreamgym train` (the driver's `train`) on real TextWorld games with the multi-turn policy and
    the learner's own thread settings: every trajectory it pushed is one packed sequence, and each
    update's learner tokens are exactly its trajectories' last prompts."""
    import redis.asyncio as aioredis

    from infra.config import load_config
    from infra.run.driver import train
    from infra.schema import decode_as
    from infra.streams import DATA_FIELD, run_prefix, trajectories_stream

    cfg = load_config(None, [*tiny_run, "actors.max_steps=3", "actors.multi_turn=true", "learner.total_updates=1",
                             "learner.threads=1", "learner.nice=3", "learner.checkpoint_every=5"])
    summary = await train(cfg, "packed", evaluate=False)
    assert summary["updates"] == 1 and summary["history"][0]["tokens"] > 0

    tok = load_tokenizer("smollm2")
    client = aioredis.Redis.from_url(redis_url)
    try:
        entries = await client.xrange(trajectories_stream(run_prefix(cfg.infra.stream_prefix, "packed")))
    finally:
        await client.aclose()
    trajs = [decode_as(fields[DATA_FIELD], Trajectory)
             for _, fields in entries]
    assert trajs and any(len(t.steps) > 1 for t in trajs)
    for t in trajs:
        segs = pack_prompts(tok, [s.policy_prompt for s in t.steps], [s.action_token_ids[0] for s in t.steps])
        assert len(segs) == 1, [s.steps for s in segs]  # one chat: the learner runs one forward per trajectory


def test_learner_update_thread_has_its_own_threads_and_priority():
    """learner.threads / learner.nice apply to the learner's update thread only: the caller (where
    the embedded engines run) keeps its torch thread count and its priority."""
    import concurrent.futures
    import os

    from learner.learner import init_update_thread

    before = torch.get_num_threads(), os.getpriority(os.PRIO_PROCESS, 0)
    want = 1 if before[0] != 1 else 2
    with concurrent.futures.ThreadPoolExecutor(1, initializer=init_update_thread, initargs=(want, 3)) as pool:
        threads, nice = pool.submit(lambda: (torch.get_num_threads(), os.getpriority(os.PRIO_PROCESS, 0))).result()
    assert threads == want and nice == min(19, before[1] + 3)
    assert (torch.get_num_threads(), os.getpriority(os.PRIO_PROCESS, 0)) == before
