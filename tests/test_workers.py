"""Building rollout workers (infra/run/workers.py): the one construction the local and Ray paths share.

The Ray path through these functions is tests/test_rollout_fleet.py; the local one is
`dreamgym train` in tests/test_driver.py. Here: what each builder hands back, without
an engine (the policy engine and the experience model are not called).
"""

from __future__ import annotations

import dataclasses

from actors.envs.env_process import EnvProcess
from actors.envs.textworld_env import TextWorldEnv
from actors.policy import Policy
from infra.config import Config, rl_seed
from infra.run.workers import make_env_factory, make_policy, worker_seed, write_back_sink
from simulator.synthetic_env import SyntheticEnv


def test_synthetic_envs_share_one_experience_model_built_on_first_use():
    cfg = Config()
    cfg.simulator.max_steps = 5
    built = []

    def experience_model():
        built.append(object())
        return built[-1]

    envs = make_env_factory(cfg, experience_model)
    assert built == []  # nothing is built until a worker asks for an environment
    a, b = envs(), envs()
    assert isinstance(a, SyntheticEnv) and a is not b and a.mexp is b.mexp is built[0] and a.max_steps == 5
    assert len(built) == 1
    # generate mode's free text reaches Mexp only when the run asks for it (actors.free_text_actions)
    assert not a.accepts_free_text
    cfg.actors.free_text_actions = True
    assert make_env_factory(cfg, experience_model)().accepts_free_text


def test_real_envs_are_the_configured_family_and_never_build_an_experience_model():
    cfg = Config()
    cfg.actors.env_kind, cfg.actors.max_steps = "real", 3

    def no_mexp():
        raise AssertionError("a real environment needs no experience model")

    env = make_env_factory(cfg, no_mexp)()
    # real environments run in a supervised child process (actors.env_isolation, the default)
    assert isinstance(env, EnvProcess) and env.family == "textworld" and env.kwargs.get("max_steps") == 3
    cfg.actors.env_isolation = False  # the in-process path builds the family's class itself
    env = make_env_factory(cfg, no_mexp)()
    assert isinstance(env, TextWorldEnv) and env.max_steps == 3


def test_policy_seed_is_per_worker_and_write_back_only_for_synthetic_rollouts():
    cfg = Config()
    policy = make_policy(cfg, "client", "tokenizer", "w1")
    assert isinstance(policy, Policy) and policy.temperature == cfg.actors.temperature
    assert worker_seed(0, "w1") != worker_seed(0, "w2") and worker_seed(0, "w1") != worker_seed(1, "w1")
    assert make_policy(cfg, "c", "t", "w1").rng.random() == make_policy(cfg, "c", "t", "w1").rng.random()
    # another run seed (a repeat of an experiment regime) samples other actions on the same data
    again = dataclasses.replace(cfg, infra=dataclasses.replace(cfg.infra, run_seed=1))
    assert make_policy(again, "c", "t", "w1").rng.random() != make_policy(cfg, "c", "t", "w1").rng.random()
    assert rl_seed(cfg.infra) == cfg.infra.seed and rl_seed(again.infra) != cfg.infra.seed
    buffer = object()
    assert write_back_sink(cfg, buffer) is buffer
    cfg.simulator.write_back = False
    assert write_back_sink(cfg, buffer) is None
    cfg.simulator.write_back, cfg.actors.env_kind = True, "real"
    assert write_back_sink(cfg, buffer) is None
