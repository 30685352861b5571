"""Config: presets load, overrides apply, and every error names the key and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.config import Config, ConfigError, describe, dump, load_config, redact_url

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["quickstart.yaml", "cluster.yaml"])
def test_presets_load(name):
    cfg = load_config(CONFIGS / name)
    assert isinstance(cfg, Config)


def test_overrides_apply_with_types():
    cfg = load_config(CONFIGS / "quickstart.yaml", ["learner.lr=1e-5", "actors.num_workers=3", "curriculum.enabled=false",
                                                     "engines.mexp_endpoints=[http://a:1, http://b:2]"])
    assert cfg.learner.lr == 1e-5 and cfg.actors.num_workers == 3 and cfg.curriculum.enabled is False
    assert cfg.engines.mexp_endpoints == ["http://a:1", "http://b:2"]


def test_int_is_accepted_for_float():
    assert load_config(None, ["learner.lr=1"]).learner.lr == 1.0


@pytest.mark.parametrize("override, fragments", [
    ("learner.lr=abc", ["learner.lr", "'abc'", "number"]),
    ("learner.lr=-1", ["learner.lr", "-1", "> 0"]),
    ("learner.algo=dqn", ["learner.algo", "'dqn'", "'grpo'", "'ppo'"]),
    ("actors.num_workers=2.5", ["actors.num_workers", "2.5", "integer"]),
    ("curriculum.lam=1.5", ["curriculum.lam", "1.5", "[0, 1]"]),
    ("learner.nope=1", ["learner.nope", "unknown setting"]),
    ("bogus.key=1", ["bogus", "unknown section"]),
    ("learner.lr", ["section.key=value"]),
    ("curriculum.enabled=maybe", ["curriculum.enabled", "true or false"]),
])
def test_errors_name_the_key(override, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "quickstart.yaml", [override])
    for frag in fragments:
        assert frag in str(err.value)


def test_bad_yaml_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("learner:\n  lr: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    p.write_text("learner:\n  clip_eps: 0\n")
    with pytest.raises(ConfigError, match="learner.clip_eps"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_secrets_never_in_dump():
    cfg = load_config(CONFIGS / "cluster.yaml")
    text = dump(cfg)
    assert "CHANGE_ME" not in text
    assert redact_url("redis://user:pw@host:6379/0") == "redis://***@host:6379/0"
    assert redact_url("redis://host:6379") == "redis://host:6379"


def test_every_setting_has_help():
    text = describe()
    assert "learner.lr" in text and "curriculum.lam" in text
    for line in text.splitlines():
        if line.startswith("      "):
            assert line.strip(), "a setting without help text"
