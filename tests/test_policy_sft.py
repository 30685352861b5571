"""The policy warm start: the early-stopping rule and the validation split (pure), the cache key, the
generate-mode examples (masks over exactly the reply tokens, the worker's layout) and a short
generate-mode warm start on the tiny model; a tiny `dreamgym train` in best mode (slow)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from actors.generate_mode import expert_reply, next_turn
from infra.config import ActorsConfig, Config, LearnerConfig, load_config
from infra.schema import Step, Task, Trajectory
from learner.policy_sft import cache_dir, cache_settings, expert_chats
from learner.sft_validation import CurvePoint, best_index, should_stop, validation_split

STATE_A = "Room: Kitchen. You see a table with a coin.\nInventory: nothing\nActions:\n[1] go north\n[2] take coin\n[3] open door"
STATE_B = "Room: Hall. You see a door.\nInventory: coin\nActions:\n[1] go south\n[2] open door"


def pt(step, success, loss, train=None):
    return CurvePoint(step, success, loss, train)


def slow_best_and_stop(curve, patience):
    """The rule spelled out: sort by (success desc, loss asc, step asc); stop when the first evaluation to reach
    the highest success is `patience` back."""
    order = sorted(range(len(curve)), key=lambda i: (-curve[i].val_success, curve[i].val_loss, curve[i].step))
    top = curve[order[0]].val_success
    first_top = min(i for i in range(len(curve)) if curve[i].val_success == top)
    return order[0], top > 0 and len(curve) - 1 - first_top >= patience


def test_best_point_is_the_argmax_with_ties_to_lower_loss_then_fewer_steps():
    curve = [pt(0, 0.2, 2.0), pt(8, 0.6, 1.5), pt(16, 0.6, 1.2), pt(24, 0.4, 1.0), pt(32, 0.6, 1.2)]
    assert best_index(curve) == 2  # 0.6 three times: the lowest loss (1.2) twice, the fewer steps (16)
    assert should_stop(curve, 3) and not should_stop(curve, 4)  # 0.6 first reached at step 8, 3 evaluations back
    assert best_index([pt(0, 0.5, float("nan")), pt(8, 0.5, 3.0)]) == 1  # a NaN loss never wins a tie
    with pytest.raises(ValueError):
        best_index([])


def test_training_stops_exactly_patience_evaluations_after_the_best():
    import random

    rng = random.Random(0)
    for _ in range(300):
        curve = [pt(8 * i, rng.choice([0.0, 0.25, 0.5, 0.75]), rng.choice([1.0, 1.5, 2.0])) for i in range(rng.randint(1, 9))]
        patience = rng.randint(1, 4)
        best, stop = slow_best_and_stop(curve, patience)
        assert best_index(curve) == best and should_stop(curve, patience) == stop
    # rising then flat: stops after `patience` flat points, keeps the last rise
    curve = []
    for i, s in enumerate([0.1, 0.3, 0.5, 0.5, 0.4, 0.5]):
        curve.append(pt(8 * i, s, 1.0))
        if should_stop(curve, 3):
            break
    assert len(curve) == 6 and curve[best_index(curve)].step == 16
    # success saturated, the loss still falling: the loss picks the point but does not extend training
    curve = []
    for i, (s, loss) in enumerate([(0.1, 2.0), (1.0, 0.5), (1.0, 0.4), (1.0, 0.3), (1.0, 0.2), (1.0, 0.1), (1.0, 0.05)]):
        curve.append(pt(8 * i, s, loss))
        if should_stop(curve, 3):
            break
    assert len(curve) == 5 and curve[best_index(curve)].step == 32
    # nothing won yet (alfworld_cpu's first curve): patience does not run out, the lowest loss is kept
    curve = [pt(8 * i, 0.0, 2.7 - 0.3 * i) for i in range(6)]
    assert not should_stop(curve, 3) and best_index(curve) == 5
    curve.append(pt(48, 1 / 6, 1.2))
    assert not should_stop(curve, 3) and best_index(curve) == 6
    curve += [pt(56 + 8 * i, 0.0, 1.0) for i in range(3)]
    assert should_stop(curve, 3) and best_index(curve) == 6


def test_a_cached_warm_start_that_stopped_before_a_win_is_trained_again(tmp_path, monkeypatch):
    """`dreamgym train`'s warm start (infra/run/artifacts.policy_start): a cached 'best' warm start whose curve
    never won a validation game and ended before warm_start_max_steps was stopped by the old patience rule;
    it is moved aside, not reused nor deleted, and trained again. One that won a game is reused."""
    from infra.run import artifacts
    from learner import policy_sft
    from learner.sft_validation import write_curve

    cfg = load_config(None, [f"infra.data_dir={tmp_path}", "learner.warm_start=best", "learner.warm_start_steps=8",
                             "learner.warm_start_max_steps=96"])
    cache = cache_dir(cfg)

    def cached(successes):
        cache.mkdir(parents=True)
        (cache / "config.json").write_text("{}")
        write_curve(cache, [pt(8 * i, s, 2.0 - 0.1 * i) for i, s in enumerate(successes)], 0)

    built = []

    def fake_warm_start(cfg, offline, out, **kw):  # what the real one leaves in its cache directory
        built.append(out)
        cached([0.0, 0.5])
        (out / "warm_start.json").write_text(json.dumps({"mode": "fixed", "steps": 8, "examples": 1,
                                                         "first_loss": 2.0, "last_loss": 1.0}))

    monkeypatch.setattr(policy_sft, "warm_start", fake_warm_start)
    cached([0.0, 0.0, 0.0, 0.0])  # patience 3 at zero success: stopped at step 24 of 96
    assert artifacts.stopped_before_a_win(cache, 96) and not artifacts.stopped_before_a_win(cache, 24)
    assert artifacts.policy_start(cfg, []) == str(cache) and built == [cache]
    aside = list(tmp_path.glob(f"policy-warm/{cache.name}.stopped-before-a-win-*"))
    assert len(aside) == 1 and [p["val_success"] for p in json.loads((aside[0] / "warm_start_curve.json").read_text())["points"]] == [0.0] * 4
    assert not artifacts.stopped_before_a_win(cache, 96)  # the new one won a game: reused from now on
    assert artifacts.policy_start(cfg, []) == str(cache) and built == [cache]


def traj(task_id, policy="expert", success=True):
    t = Trajectory(task_id, "g", steps=[Step(state=STATE_A, action="take coin")], success=success,
                   task=Task(task_id, "take the coin", game_file=f"/games/{task_id}.z8"))
    t.timings["policy_name"] = policy
    return t


def test_validation_split_is_disjoint_from_training_and_deterministic_by_seed():
    trajs = [traj(f"t{i:02d}", p) for i in range(20) for p in ("expert", "noisy")]
    train, val, tasks = validation_split(trajs, 0.2, 2, seed=7)
    ids = {t.task_id for t in tasks}
    assert len(ids) == 4 and {t.task_id for t in val} == ids  # 20 % of 20, every trajectory of them
    assert not ids & {t.task_id for t in train} and len(train) + len(val) == len(trajs)
    again = validation_split(list(reversed(trajs)), 0.2, 2, seed=7)[2]
    assert [t.task_id for t in again] == [t.task_id for t in tasks]  # the seed decides, not the file's order
    assert {t.task_id for t in validation_split(trajs, 0.2, 2, seed=8)[2]} != ids
    assert len(validation_split(trajs[:6], 0.2, 4, seed=0)[2]) == 2  # at least min_tasks, one left to train on
    only = validation_split(trajs, 0.5, 1, seed=0, eligible=lambda t: t.task_id < "t04")[2]
    assert len(only) == 2 and all(t.task_id < "t04" for t in only)
    with pytest.raises(ValueError, match="at least 2"):
        validation_split(trajs[:2], 0.2, 1, seed=0)


def test_cache_key_counts_the_early_stopping_settings_only_in_best_mode():
    fixed = LearnerConfig(warm_start_steps=8)
    assert cache_settings(fixed, "m", "o", 0) == cache_settings(dataclasses.replace(fixed, warm_start_patience=9), "m", "o", 0)
    assert "warm_start_max_steps" not in cache_settings(fixed, "m", "o", 0)
    best = dataclasses.replace(fixed, warm_start="best")
    key = cache_settings(best, "m", "o", 0, val_episode_steps=6)
    assert key != cache_settings(fixed, "m", "o", 0) and key["warm_start_max_steps"] == best.warm_start_max_steps
    assert key != cache_settings(dataclasses.replace(best, warm_start_patience=9), "m", "o", 0, val_episode_steps=6)
    assert key != cache_settings(best, "m", "o", 0, val_episode_steps=12)
    assert key == cache_settings(dataclasses.replace(best, warm_start_steps=48), "m", "o", 0, val_episode_steps=6)


def test_cache_key_counts_every_policy_setting_that_shapes_the_warm_start():
    """Generate mode: the reply format and the chat bounds lay out the expert chats (where a chat restarts),
    so each gives a new cache; in 'best' mode free text changes the validation episodes too. Label mode keeps
    the key it had unless its chat bound is moved off the default; the device and sampling settings count nowhere."""
    fixed, best = LearnerConfig(warm_start_steps=8), LearnerConfig(warm_start_steps=8, warm_start="best")
    gen = ActorsConfig(action_mode="generate", multi_turn=True, think=False, max_reply_tokens=24)
    key = cache_settings(fixed, "m", "o", 0, gen)
    for change in ({"think": True}, {"chat_max_chars": 6_000}, {"chat_max_tokens": 1_024}, {"max_reply_tokens": 32}):
        assert cache_settings(fixed, "m", "o", 0, dataclasses.replace(gen, **change)) != key, change
    for same in ({"temperature": 0.7}, {"format_penalty": 0.1}, {"free_text_actions": True}, {"num_workers": 9}):
        assert cache_settings(fixed, "m", "o", 0, dataclasses.replace(gen, **same)) == key, same
    free = dataclasses.replace(gen, free_text_actions=True)
    assert cache_settings(best, "m", "o", 0, free, 6) != cache_settings(best, "m", "o", 0, gen, 6)
    label = ActorsConfig(multi_turn=True)
    assert cache_settings(fixed, "m", "o", 0, label) == cache_settings(fixed, "m", "o", 0)  # the default policy
    assert not {"chat_max_chars", "chat_max_tokens", "max_reply_tokens", "think"} & set(cache_settings(fixed, "m", "o", 0))
    assert cache_settings(fixed, "m", "o", 0, dataclasses.replace(label, chat_max_chars=6_000)) != \
        cache_settings(fixed, "m", "o", 0, label)
    score = ActorsConfig(action_mode="score", multi_turn=False)
    assert cache_settings(fixed, "m", "o", 0, dataclasses.replace(score, chat_max_chars=6_000)) == \
        cache_settings(fixed, "m", "o", 0, score)  # per-step prompts: no chat to bound
    # the directory `dreamgym train` reuses, from the whole config as it loads it
    over = ["learner.warm_start_steps=8", "actors.action_mode=generate", "actors.think=false"]
    dirs = {cache_dir(load_config(None, over + more)) for more in
            ([], ["actors.max_reply_tokens=24"], ["actors.chat_max_chars=6000"], ["actors.chat_max_tokens=1024"])}
    assert len(dirs) == 4


def expert_episode(reasoning=("the coin is on the table", "the door leads on")):
    t = Trajectory("t1", "g", success=True, task=Task("t1", "take the coin and leave"), steps=[
        Step(state=STATE_A, action="take coin", reasoning=reasoning[0]),
        Step(state=STATE_B, action="open door", reasoning=reasoning[1], done=True, reward=1.0)])
    t.timings["policy_name"] = "expert"
    return t


@pytest.mark.parametrize("think", [True, False])
def test_generate_examples_mask_exactly_the_reply_tokens_in_the_workers_layout(tiny_dir, think):
    from infra.engine.models import load_tokenizer

    tok = load_tokenizer(str(tiny_dir))
    episode = expert_episode()
    noisy = expert_episode()
    noisy.timings["policy_name"] = "noisy"
    [chat] = expert_chats([episode, noisy], tok, think=think)  # one chat: one expert episode, the noisy one left out
    replies = [expert_reply(s.action, s.reasoning, think) for s in episode.steps]
    assert ("<think>the coin is on the table</think>" in replies[0]) == think
    # the masked tokens are exactly the two replies, tokenised alone, in order
    assert [t for t, m in zip(chat.ids, chat.mask) if m] == sum((tok.encode(r, add_special_tokens=False) for r in replies), [])
    assert chat.mask[0] == 0 and sum(chat.mask) < len(chat.mask)
    # the unmasked tokens are what the worker sends: turn 1's prompt, then turn 2's delta after reply 1
    first = next_turn(tok, episode.task, STATE_A, ["go north", "take coin", "open door"], [], think)
    n1 = len(first.prompt_token_ids)
    assert chat.ids[:n1] == first.input_ids and chat.mask[:n1] == [0] * n1
    r1 = tok.encode(replies[0], add_special_tokens=False)
    assert chat.ids[n1:n1 + len(r1)] == r1 and chat.mask[n1:n1 + len(r1)] == [1] * len(r1)
    rest = tok.decode(chat.ids[n1 + len(r1):], skip_special_tokens=False)
    assert "Room: Hall" in rest and rest.endswith(replies[1])


def test_expert_replies_longer_than_the_reply_limit_are_warned_about(tiny_dir, caplog):
    from infra.engine.models import load_tokenizer

    tok = load_tokenizer(str(tiny_dir))
    episode = expert_episode(reasoning=("a long rationale " * 12, "short"))
    lengths = [len(tok.encode(expert_reply(s.action, s.reasoning, True), add_special_tokens=False)) for s in episode.steps]
    limit = (lengths[0] + lengths[1]) // 2
    assert lengths[1] <= limit < lengths[0]
    with caplog.at_level("WARNING", logger="learner.policy_sft"):
        expert_chats([episode], tok, think=True, max_reply_tokens=max(lengths))
        assert "longer than" not in caplog.text
        expert_chats([episode], tok, think=True, max_reply_tokens=limit)
    assert f"1 of 2 expert replies are longer than actors.max_reply_tokens={limit}" in caplog.text


def test_a_few_generate_mode_warm_start_steps_lower_the_reply_loss(tiny_dir):
    from infra.engine.models import load_tokenizer
    from learner.policy_model import PolicyModel
    from learner.policy_sft import chat_logprobs, train_on_examples, validation_loss

    tok = load_tokenizer(str(tiny_dir))
    chats = expert_chats([expert_episode()], tok, think=True)
    torch.manual_seed(0)
    policy = PolicyModel(str(tiny_dir), lora_rank=0)
    with torch.no_grad():  # the loss reads one log-prob per reply token, as a slow per-position loop does
        fast = chat_logprobs(policy, chats)
        ids = torch.tensor([chats[0].ids])
        logits = policy.lm(input_ids=ids).logits[0].float().log_softmax(-1)
        slow = torch.stack([logits[p - 1, chats[0].ids[p]] for p, m in enumerate(chats[0].mask) if m])
    assert torch.allclose(fast, slow, atol=1e-5) and fast.numel() == sum(chats[0].mask)
    before = validation_loss(policy, chats)
    losses = train_on_examples(policy, chats, steps=4, lr=3e-3, batch_size=1)
    after = validation_loss(policy, chats)
    assert len(losses) == 4 and after < before - 0.5, (before, after, losses)


@pytest.fixture(scope="module")
def tw5_data_dir(tmp_path_factory):
    """A data directory of 5 train games (tiny_run's one train game leaves none to validate on), shared."""
    return tmp_path_factory.mktemp("tw5-data")


BEST = ["data.textworld_games=5", "learner.total_updates=0", "learner.warm_start_steps=1", "learner.warm_start=best",
        "learner.warm_start_max_steps=4", "learner.warm_start_eval_every=2", "learner.warm_start_patience=2",
        "learner.warm_start_val_fraction=0.5", "learner.warm_start_val_min_tasks=1", "learner.warm_start_batch=2",
        "learner.warm_start_lr=1e-3", "evaluation.max_steps=2"]


@pytest.mark.slow
async def test_best_warm_start_through_train_writes_its_curve_and_keeps_the_best_point(tiny_run, tw5_data_dir, tmp_path):
    """`dreamgym train` with no RL (the sft regime) in best mode: the warm start holds out training
    tasks, plays them greedily in real TextWorld between segments of supervised steps, keeps the
    best point, and the curve lands beside the model and in the run directory; summary.json says
    which warm start the run used."""
    from infra.config import load_config
    from infra.run.driver import train
    from learner import policy_sft

    cfg = load_config(None, [*tiny_run, f"infra.data_dir={tw5_data_dir}", *BEST])
    summary = await train(cfg, "sft-best")
    cache = policy_sft.cache_dir(cfg)
    curve = json.loads((cache / "warm_start_curve.json").read_text())
    points = [CurvePoint(**p) for p in curve["points"]]
    assert [p.step for p in points] == [0, 2, 4]  # patience 2 never binds in 3 points; max_steps does
    assert all(p.val_episodes == len(curve["val_tasks"]) >= 1 for p in points)
    assert points[0].train_loss is None and all(p.train_loss > 0 and p.val_loss > 0 for p in points[1:])
    assert curve["best"] == best_index(points) and curve["best_step"] == points[curve["best"]].step
    assert (cache / "warm_start_curve.png").stat().st_size > 1000
    run_dir = tmp_path / "runs" / "sft-best"
    assert json.loads((run_dir / "warm_start_curve.json").read_text()) == curve
    ws = summary["warm_start"]
    assert ws["mode"] == "best" and ws["steps"] == curve["best_step"] and ws["trained_steps"] == 4
    assert ws["val_success"] == points[curve["best"]].val_success
    assert json.loads((run_dir / "summary.json").read_text())["warm_start"] == ws
    # the validation tasks are training tasks, never held-out ones
    from actors.envs.registry import load_or_make_splits

    splits = load_or_make_splits("textworld", cfg.data, cfg.infra.data_dir, seed=cfg.infra.seed)
    assert set(curve["val_tasks"]) <= {t.task_id for t in splits.train}
    assert not set(curve["val_tasks"]) & {t.task_id for t in splits.heldout}


@pytest.mark.slow
async def test_generate_mode_best_warm_start_validates_and_evaluates_in_generate_mode(tiny_run, tw5_data_dir, tmp_path):
    """actors.action_mode=generate through `dreamgym train` (no RL): the warm start trains on expert chats,
    its validation episodes and the held-out evaluation are played by the generate mode (replies written
    by the engine, parsed, invalid ones counted), and the cache is its own (generate, think)."""
    from infra.config import load_config
    from infra.run.driver import train
    from learner import policy_sft

    over = [*tiny_run, f"infra.data_dir={tw5_data_dir}", *BEST, "actors.action_mode=generate", "actors.multi_turn=true",
            "actors.think=false", "actors.max_reply_tokens=8"]
    cfg = load_config(None, over)
    summary = await train(cfg, "sft-generate")
    cache = policy_sft.cache_dir(cfg)
    assert cache != policy_sft.cache_dir(load_config(None, [*tiny_run, f"infra.data_dir={tw5_data_dir}", *BEST]))
    curve = json.loads((cache / "warm_start_curve.json").read_text())
    assert curve["action_mode"] == "generate" and [p["step"] for p in curve["points"]] == [0, 2, 4]
    # the tiny random model writes no valid <action>: every validation and held-out step is an invalid reply
    assert all(p["val_episodes"] >= 1 and p["val_success"] == 0.0 for p in curve["points"])
    assert summary["warm_start"]["action_mode"] == "generate" and summary["heldout_after"]["episodes"] == 1
    assert summary["heldout_after"]["invalid_rate"] == 1.0
