"""The learner against a real Redis stream and the real SmolLM2 (LoRA keeps it cheap).

Trajectories are built the way a rollout worker builds them: choice prompts from
actors/policy.py with the real tokenizer, behaviour log-probs recomputed by
`choice_logprobs`, so the first update is on-policy (ratio 1).
"""

from __future__ import annotations

import copy

import pytest
import redis.asyncio as aioredis
import torch

from actors.policy import build_choice_prompt
from learner.choice_logprobs import choice_logprobs
from infra.config import LearnerConfig
from infra.schema import EnvKind, Status, Step, Task, Trajectory, decode_as, encode, new_id
from infra.streams import StreamConsumer, StreamProducer, trajectories_stream
from learner import checkpoint as ckpt
from learner.learner import Learner, resident_mb
from learner.policy_model import PolicyModel
from learner.weights import WeightPublisher, published_versions, version_path

pytestmark = [pytest.mark.slow, pytest.mark.model]

STATE = "Room: Kitchen. You see a table with a coin.\nInventory: nothing\nActions:\n[1] go north\n[2] take coin\n[3] open door"
CANDS = ["go north", "take coin", "open door"]


_LOGP_CACHE: dict = {}


def make_traj(tok, model, group_id, reward, version=0, n_steps=2, status=None, task_id="t1"):
    task = Task(task_id, "take the coin")
    steps = []
    for i in range(n_steps):
        prompt, labels = build_choice_prompt(tok, task, STATE, CANDS, [s.action for s in steps])
        choice = (i + int(reward)) % len(CANDS)
        key = (prompt, choice)
        if key not in _LOGP_CACHE:  # same prompt, same model: compute the behaviour log-prob once
            with torch.no_grad():
                _LOGP_CACHE[key] = float(choice_logprobs(model, tok, [prompt], [labels], [labels[choice]])[0])
        lp = _LOGP_CACHE[key]
        done = i == n_steps - 1
        steps.append(Step(state=STATE, action=CANDS[choice], reward=reward if done else 0.0, done=done,
                          policy_prompt=prompt, action_token_ids=[labels[choice]], logprobs=[lp], loss_mask=[1],
                          choice_token_ids=labels))
    st = status or (Status.SUCCESS if reward > 0 else Status.FAILURE)
    return Trajectory(task_id=task_id, group_id=group_id, steps=steps, status=st, success=reward > 0,
                      policy_version=version, task=task)


@pytest.fixture
def lora_policy(smollm2):
    model, tok = smollm2
    return PolicyModel(lora_rank=4, model=copy.deepcopy(model), tokenizer=tok)


def cfg(**kw):
    base = dict(lr=5e-3, lora_rank=4, groups_per_update=1, max_staleness=0, checkpoint_every=1, publish_every=1,
                micro_batch=8, group_timeout_s=3600.0)
    base.update(kw)
    return LearnerConfig(**base)


async def make_consumer(redis_url, name="learner-0"):
    client = aioredis.from_url(redis_url)
    stream = trajectories_stream("test")
    consumer = StreamConsumer(client, stream, "learner", name, lambda b: decode_as(b, Trajectory))
    await consumer.ensure_group()
    return client, StreamProducer(client, stream), consumer, stream


async def run_until_update(learner, tries=20):
    for _ in range(tries):
        s = await learner.step()
        if s is not None:
            return s
    raise AssertionError("no update happened")


async def test_grpo_updates_acks_drops_and_resumes(redis_url, smollm2, lora_policy, tmp_path):
    model, tok = smollm2
    client, producer, consumer, stream = await make_consumer(redis_url)
    # Publishing to a real engine is covered in test_policy.py; here the weights go to disk only.
    learner = Learner(cfg(publish_every=2), "smollm2", tmp_path, consumer, WeightPublisher(tmp_path),
                      group_size=2, policy=lora_policy, read_block_ms=50)
    curriculum_state = {"pool": ["t1"], "round": 0}
    learner.register_state("curriculum", lambda: dict(curriculum_state), lambda v: None)
    before = {n: p.detach().clone() for n, p in lora_policy.named_parameters() if p.requires_grad}

    a = [make_traj(tok, model, "A", 1.0), make_traj(tok, model, "A", 0.0)]
    b = [make_traj(tok, model, "B", 0.0), make_traj(tok, model, "B", 0.0)]  # zero variance
    c1 = make_traj(tok, model, "C", 1.0)  # its partner arrives after the restart
    broken = [make_traj(tok, model, "X", r, status=Status.SIM_ERROR) for r in (0.0, 1.0)]
    await producer.add(encode(t) for t in [a[0], b[0], c1, broken[0], b[1], a[1], broken[1]])

    s1 = await run_until_update(learner)
    assert s1.version == 1 and learner.version == 1 and s1.trajectories == 2 and s1.groups == 1
    assert s1.mean_reward == pytest.approx(0.5) and s1.steps == 4
    assert s1.clip_fraction == 0.0  # on-policy: every ratio is 1
    assert 100 < s1.resident_mb == pytest.approx(resident_mb(), rel=0.25)  # freed pages returned, then measured
    changed = [n for n, p in lora_policy.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed, "no trainable parameter moved"
    assert learner.consumed_ids == [a[0].trajectory_id, a[1].trajectory_id]
    assert s1.discarded == {"zero_variance": 2, "broken": 2}
    assert learner.set_aside == {"zero_variance": 2, "broken": 2} and learner.waiting == 1  # c1 waits for its partner
    assert published_versions(tmp_path) == []  # publish_every=2

    # Version 1 now, max_staleness 0: a version-0 group is stale, a version-1 group trains.
    d = [make_traj(tok, model, "D", 1.0, version=0), make_traj(tok, model, "D", 0.0, version=0)]
    e = [make_traj(tok, model, "E", 0.0, version=1), make_traj(tok, model, "E", 1.0, version=1)]
    await producer.add(encode(t) for t in d + e)
    s2 = await run_until_update(learner)
    assert s2.version == 2 and learner.consumed_ids[2:] == [e[0].trajectory_id, e[1].trajectory_id]
    assert published_versions(tmp_path) == [2]
    saved = {f: f.stat().st_mtime_ns for f in version_path(tmp_path, 2).iterdir()}
    await learner.publish()  # the engines already serve version 2: nothing is saved again
    assert {f: f.stat().st_mtime_ns for f in version_path(tmp_path, 2).iterdir()} == saved
    assert s2.discarded == {"stale": 2} and learner.staleness.counts().dropped == 2
    assert learner.set_aside == {"zero_variance": 2, "broken": 2, "stale": 2}  # since the start, not per update
    # A duplicate delivery (the producer retried) of a consumed trajectory is acked, not trained.
    await producer.add([encode(e[0])])
    assert await learner.step() is None
    assert learner.set_aside["duplicate"] == 1
    info = {g["name"].decode(): g for g in await client.xinfo_groups(stream)}
    assert info["learner"]["pending"] == 1  # only c1: held, waiting for its group
    assert ckpt.latest(tmp_path).name == "step_000002"

    # Restart: a new learner with the same consumer name resumes version, dedupe set and
    # its pending entry; c1's partner completes group C.
    client2, producer2, consumer2, _ = await make_consumer(redis_url)
    fresh = PolicyModel(lora_rank=4, model=copy.deepcopy(model), tokenizer=tok)
    learner2 = Learner(cfg(max_staleness=5), "smollm2", tmp_path, consumer2, None, group_size=2, policy=fresh,
                       read_block_ms=50)
    restored = {}
    learner2.register_state("curriculum", dict, restored.update)
    assert learner2.resume()
    assert restored == {"pool": ["t1"], "round": 0}
    assert learner2.version == 2 and learner2.updates == 2
    assert learner2.trained == learner.trained == 4  # counted over both processes, not from 0
    trained = {n: p for n, p in lora_policy.named_parameters() if p.requires_grad}
    for n, p in fresh.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, trained[n]), n
    c2 = make_traj(tok, model, "C", 0.0)
    await producer2.add([encode(e[1]), encode(c2)])
    s3 = await run_until_update(learner2)
    assert s3.version == 3 and learner2.consumed_ids == [c1.trajectory_id, c2.trajectory_id]
    assert learner2.trained == 6
    assert s3.discarded.get("duplicate") == 1
    info = {g["name"].decode(): g for g in await client2.xinfo_groups(stream)}
    assert info["learner"]["pending"] == 0
    await client.aclose()
    await client2.aclose()


async def test_real_phase_sets_aside_the_synthetic_phases_leftovers(redis_url, smollm2, lora_policy, tmp_path):
    """Sim-to-real: once the learner trains on real trajectories, a DreamGym-phase group still in the
    stream (informative, fresh) is set aside as `other_env` and acked, never trained."""
    model, tok = smollm2
    client, producer, consumer, stream = await make_consumer(redis_url)
    learner = Learner(cfg(), "smollm2", tmp_path, consumer, None, group_size=2, policy=lora_policy,
                      read_block_ms=50)
    assert learner.env_kind is None  # a learner on its own trains on any kind
    learner.env_kind = "real"  # what the driver's rl_phase sets from the phase's actors.env_kind
    assert learner.env_kind is EnvKind.REAL
    leftover = [make_traj(tok, model, "S", r) for r in (1.0, 0.0)]  # env_kind synthetic, the schema's default
    real = [make_traj(tok, model, "R", r) for r in (0.0, 1.0)]
    for t in real:
        t.env_kind = EnvKind.REAL
    await producer.add(encode(t) for t in leftover + real)
    s = await run_until_update(learner)
    assert learner.consumed_ids == [t.trajectory_id for t in real]
    assert s.discarded == {"other_env": 2} and learner.set_aside == {"other_env": 2}
    info = {g["name"].decode(): g for g in await client.xinfo_groups(stream)}
    assert info["learner"]["pending"] == 0  # set aside is acked with the checkpoint, not left pending
    await client.aclose()


async def test_ppo_and_importance_correction(redis_url, smollm2, tmp_path):
    model, tok = smollm2
    policy = PolicyModel(lora_rank=4, value_head=True, model=copy.deepcopy(model), tokenizer=tok)
    client, producer, consumer, _ = await make_consumer(redis_url)
    learner = Learner(cfg(algo="ppo", staleness_mode="importance", checkpoint_every=10, kl_coef=0.1),
                      "smollm2", tmp_path, consumer, None, group_size=2, policy=policy, read_block_ms=50)
    learner.version = 3  # both trajectories are 3 versions old: corrected, not dropped
    head = policy.value_head.weight.detach().clone()
    await producer.add(encode(t) for t in [make_traj(tok, model, "P", 1.0), make_traj(tok, model, "Q", 0.0)])
    s = await run_until_update(learner)
    assert s.trajectories == 2 and learner.staleness.counts().corrected == 2
    assert s.value_loss > 0 and not torch.equal(head, policy.value_head.weight)
    assert s.kl == pytest.approx(0.0, abs=1e-6)  # LoRA starts at the reference
    await client.aclose()


async def test_warm_start_raises_expert_choice_probability(smollm2, tmp_path):
    from learner.policy_sft import expert_examples, train_on_examples

    model, tok = smollm2
    policy = PolicyModel(lora_rank=4, model=copy.deepcopy(model), tokenizer=tok)
    expert = make_traj(tok, model, "G", 1.0, n_steps=2)
    expert.timings["policy_name"] = "expert"
    noisy = make_traj(tok, model, "G", 1.0)
    noisy.timings["policy_name"] = "noisy"
    failed = make_traj(tok, model, "G", 0.0)
    failed.timings["policy_name"] = "expert"
    examples = expert_examples([expert, noisy, failed], tok)
    assert len(examples) == 2  # only the successful expert's steps
    assert examples[0].target == expert.steps[0].action_token_ids[0]
    assert examples[0].prompt == expert.steps[0].policy_prompt  # the very prompt a worker would build
    shuffled = expert_examples([expert], tok, permutations=3, seed=1)
    assert len(shuffled) == 3 * 2 and shuffled[0].prompt == examples[0].prompt
    for ex, step in zip(shuffled, [s for s in expert.steps for _ in range(3)]):
        letter = tok.decode([ex.target]).strip()
        line = next(ln for ln in ex.prompt.splitlines() if ln.startswith(f"{letter}) "))
        assert step.action in line  # the target follows the action, wherever the shuffle put it
    assert len({ex.prompt for ex in shuffled[:3]}) > 1

    def mean_logp():
        with torch.no_grad():
            lp, _ = policy.forward_choice([e.prompt for e in examples], [e.labels for e in examples],
                                          [e.target for e in examples])
        return float(lp.mean())

    before = mean_logp()
    losses = train_on_examples(policy, examples, steps=3, lr=5e-3, batch_size=2)
    assert len(losses) == 3 and mean_logp() > before + 0.05


def test_warm_start_driver_entry_writes_a_loadable_model(smollm2, tmp_path):
    from infra.config import Config
    from infra.engine.models import load_model
    from learner.policy_sft import warm_start

    model, tok = smollm2
    expert = make_traj(tok, model, "G", 1.0, n_steps=1)
    expert.timings["policy_name"] = "expert"
    cfg = Config()
    cfg.learner.warm_start_steps, cfg.learner.warm_start_batch, cfg.learner.lora_rank = 1, 1, 4
    # One example in the order the step was prompted with (shuffled orders teach other letters), and
    # a rate at which one LoRA step (B starts at 0) moves the log-prob by more than fp noise.
    cfg.learner.warm_start_permutations, cfg.learner.warm_start_lr = 1, 2e-3
    out = warm_start(cfg, [expert], tmp_path / "warm")
    assert (out / "warm_start.json").exists()
    loaded, _ = load_model(str(out))  # a plain HF directory: what engines and the learner load
    with torch.no_grad():
        lp = choice_logprobs(loaded, tok, [expert.steps[0].policy_prompt], [expert.steps[0].choice_token_ids],
                             expert.steps[0].action_token_ids)
    assert float(lp[0]) > expert.steps[0].logprobs[0]  # one step towards the expert's choice
    with pytest.raises(ValueError):
        warm_start(cfg, [], tmp_path / "none")
