"""A real environment in a supervised child process: a crash or a hang costs one episode.

Owns `EnvProcess`, an Environment that runs another one (any family `registry.make_env` builds)
in a child Python process (`python -m actors.envs.env_child`, the child's side), and `Isolation`, the settings and
the crash book that the EnvProcesses of one caller share. The rules:

- the wire is length-prefixed msgpack frames over the child's stdin and stdout; nothing is pickled.
  The child moves its own stdout onto stderr before anything else, so a library that prints (from
  Python or C) cannot corrupt the wire. A task travels as its wire-schema fields; an info value
  msgpack cannot carry travels as its `str()`.
- the child starts at the first reset and again at the reset after it was lost. Starting has its
  own bound (`Isolation.start_timeout_s`: importing a game engine or a browser takes seconds on a
  loaded machine), not the step's.
- a reset or step with no answer within `step_timeout_s` kills the child (SIGKILL) and raises
  `EnvTimeout` (reason `env_timeout`); a child that exits or dies by a signal during a call raises
  `EnvCrash` (`env_crash`) with its exit status and the last line of its stderr (TextWorld's
  interpreter calls exit() from C on a corrupt game: `Fatal error: Unknown Z-code version`). The
  episode loop records the reason (actors/episode.py, `timings["env_error"]`); the next reset
  starts a fresh child. An exception the environment raises is re-raised here as `EnvException`
  (its own `reason` if it has one, else `env_exception`), and the child lives on.
- a closed EnvProcess hands its live child to the Isolation (up to `max_idle` kept), and the next
  EnvProcess of the same family and arguments takes it: a rollout worker's environment lives one
  episode, and a child costs an interpreter start and the environment's imports (seconds). A reset
  re-opens the task, so nothing of the last episode carries over. `Isolation.close()` ends the idle ones.
- a task whose environment crashed or hung `max_crashes` times (keyed by its game file, else its
  id) is refused at reset without a child (`EnvRefused`, `env_refused`), named in one log line.

The child also leaves when its parent goes (stdin closes, or its parent process id changes while a
step hangs), so a killed worker leaves no game interpreters behind. The child leads its own process
group, and ending it ends the group: a browser or driver it started (MiniWoB, BrowserGym) goes with it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgpack

from actors.envs.base import LockedThreadCore, StepResult
from infra import metrics
from infra.schema import Task

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20  # a state and its info; anything larger is a broken child


class EnvProcessError(RuntimeError):
    """The environment's child process failed a call; `reason` is what the episode records."""

    reason = "env_exception"


class EnvCrash(EnvProcessError):
    reason = "env_crash"


class EnvTimeout(EnvProcessError):
    reason = "env_timeout"


class EnvRefused(EnvProcessError):
    reason = "env_refused"


class EnvException(EnvProcessError):
    """The environment raised inside the child (the child is alive); `reason` is the exception's own."""

    def __init__(self, message: str, reason: str = "env_exception"):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass
class Isolation:
    """How real environments run out of process; one per caller, shared by its EnvProcesses (the crash book)."""

    step_timeout_s: float = 60.0
    max_crashes: int = 2
    start_timeout_s: float = 300.0
    max_idle: int = 8  # children kept for the next environment of the same family (a rollout worker's env lives one episode)
    crashes: dict = dataclasses.field(default_factory=dict)  # task key -> crashes and hangs
    _idle: dict = dataclasses.field(default_factory=dict, repr=False)  # (family, kwargs) -> [(Popen, stderr, free text)]
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_config(cls, actors_cfg: Any) -> "Isolation | None":
        """The isolation `actors.env_isolation` asks for (None: environments run in this process)."""
        if not getattr(actors_cfg, "env_isolation", True):
            return None
        return cls(step_timeout_s=float(getattr(actors_cfg, "env_step_timeout_s", 60.0)),
                   max_crashes=int(getattr(actors_cfg, "env_max_crashes", 2)))

    def count(self, key: str) -> int:
        with self._lock:
            self.crashes[key] = self.crashes.get(key, 0) + 1
            return self.crashes[key]

    def refused(self, key: str) -> bool:
        return self.max_crashes > 0 and self.crashes.get(key, 0) >= self.max_crashes

    def take(self, key: tuple) -> tuple | None:
        """An idle live child of `key`, or None."""
        with self._lock:
            idle = self._idle.get(key, [])
            while idle:
                child = idle.pop()
                if child[0].poll() is None:
                    return child
        return None

    def give(self, key: tuple, child: tuple) -> bool:
        """Keep a live child for the next environment of `key`; False when `max_idle` are kept already."""
        with self._lock:
            if sum(len(v) for v in self._idle.values()) >= self.max_idle:
                return False
            self._idle.setdefault(key, []).append(child)
            return True

    def close(self) -> None:
        """End the idle children (those in use end with their EnvProcess's close)."""
        with self._lock:
            children = [c for v in self._idle.values() for c in v]
            self._idle.clear()
        for proc, stderr, _ in children:
            _end(proc, stderr, grace_s=5.0)


def _end(proc: subprocess.Popen, stderr: Any, grace_s: float = 0.0) -> None:
    """End a child and whatever it started (a browser and its driver: the child leads its own process
    group). With `grace_s`, first close its stdin and wait that long: the child then closes its
    environment itself (a browser quits), as `close` does."""
    if grace_s > 0 and proc.poll() is None:
        try:
            proc.stdin.close()
            proc.wait(timeout=grace_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:  # the group outlives a leader that died first (a crash); pids are not reused while it lives
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for f in (proc.stdin, proc.stdout, stderr):
        try:
            if f is not None:
                f.close()
        except OSError:
            pass


def task_key(task: Task) -> str:
    return task.game_file or task.task_id


def _named(task: Task | None) -> str:
    if task is None:
        return "start"
    return f"task {task.task_id}" + (f" ({task.game_file})" if task.game_file else "")


def frame(obj: Any) -> bytes:
    """One message on the wire: its msgpack length, then the msgpack (a value msgpack cannot carry as its str())."""
    body = msgpack.packb(obj, use_bin_type=True, default=str)
    return _HEADER.pack(len(body)) + body


def read_frame(f: Any) -> Any:
    """The next message from a blocking binary file, or None at its end."""
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(header)
    body = f.read(n)
    return msgpack.unpackb(body, raw=False) if len(body) == n else None


class _Lost(Exception):
    """The child's end of the wire closed."""


class EnvProcess(LockedThreadCore):
    """The Environment interface over `family`'s environment in a child process (see the module docstring).

    `kwargs` go to the environment's constructor in the child (plain values: max_steps)."""

    def __init__(self, family: str, isolation: Isolation | None = None, **kwargs: Any):
        self.family = family
        self.kwargs = kwargs
        self.iso = isolation or Isolation()
        self.accepts_free_text = False  # the child's environment says, once started
        self._core_lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._stderr: Any = None
        self._task: Task | None = None

    # --- the child ---------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _key(self) -> tuple:
        return (self.family, repr(sorted(self.kwargs.items())))

    def _start(self) -> None:
        idle = self.iso.take(self._key())
        if idle is not None:
            self._proc, self._stderr, self.accepts_free_text = idle
            return
        self._stderr = tempfile.TemporaryFile()
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._proc = subprocess.Popen([sys.executable, "-m", "actors.envs.env_child"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr, env=env, bufsize=0,
                                      start_new_session=True)  # its own group: `_end` ends a browser with it
        reply = self._call({"family": self.family, "kwargs": self.kwargs}, self.iso.start_timeout_s, None, "start")
        self.accepts_free_text = bool(reply.get("accepts_free_text", False))

    def _kill(self) -> None:
        proc, stderr, self._proc, self._stderr = self._proc, self._stderr, None, None
        if proc is not None:
            _end(proc, stderr)
        elif stderr is not None:
            stderr.close()

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        try:
            self._stderr.seek(0, os.SEEK_END)
            size = self._stderr.tell()
            self._stderr.seek(max(0, size - 4000))
            lines = [ln.strip() for ln in self._stderr.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except (OSError, ValueError):
            return ""
        return lines[-1][:300] if lines else ""

    def _lost(self, op: str, task: Task | None, exc_cls: type, why: str) -> EnvProcessError:
        """Kill what is left of the child; the error to raise, counted against the task."""
        tail = self._stderr_tail()
        self._kill()
        metrics.ENV_PROCESS_FAILURES.labels(self.family, exc_cls.reason).inc()
        n = self.iso.count(task_key(task)) if task is not None else 0
        msg = (f"{self.family}: {why} during {op} of {_named(task)}" + (f"; stderr: {tail}" if tail else "")
               + (f" (failure {n} of {self.iso.max_crashes} before the task is refused)" if task is not None else ""))
        log.warning("%s", msg)
        return exc_cls(msg)

    def _call(self, msg: dict, timeout: float, task: Task | None, op: str) -> dict:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            os.write(proc.stdin.fileno(), frame(msg))
            header = self._read(proc.stdout.fileno(), _HEADER.size, time.monotonic() + timeout)
            (n,) = _HEADER.unpack(header)
            if n > MAX_FRAME_BYTES:
                raise _Lost(f"a frame of {n} bytes")
            reply = msgpack.unpackb(self._read(proc.stdout.fileno(), n, time.monotonic() + timeout), raw=False)
        except TimeoutError:
            raise self._lost(op, task, EnvTimeout, f"no answer in {timeout:g} s (actors.env_step_timeout_s); "
                                                   "the process was killed") from None
        except (_Lost, BrokenPipeError, OSError, ValueError, msgpack.UnpackException):
            try:
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            status = ("still running, its wire broken" if code is None else
                      f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}")
            raise self._lost(op, task, EnvCrash, f"the environment process died ({status})") from None
        if "error" in reply:
            if op == "start":
                self._kill()
            raise EnvException(f"{self.family}: {reply['error']} (during {op} of {_named(task)})",
                               str(reply.get("reason") or "env_exception"))
        return reply

    @staticmethod
    def _read(fd: int, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise _Lost("end of stream")
            buf += chunk
        return bytes(buf)

    # --- the sync core LockedThreadCore drives --------------------------------------
    def reset_sync(self, task: Task) -> tuple[str, dict[str, Any]]:
        key = task_key(task)
        if self.iso.refused(key):
            metrics.ENV_TASKS_REFUSED.labels(self.family).inc()
            raise EnvRefused(f"{self.family}: {_named(task)} refused: its environment crashed or hung "
                             f"{self.iso.crashes.get(key, 0)} times (actors.env_max_crashes)")
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._start()
        self._task = task
        reply = self._call({"op": "reset", "task": dataclasses.asdict(task)}, self.iso.step_timeout_s, task, "reset")
        return reply["state"], reply["info"]

    def step_sync(self, action: str) -> StepResult:
        if self._proc is None:
            raise EnvCrash(f"{self.family}: step without a live environment process (reset first)")
        reply = self._call({"op": "step", "action": action}, self.iso.step_timeout_s, self._task, "step")
        return StepResult(reply["state"], float(reply["reward"]), bool(reply["done"]), reply["info"])

    def close_sync(self) -> None:
        """Hand a live child to the Isolation's idle children (the next environment of this family starts
        at no cost), or close it when enough are idle."""
        if self._proc is not None and self._proc.poll() is None:
            if self.iso.give(self._key(), (self._proc, self._stderr, self.accepts_free_text)):
                self._proc, self._stderr, self._task = None, None, None
                return
            try:
                self._call({"op": "close"}, 10.0, None, "close")
            except EnvProcessError:
                pass
        self._kill()
