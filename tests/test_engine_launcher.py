"""The SGLang launcher's supervisor, driven with a stand-in HTTP server (SGLang cannot run here)."""

from __future__ import annotations

import socket
import sys

import pytest

from infra.config import EngineConfig
from infra.engine.sglang import ProcessSupervisor, SGLangLauncher, sglang_available

STANDIN = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_supervisor_waits_for_health_and_restarts_a_dead_server(tmp_path):
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    port = _free_port()
    sup = ProcessSupervisor([sys.executable, str(script), str(port)], f"http://127.0.0.1:{port}/health",
                            startup_timeout_s=30, max_restarts=2, restart_backoff_s=0.1)
    try:
        sup.start()
        assert sup.healthy() and not sup.check()  # alive: nothing to do
        first = sup.proc.pid
        sup.proc.kill()
        sup.proc.wait()
        assert sup.check() and sup.restarts == 1
        assert sup.healthy() and sup.proc.pid != first
        sup.proc.kill()
        sup.proc.wait()
        assert sup.check() and sup.restarts == 2
        sup.proc.kill()
        sup.proc.wait()
        with pytest.raises(RuntimeError, match="giving up"):
            sup.check()
    finally:
        sup.stop()
    assert not sup.alive()


def test_supervisor_reports_a_command_that_dies_at_start(tmp_path):
    sup = ProcessSupervisor([sys.executable, "-c", "raise SystemExit(3)"], "http://127.0.0.1:9/health",
                            startup_timeout_s=10)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        sup.start()


@pytest.mark.skipif(sglang_available(), reason="sglang is installed: this checks the guard on CPU machines")
def test_sglang_launcher_is_guarded_without_sglang():
    launcher = SGLangLauncher(EngineConfig(model="/models/x"), port=30123)
    assert launcher.url == "http://127.0.0.1:30123"
    assert launcher.supervisor.env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    with pytest.raises(RuntimeError, match="sglang is not installed"):
        launcher.start()
