"""`engines.launch: sglang`: `dreamgym train` starts, uses and stops SGLang servers itself.

SGLang needs a CUDA GPU, so `tests/sglang_standin/` provides `python -m sglang.launch_server`
serving the embedded engine, which speaks SGLang's HTTP API (pinned by
tests/test_engine_contract.py). Everything else is the real path: the launcher's command
line, the supervisor's health wait, the engine clients, the learner's weight updates to
the launched policy server (a refused update fails the run), and the stop at the end.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from infra.config import ConfigError, load_config

pytestmark = [pytest.mark.slow]

STANDIN = Path(__file__).parent / "sglang_standin"


def _free_port_pair() -> int:
    """A port p with p + 1 also free (Mexp on p, the policy on p + 1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p < 65535 and _free(p) and _free(p + 1):
            return p
    raise RuntimeError("no free port pair")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


async def test_train_launches_sglang_servers_for_both_roles_and_stops_them(tiny_run, tmp_path, monkeypatch):
    from infra.run.driver import train

    monkeypatch.syspath_prepend(str(STANDIN))  # `sglang` importable here and in the launched servers
    monkeypatch.setenv("PYTHONPATH", str(STANDIN))
    # The stand-in's weights root: the run directory the learner publishes into (SGLang has no such check).
    monkeypatch.setenv("SGLANG_STANDIN_OVERRIDES", f"engines.weights_root={tmp_path / 'runs'}")
    port = _free_port_pair()
    cfg = load_config(None, [*tiny_run, "engines.launch=sglang", f"engines.sglang_port={port}",
                             "learner.total_updates=1", "simulator.fidelity_every=1"])  # the probe needs a Mexp
    summary = await train(cfg, "on-sglang", evaluate=False)

    assert summary["updates"] == 1 and summary["weight_version"] == 1  # the launched server took version 1
    run = tmp_path / "runs" / "on-sglang"
    for role, p in (("mexp", port), ("policy", port + 1)):
        log = (run / f"sglang-{role}.log").read_text()
        assert f"at http://127.0.0.1:{p}" in log, log[-2000:]  # the stand-in's `dreamgym serve` banner
        assert not _listening(p), f"the {role} server still listens on {p} after the run"


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def test_launch_is_validated():
    with pytest.raises(ConfigError, match="engines.launch"):
        load_config(None, ["engines.launch=vllm"])
