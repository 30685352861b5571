"""The child's side of actors/envs/env_process.py: one real environment, driven over the wire.

Run as `python -m actors.envs.env_child` by EnvProcess, never by hand. It reads the family and the
constructor's arguments, builds the environment with `registry.make_env` (in process: no second
child), answers each reset and step (a lazy info entry, a function, is asked before it is sent: the
expert's replan in ALFWorld then costs a step that the expert may not read), and leaves at `close`, at the end of its stdin, or when its
parent is gone (checked every 2 s by a thread, so a hung step does not keep it alive).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from typing import Any

from actors.envs.env_process import frame, read_frame
from actors.envs.registry import make_env
from infra.schema import Task


def _orphan_watch(parent: int) -> None:
    while True:
        time.sleep(2.0)
        if os.getppid() != parent:  # the worker is gone: end this process group (a browser it started too)
            if os.getpgrp() == os.getpid():  # EnvProcess starts it as its group's leader
                os.killpg(os.getpgrp(), signal.SIGKILL)
            os._exit(0)


def _plain(info: dict) -> dict:
    """The info dict as values: a lazy entry (ALFWorld's `expert_action` is a function when it would cost a
    replan) is asked here, since a function cannot cross the wire."""
    return {k: (v() if callable(v) else v) for k, v in info.items()}


def _error(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {str(exc)[:500]}", "reason": str(getattr(exc, "reason", "") or "env_exception")}


def main() -> int:
    wire = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # anything the environment prints, from Python or C, goes to stderr, not onto the wire
    sys.stdout = sys.stderr
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True).start()
    src = sys.stdin.buffer

    def reply(obj: Any) -> None:
        wire.write(frame(obj))

    hello = read_frame(src)
    if hello is None:
        return 0
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a checkout's own plug-in, found as in the parent
    try:
        env = make_env(hello["family"], **hello.get("kwargs", {}))
    except Exception as exc:
        reply(_error(exc))
        return 1
    reply({"ok": True, "accepts_free_text": bool(getattr(env, "accepts_free_text", False))})
    loop = asyncio.new_event_loop()
    while (msg := read_frame(src)) is not None:
        op = msg.get("op")
        try:
            if op == "reset":
                state, info = loop.run_until_complete(env.reset(Task(**msg["task"])))
                out: dict = {"state": state, "info": _plain(info)}
            elif op == "step":
                res = loop.run_until_complete(env.step(msg["action"]))
                out = {"state": res.state, "reward": float(res.reward), "done": bool(res.done), "info": _plain(res.info)}
            elif op == "close":
                loop.run_until_complete(env.close())
                reply({"ok": True})
                return 0
            else:
                out = {"error": f"unknown op {op!r}", "reason": "env_exception"}
        except Exception as exc:
            out = _error(exc)
        reply(out)
    loop.run_until_complete(env.close())
    return 0


if __name__ == "__main__":
    sys.exit(main())
