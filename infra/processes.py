"""Child processes DreamGym starts itself (Redis, `dreamgym serve`, SGLang servers).

Owns how they end: a graceful SIGTERM (Redis flushes its AOF, servers drain), then
SIGKILL if one lingers past the timeout, so no caller leaves an orphan behind.
"""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen | None, timeout: float) -> None:
    """Terminate `proc` and wait up to `timeout` seconds, then kill it; a no-op if it already exited."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
