"""`dreamgym serve` in a real subprocess, and `dreamgym generate` against it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from infra.engine.server import launch_engine_process

pytestmark = [pytest.mark.slow, pytest.mark.model]


def test_serve_and_generate_commands():
    with launch_engine_process("smollm2", max_batch_size=4) as engine:
        out = subprocess.run([sys.executable, "-m", "infra.cli", "generate", "--url", engine.url, "--prompt",
                              "The capital of France is", "--max-new-tokens", "5", "--json"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert len(res["output_ids"]) == 5 and "Paris" in res["text"] and res["weight_version"] == 0
        out = subprocess.run([sys.executable, "-m", "infra.cli", "generate", "--url", engine.url, "--prompt", "Hi",
                              "--chat", "--max-new-tokens", "3", "--logprobs"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "finish=length" in out.stdout and len(out.stdout.strip().splitlines()) >= 5
    assert engine.proc.poll() is not None
    # an unreachable endpoint is a clean error, not a traceback
    out = subprocess.run([sys.executable, "-m", "infra.cli", "generate", "--url", "http://127.0.0.1:9", "--prompt", "x",
                          "--timeout", "5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "failed after" in out.stdout


def test_serve_takes_the_engine_settings_and_an_api_key():
    import os
    import urllib.request

    with launch_engine_process("smollm2", max_batch_size=2, api_key="cli-key", threads=1, prefix_cache_mb=8) as engine:
        cmd = [sys.executable, "-m", "infra.cli", "generate", "--url", engine.url, "--prompt", "Hi",
               "--max-new-tokens", "2", "--json"]
        refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert refused.returncode == 1 and "401" in refused.stdout
        ok = subprocess.run(cmd + ["--api-key", "cli-key"], capture_output=True, text=True, timeout=300)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert len(json.loads(ok.stdout.strip().splitlines()[-1])["output_ids"]) == 2
        env = {**os.environ, "DREAMGYM_API_KEY": "cli-key"}
        ok = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert ok.returncode == 0
        req = urllib.request.Request(engine.url + "/get_model_info", headers={"Authorization": "Bearer cli-key"})
        info = json.loads(urllib.request.urlopen(req, timeout=10).read())
        assert info["torch_threads"] == 1 and info["prefix_cache_mb"] == 8
