"""Child processes DreamGym starts itself (Redis, `dreamgym serve`, SGLang servers, a local Ray).

Owns how they end: a graceful SIGTERM (Redis flushes its AOF, servers drain), then
SIGKILL if one lingers past the timeout, so no caller leaves an orphan behind; and how
long a local Ray runtime's GCS may take to start (`patient_gcs_start`).
"""

from __future__ import annotations

import os
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


GCS_PORT_WAIT_S = "120"


def patient_gcs_start() -> None:
    """Let a local Ray's GCS take up to 2 minutes to publish its port (Ray's default is 30 s).

    On a loaded 2-core machine (a test suite or a second job beside this one) the GCS server has
    been measured to miss 30 s, and `ray.init` then fails with "Timed out waiting for file
    .../gcs_server_port_*". The wait only ends sooner when the port is there, so a longer one costs
    nothing on a quiet machine. An operator's own RAY_gcs_server_port_wait_time_s is kept."""
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", GCS_PORT_WAIT_S)
