"""Config: presets load, overrides apply, and every error names the key and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra import presets
from infra.config import Config, ConfigError, dump, load_config, redact_url
from infra.config_doc import REGENERATE, describe, markdown

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["quickstart.yaml", "cluster.yaml"])
def test_presets_load(name):
    cfg = load_config(CONFIGS / name)
    assert isinstance(cfg, Config)


def test_overrides_apply_with_types():
    cfg = load_config(CONFIGS / "quickstart.yaml", ["learner.lr=3e-5", "actors.num_workers=3", "curriculum.enabled=false",
                                                     "engines.mexp_endpoints=[http://a:1, http://b:2]"])
    assert cfg.learner.lr == 3e-5 and cfg.actors.num_workers == 3 and cfg.curriculum.enabled is False
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
    ("engines.weights_root=/", ["engines.weights_root", "'/'"]),
    ("engines.weights_root=~/", ["engines.weights_root", "home directory"]),
    ("engines.weights_root=/root/..", ["engines.weights_root"]),
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
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_a_run_directory_loads_the_config_it_ran_with(tmp_path):
    """`dreamgym status runs/NAME` (or eval, or train): a run directory stands for its config.yaml."""
    (tmp_path / "config.yaml").write_text("learner:\n  lr: 3.0e-5\n")
    assert load_config(tmp_path).learner.lr == 3e-5


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


def test_describe_gives_type_default_check_and_help_by_section():
    text = describe()
    from infra.config import SECTIONS
    assert [ln.split(":")[0] for ln in text.splitlines() if ln and not ln.startswith(" ")] == list(SECTIONS)
    lr = text.splitlines().index("  learner.lr: float = 1e-05  [a number > 0]")
    assert text.splitlines()[lr + 1].strip() == "AdamW learning rate."
    assert "  infra.ray_runtime_env: str = 'auto'  [one of 'auto', 'off']" in text
    learner = describe(only="learner").splitlines()
    assert learner[0].startswith("learner: ") and not any(ln.startswith("  infra.") for ln in learner)
    assert any(ln.startswith("  learner.algo: str = 'grpo'") for ln in learner)
    here = describe(load_config(None, ["learner.lr=3e-5", "simulator.qdrant_api_key=hunter2"]))
    assert "learner.lr: float = 1e-05  (now: 3e-05)" in here and "hunter2" not in here  # secrets stay redacted


def test_configuration_doc_is_generated_from_the_dataclasses():
    """docs/configuration.md is `dreamgym config --markdown`: it fails here when a setting is added or changed
    and the file was not regenerated."""
    committed = (CONFIGS.parent / "docs" / "configuration.md").read_text()
    assert committed == markdown(), f"docs/configuration.md is stale: run `{REGENERATE}`"
    assert "| `learner.lr` | float | `1e-05` | a number > 0 | AdamW learning rate. |" in committed
    assert "'gym:&lt;gymnasium id>'" in committed  # a renderer would take <gymnasium id> for an HTML tag


def test_every_setting_is_in_the_doc():
    import dataclasses

    from infra.config import SECTIONS
    doc = markdown()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"| `{section}.{f.name}` |" in doc


# ----- presets: found by name from any directory, a path still wins -----
def test_a_preset_is_found_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert presets.resolve("quickstart") == CONFIGS / "quickstart.yaml"
    assert presets.resolve("quickstart.yaml") == CONFIGS / "quickstart.yaml"
    assert presets.resolve("textworld_cpu") == CONFIGS / "experiments" / "base" / "textworld_cpu.yaml"
    assert presets.resolve("textworld_cpu", "experiment") == CONFIGS / "experiments" / "textworld_cpu.yaml"
    # experiment files name their base as a repository path: found from elsewhere too
    assert presets.resolve("configs/experiments/base/textworld_cpu.yaml") == \
        CONFIGS / "experiments" / "base" / "textworld_cpu.yaml"
    assert load_config("quickstart").to_dict() == load_config(CONFIGS / "quickstart.yaml").to_dict()
    with pytest.raises(ConfigError, match="nor a shipped preset: cluster, quickstart"):
        load_config("no_such_preset")


def test_a_path_wins_over_a_shipped_preset_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart.yaml").write_text("learner:\n  lr: 0.5\n")
    assert load_config("quickstart.yaml").learner.lr == 0.5  # the user's own file
    assert load_config("quickstart").learner.lr != 0.5  # a bare name is the shipped preset
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "quickstart.yaml").write_text("learner:\n  lr: 0.25\n")
    assert load_config("configs/quickstart.yaml").learner.lr == 0.25


def test_every_shipped_preset_is_package_data():
    """pyproject.toml installs every YAML under configs/ with the package `configs` and its directories
    (so a wheel has them)."""
    import fnmatch
    import tomllib

    project = tomllib.loads((CONFIGS.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "configs*" in project["packages"]["find"]["include"] and (CONFIGS / "__init__.py").is_file()
    shipped = list(CONFIGS.rglob("*.y*ml"))
    assert len(shipped) >= 7
    for path in shipped:
        package = ".".join(path.parent.relative_to(CONFIGS.parent).parts)
        globs = project["package-data"].get(package, [])
        assert any(fnmatch.fnmatch(path.name, g) for g in globs), f"{path} is not in package-data[{package!r}]"
    assert set(presets.names()) >= {"quickstart", "cluster", "textworld_cpu"}
    assert set(presets.names("experiment")) >= {"textworld_cpu", "miniwob_cpu"}


# ----- the issue's probes: each is refused, and the error names the key -----
@pytest.mark.parametrize("override, fragments", [
    ("learner.lr=.inf", ["learner.lr", "finite"]),
    ("learner.lr=.nan", ["learner.lr", "finite"]),
    ("learner.clip_eps=1e999", ["learner.clip_eps", "finite"]),
    ("learner.max_grad_norm=-.inf", ["learner.max_grad_norm", "finite"]),
    ("infra.metrics_port=99999999", ["infra.metrics_port", "99999999", "port"]),
    ("infra.metrics_port=-1", ["infra.metrics_port", "port"]),
    ("engines.sglang_port=0", ["engines.sglang_port", "port"]),
    ("engines.sglang_port=70000", ["engines.sglang_port", "port"]),
    ("engines.mexp_endpoints=[1, null]", ["engines.mexp_endpoints", "None", "no null or empty"]),
    ("engines.mexp_endpoints=['']", ["engines.mexp_endpoints", "no null or empty"]),
    ("engines.policy_endpoints=[http://a:1, null]", ["engines.policy_endpoints", "None"]),
    ("engines.policy_endpoints=[localhost:30000]", ["engines.policy_endpoints", "http"]),
    ("engines.mexp_endpoints=['http://[bad']", ["engines.mexp_endpoints"]),
    ("actors.worker_resources={cpu: -5}", ["actors.worker_resources", "-5", ">= 0"]),
    ("actors.worker_resources={gpu: .inf}", ["actors.worker_resources", "finite"]),
    ("actors.worker_resources={gpu: many}", ["actors.worker_resources", "'many'"]),
    ("infra.stream_prefix=", ["infra.stream_prefix", "non-empty"]),
    ("infra.stream_prefix='  '", ["infra.stream_prefix", "non-empty"]),
    ("infra.max_deliveries=0", ["infra.max_deliveries", "> 0"]),
    ("actors.worker_resources={cpu: 1, cpu: 2}", ["actors.worker_resources", "duplicate key 'cpu'"]),
])
def test_issue_probes_are_refused_naming_the_key(override, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "quickstart.yaml", [override])
    for frag in fragments:
        assert frag in str(err.value), str(err.value)


def test_good_values_next_to_the_probes_still_load():
    cfg = load_config(None, ["infra.metrics_port=65535", "engines.sglang_port=1", "actors.worker_resources={cpu: 0.5}",
                             "engines.policy_endpoints=[https://p.internal:30000]", "infra.max_deliveries=1",
                             "learner.lr=1e-300"])
    assert cfg.infra.metrics_port == 65535 and cfg.actors.worker_resources == {"cpu": 0.5}
    assert cfg.infra.max_deliveries == 1 and load_config(None).infra.max_deliveries == 5


@pytest.mark.parametrize("text, key", [
    ("learner:\n  lr: 1.0e-5\n  lr: 1.0e-3\n", "lr"),
    ("learner:\n  lr: 1.0e-5\nlearner:\n  clip_eps: 0.1\n", "learner"),
    ("actors:\n  worker_resources: {cpu: 1, cpu: 2}\n", "cpu"),
])
def test_duplicate_yaml_keys_are_refused(tmp_path, text, key):
    p = tmp_path / "dup.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert f"duplicate key '{key}'" in str(err.value) and "line" in str(err.value)


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    p = tmp_path / "merge.yaml"
    p.write_text("actors:\n  <<: {group_size: 2, num_workers: 3}\n  group_size: 5\n")  # local keys override merged ones
    cfg = load_config(p)
    assert cfg.actors.group_size == 5 and cfg.actors.num_workers == 3


@pytest.mark.parametrize("url, secret", [
    ("redis://h:6379/0?password=hunter2", "hunter2"),
    ("rediss://h:6380/0?db=1&password=hunter2&ssl_cert_reqs=required", "hunter2"),
    ("redis://user:hunter2@h:6379/0", "hunter2"),
    ("redis://:hunter2@h:6379/0", "hunter2"),
    ("redis://h/0?auth_token=hunter2", "hunter2"),
])
def test_passwords_in_redis_urls_never_reach_config_yaml(url, secret):
    assert secret not in redact_url(url)
    text = dump(load_config(None, [f"infra.redis_url={url}"]))
    assert secret not in text and "***" in text
    assert "db=1" in redact_url("redis://h/0?db=1&password=x")  # other parameters survive


def test_credentials_in_any_url_setting_are_redacted_in_dump():
    cfg = load_config(None, ["simulator.qdrant_url=https://q:6333?api_key=qsecret",
                             "data.teacher_endpoint=https://user:tsecret@teacher/v1",
                             "engines.mexp_endpoints=[http://m:1, 'http://u:esecret@m:2']"])
    text = dump(cfg)
    for secret in ("qsecret", "tsecret", "esecret"):
        assert secret not in text
    assert "http://m:1" in text  # URLs without credentials are kept as they are


def test_the_generate_mode_needs_one_chat_per_episode_and_a_narrow_weights_root_passes(tmp_path):
    cfg = load_config(CONFIGS / "quickstart.yaml", ["actors.action_mode=generate", "actors.multi_turn=true",
                                                    f"engines.weights_root={tmp_path}"])
    assert cfg.actors.action_mode == "generate" and cfg.engines.weights_root == str(tmp_path)
    with pytest.raises(ConfigError, match="multi_turn=true"):
        load_config(CONFIGS / "quickstart.yaml", ["actors.action_mode=generate", "actors.multi_turn=false"])


def test_only_the_generate_mode_reads_log_probs_at_a_temperature():
    cfg = load_config(CONFIGS / "quickstart.yaml", ["actors.action_mode=generate", "actors.multi_turn=true",
                                                    "actors.temperature=1.5", "learner.logprob_temperature=1.5"])
    assert cfg.learner.logprob_temperature == 1.5
    with pytest.raises(ConfigError, match="learner.logprob_temperature: only generate mode"):
        load_config(CONFIGS / "quickstart.yaml", ["learner.logprob_temperature=1.5"])
    with pytest.raises(ConfigError, match="learner.logprob_temperature"):
        load_config(CONFIGS / "quickstart.yaml", ["actors.action_mode=generate", "actors.multi_turn=true",
                                                  "learner.logprob_temperature=0"])
