"""Starting and supervising an SGLang server on a GPU node.

Owns the `python -m sglang.launch_server` command built from `EngineConfig` and a
small supervisor: start the process, wait until `/health` answers, and restart it
(with backoff, a bounded number of times) when it dies. The supervisor is generic
over the command, so its restart logic is tested here with a stand-in HTTP server;
SGLang itself cannot run on this machine (its wheels are CUDA-only and its CPU
backend needs Intel AMX), so the SGLang path is guarded: `SGLangLauncher.start`
refuses with a clear message when `sglang` is not importable.

The server is started with SGLANG_RETURN_ORIGINAL_LOGPROB=1 so that its returned
log-probs are the raw (temperature-1) ones, as the embedded engine's are. SGLang
honours `sampling_seed` only with `--enable-deterministic-inference` (add it through
`engines.sglang_extra_args` when seeds matter more than speed).
"""

from __future__ import annotations

import http.client
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence

from infra.engine.models import resolve
from infra.processes import stop_process

log = logging.getLogger(__name__)


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def build_command(cfg, model_path: str | None = None, port: int | None = None, host: str | None = None,
                  python: str = sys.executable) -> list[str]:
    """The launch_server argv for one server (flag names as in SGLang's server_args.py).

    Binds `host` (default `engines.host`, loopback). With `engines.api_key` set, SGLang
    gets it as `--api-key` (its only way in; local users can read a process's command
    line, so on shared nodes keep the key's scope to this run).
    """
    model = model_path or cfg.model
    if model == "smollm2":
        model = str(resolve(model))
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", host or cfg.host,
           "--port", str(port if port is not None else cfg.sglang_port), "--tp-size", str(cfg.sglang_tp_size),
           "--mem-fraction-static", str(cfg.sglang_mem_fraction), "--dtype", _sglang_dtype(cfg.dtype)]
    if cfg.api_key:
        cmd += ["--api-key", cfg.api_key]
    cmd.append("--enable-metrics")  # /metrics on the same port, scraped like the embedded engine's
    cmd += [str(a) for a in cfg.sglang_extra_args]
    return cmd


def _sglang_dtype(dtype: str) -> str:
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(dtype, "auto")


class ProcessSupervisor:
    """Keeps one HTTP server process alive: start, wait for health, restart on death."""

    def __init__(self, command: Sequence[str], health_url: str, env: dict | None = None,
                 startup_timeout_s: float = 600.0, max_restarts: int = 5, restart_backoff_s: float = 2.0,
                 log_path: str | None = None):
        self.command = list(command)
        self.health_url = health_url
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.restart_backoff_s = restart_backoff_s
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the process and block until it is healthy (raises on timeout or early exit)."""
        with self._lock:
            out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
            self.proc = subprocess.Popen(self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.wait_healthy()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=5) as r:
                return r.status == 200
        # HTTPException: a port probed before the server listens can connect to itself (TCP self-connect in
        # the ephemeral range) and read back its own request line, "GET /health HTTP/1.1": not healthy yet
        except (OSError, http.client.HTTPException):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                raise RuntimeError(f"server exited with code {code} before it was healthy: {' '.join(self.command)}")
            if self.healthy():
                return
            time.sleep(0.25)
        raise TimeoutError(f"{self.health_url} not healthy after {self.startup_timeout_s:.0f} s")

    def check(self) -> bool:
        """Restart the process if it died; returns True when a restart happened."""
        if self._stop.is_set() or self.alive():
            return False
        if self.restarts >= self.max_restarts:
            raise RuntimeError(f"server died {self.restarts + 1} times; giving up: {' '.join(self.command)}")
        self.restarts += 1
        log.warning("server %s died (code %s); restart %d/%d", self.health_url,
                    self.proc.returncode if self.proc else None, self.restarts, self.max_restarts)
        time.sleep(self.restart_backoff_s)
        self.start()
        return True

    def supervise(self, interval_s: float = 2.0) -> None:
        """Check in a daemon thread until stop()."""
        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.check()
                except Exception:
                    log.exception("supervisor of %s gave up", self.health_url)
                    return

        self._thread = threading.Thread(target=loop, name="engine-supervisor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 20.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            stop_process(self.proc, timeout)


class SGLangLauncher:
    """One supervised SGLang server built from EngineConfig. `.url` once started."""

    def __init__(self, cfg, model_path: str | None = None, port: int | None = None, host: str | None = None,
                 advertise_host: str | None = None, log_path: str | None = None):
        self.cfg = cfg
        self.port = port if port is not None else cfg.sglang_port
        self.command = build_command(cfg, model_path, self.port, host)
        bound = host or cfg.host
        self.url = f"http://{advertise_host or ('127.0.0.1' if bound in ('0.0.0.0', '::') else bound)}:{self.port}"
        self.supervisor = ProcessSupervisor(self.command, self.url + "/health",
                                            env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}, log_path=log_path)

    def start(self, supervise: bool = True) -> str:
        if not sglang_available():
            raise RuntimeError("sglang is not installed (it needs a CUDA GPU node: pip install 'dreamgym[gpu]'); "
                               "on CPU use the embedded engine (`dreamgym serve`)")
        self.supervisor.start()
        if supervise:
            self.supervisor.supervise()
        return self.url

    def stop(self) -> None:
        self.supervisor.stop()
