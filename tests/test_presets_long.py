"""The harder presets of issue 64 (parts 2 and 3) load through the experiment loader and hold what they
promise: longer quests in bigger worlds, a held-out family or task type never trained on, horizons at
least twice the expert's plans, the paper's regimes, and sim-to-real within a tenth of real GRPO's budget."""

from __future__ import annotations

import pytest

from actors.envs.textworld_env import FAMILY_ARGS, generate_game, tasks_from_games
from infra.run.experiment import load_experiment, regime_named

PAPER_REGIMES = {"base", "sft", "dreamgym_grpo", "real_grpo", "dreamgym_s2r", "no_replay",
                 "no_retrieval", "no_reasoning", "no_curriculum", "no_writeback"}


def tw_make_setting(family: str, flag: str) -> int:
    args = FAMILY_ARGS[family]
    return int(args[args.index(flag) + 1])


def check_common(exp) -> None:
    names = {r.name for r in exp.regimes}
    assert PAPER_REGIMES <= names
    assert regime_named(exp, "dreamgym_s2r").continues == "dreamgym_grpo"
    real, s2r = exp.config(regime_named(exp, "real_grpo")), exp.config(regime_named(exp, "dreamgym_s2r"))
    assert real.actors.env_kind == "real" and 10 * s2r.learner.s2r_real_transitions <= real.actors.real_transitions
    # sim-to-real's budget buys whole groups: a multiple of a group's worst case (G episodes x the horizon)
    assert s2r.learner.s2r_real_transitions % (s2r.actors.group_size * s2r.actors.max_steps) == 0
    assert s2r.learner.s2r_selection == "split"
    assert exp.roles is not None and exp.roles.repeats_needed >= 3 and exp.roles.s2r == "dreamgym_s2r"
    sft, base = exp.config(regime_named(exp, "sft")), exp.config(regime_named(exp, "base"))
    assert sft.learner.total_updates == 0 < sft.learner.warm_start_steps and base.learner.warm_start_steps == 0
    # every RL regime starts from the best SFT (early stopping), the fixed 8-step start is an extra regime
    assert sft.learner.warm_start == "best" == exp.config(regime_named(exp, "dreamgym_grpo")).learner.warm_start
    weak = regime_named(exp, "sft_8steps")
    assert weak.extra and exp.config(weak).learner.warm_start == "fixed"


def test_textworld_long_preset():
    exp = load_experiment("configs/experiments/textworld_long.yaml")
    check_common(exp)
    cfg = exp.config(regime_named(exp, "dreamgym_grpo"))
    train, held = list(cfg.data.textworld_families), list(cfg.data.textworld_heldout_families)
    assert len(train) >= 2 and held and not set(held) & set(train)  # several families; one never trained on
    lengths = {f: tw_make_setting(f, "--quest-length") for f in train + held}
    assert min(lengths.values()) >= 4 and max(lengths.values()) <= 8 and max(lengths.values()) == 8
    assert all(tw_make_setting(f, "--world-size") >= 4 for f in train + held)  # textworld_cpu's are 2-3 rooms
    # the held-out family's quests are longer than any training quest (the "longer than training" slice)
    assert min(lengths[f] for f in held) > max(lengths[f] for f in train)
    assert cfg.evaluation.max_steps >= 2 * max(lengths.values())  # twice the expert's longest plan
    assert cfg.actors.max_steps >= 2 * max(lengths[f] for f in train) and cfg.simulator.max_steps == cfg.actors.max_steps
    assert cfg.data.textworld_heldout >= 4 * len(held + train)  # a few games of every held-out family
    # the claims compare like with like: real and DreamGym GRPO share the data, the groups and the step,
    # and sim-to-real's real phase stays within claim 3's 10 % of real GRPO's budget
    real, s2r = exp.config(regime_named(exp, "real_grpo")), exp.config(regime_named(exp, "dreamgym_s2r"))
    for k in ("data.textworld_games", "infra.data_dir", "actors.group_size", "learner.lr", "learner.total_updates"):
        section, key = k.split(".")
        assert getattr(getattr(real, section), key) == getattr(getattr(cfg, section), key), k
    assert 0 < s2r.learner.s2r_real_transitions <= 0.1 * real.actors.real_transitions


def test_alfworld_preset():
    exp = load_experiment("configs/experiments/alfworld_cpu.yaml")
    check_common(exp)
    cfg = exp.config(regime_named(exp, "dreamgym_grpo"))
    assert cfg.actors.env_family == "alfworld"
    held_types = list(cfg.data.alfworld_heldout_task_types)
    assert held_types and not set(held_types) & set(cfg.data.alfworld_task_types)  # a type never trained on
    # every held-out type gets problems: the split cycles through the train types and the held-out ones
    assert cfg.data.alfworld_heldout >= len(cfg.data.alfworld_task_types) + len(held_types)
    assert cfg.evaluation.max_steps >= cfg.actors.max_steps == cfg.simulator.max_steps


@pytest.mark.slow
def test_a_long_quest_game_is_made_and_its_plan_is_the_quest_length(tmp_path):
    game = generate_game("custom-4", 12345, tmp_path)
    (task,) = tasks_from_games([game], [("custom-4", 12345)])
    assert task.meta["plan_length"] == tw_make_setting("custom-4", "--quest-length") == 4
    assert "To do:" in task.initial_state and task.family == "custom-4"
